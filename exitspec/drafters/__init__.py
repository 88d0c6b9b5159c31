"""Drafters propose future tokens; `base.Drafter` is the protocol the decode loop speaks."""

from __future__ import annotations

from pathlib import Path

from exitspec.drafters.base import Drafter
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "DFlashDrafter", "NgramDrafter", "load_drafter"]


def load_drafter(spec: str | Path, target_hf_model) -> Drafter:
    """'ngram' (prompt lookup, training-free) or a DFlash checkpoint folder for this target model."""
    if str(spec) == "ngram":
        return NgramDrafter()
    folder = Path(spec)
    if not folder.is_dir():
        raise ValueError(f"unknown drafter {str(spec)!r}: use 'ngram' or a DFlash checkpoint folder")
    return DFlashDrafter.from_pretrained(folder, target_hf_model)
