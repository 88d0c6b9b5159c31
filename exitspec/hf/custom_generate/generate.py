"""transformers' entry point (`model.generate(..., custom_generate=exitspec.hf.CUSTOM_GENERATE)`): exitspec's loop."""

from exitspec.hf.generation import generate

__all__ = ["generate"]
