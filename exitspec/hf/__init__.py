"""exitspec from transformers: `model.generate(..., custom_generate=exitspec.hf.CUSTOM_GENERATE)`.

CUSTOM_GENERATE is a local folder holding `custom_generate/generate.py`, transformers' convention for swapping
the decoding loop of `model.generate` (transformers 5 asks `trust_remote_code=True` for a local folder too):

    import exitspec.hf
    out = model.generate(**inputs, custom_generate=exitspec.hf.CUSTOM_GENERATE, trust_remote_code=True,
                         drafter="dflash", budget="auto", max_new_tokens=128, do_sample=True, temperature=0.7)

The loop it runs is `generation.generate`: exact tree speculative decoding of `model` itself, its weights
used in place (`SpeculativeDecoder.from_model`).
"""

from pathlib import Path

from exitspec.hf.generation import ExitspecGenerateOutput, generate

CUSTOM_GENERATE = str(Path(__file__).resolve().parent)  # holds custom_generate/generate.py

__all__ = ["CUSTOM_GENERATE", "ExitspecGenerateOutput", "generate"]
