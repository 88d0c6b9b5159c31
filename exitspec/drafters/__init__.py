"""Drafters propose future tokens; `base.Drafter` is the protocol the decode loop speaks."""

from exitspec.drafters.base import Drafter

__all__ = ["Drafter"]
