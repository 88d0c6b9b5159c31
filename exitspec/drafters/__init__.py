"""Drafters propose future tokens; `base.Drafter` is the protocol the decode loop speaks."""

from __future__ import annotations

from pathlib import Path

from exitspec.drafters.base import Drafter
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.ngram import NgramDrafter

__all__ = [
    "SHIPPED_DFLASH", "DFlashDrafter", "Drafter", "NgramDrafter", "default_drafter", "drafter_folder", "load_drafter"
]

# the DFlash drafter trained for the default model (SmolLM2-135M-Instruct); its training run, command and
# record are in data/dflash-runs/smollm2-135m-instruct
SHIPPED_DFLASH = Path(__file__).resolve().parent.parent / "assets" / "dflash-smollm2-135m-instruct"


def default_drafter(model: str | Path | None) -> str:
    """The drafter used when none is named: 'dflash' (shipped) for the default model, else 'ngram'."""
    return "dflash" if model is None else "ngram"


def drafter_folder(spec: str | Path) -> Path | None:
    """The checkpoint folder a drafter spec names: None for 'ngram', the shipped one for 'dflash'."""
    if str(spec) == "ngram":
        return None
    if str(spec) == "dflash":
        if not (SHIPPED_DFLASH / "config.json").is_file():
            raise ValueError(f"the shipped DFlash drafter is missing from this install ({SHIPPED_DFLASH})")
        return SHIPPED_DFLASH
    folder = Path(spec)
    if not folder.is_dir():
        raise ValueError(f"unknown drafter {str(spec)!r}: use 'dflash', 'ngram' or a DFlash checkpoint folder")
    return folder


def load_drafter(spec: str | Path, target_hf_model) -> Drafter:
    """'dflash' (the DFlash drafter shipped for the default model), 'ngram' (prompt lookup, training-free) or
    a DFlash checkpoint folder for this target model."""
    folder = drafter_folder(spec)
    return NgramDrafter() if folder is None else DFlashDrafter.from_pretrained(folder, target_hf_model)
