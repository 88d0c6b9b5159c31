"""Drafters propose future tokens; `base.Drafter` is the protocol the decode loop speaks."""

from __future__ import annotations

from pathlib import Path

from exitspec.drafters.base import Drafter
from exitspec.drafters.chain import ChainDrafter, split_chain
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.lookup import LOOKUP_NAME, NgramTable
from exitspec.drafters.ngram import NgramDrafter
from exitspec.drafters.suffix import SuffixDrafter
from exitspec.models import default_model_path
from exitspec.options import DRAFTER_HELP

__all__ = [
    "DRAFTER_HELP", "SHIPPED", "SHIPPED_LOOKUP", "ChainDrafter", "DFlashDrafter", "Drafter", "NgramDrafter",
    "NgramTable", "SuffixDrafter", "default_drafter", "drafter_folder", "load_drafter", "split_chain",
]

TRAINING_FREE = ("ngram", "suffix")  # drafters without a checkpoint: prompt lookup, suffix trees
_ASSETS = Path(__file__).resolve().parent.parent / "assets"
# the DFlash drafters shipped for the default model (SmolLM2-135M-Instruct), by spec name:
#   dflash     trained on 8626 target rollouts (chat, code, math; greedy and T = 1) with the kl (Draft-OPD) loss;
#              record in data/dflash-runs/smollm2-135m-instruct-v2
#   dflash-v1  the first drafter, on 800 greedy rollouts; record in data/dflash-runs/smollm2-135m-instruct
#   exittrain  dflash-v1 fine-tuned with the exit-weighted loss; record in data/exittrain-runs/smollm2-135m-instruct
SHIPPED = {
    "dflash": _ASSETS / "dflash-smollm2-135m-instruct",
    "dflash-v1": _ASSETS / "dflash-v1-smollm2-135m-instruct",
    "exittrain": _ASSETS / "exittrain-smollm2-135m-instruct",
}
# the corpus-lookup table of the default model's own responses, which the shipped drafters use
SHIPPED_LOOKUP = _ASSETS / "lookup-smollm2-135m-instruct" / LOOKUP_NAME


def default_drafter(model) -> str:
    """The drafter used when none is named: 'dflash' (shipped) for the default model (None, or a loaded model read
    from exitspec's converted folder of it), else 'ngram'."""
    if hasattr(model, "name_or_path"):  # a loaded transformers model
        return "dflash" if Path(model.name_or_path).resolve() == default_model_path().resolve() else "ngram"
    return "dflash" if model is None else "ngram"


def drafter_folder(spec: str | Path) -> Path | None:
    """The checkpoint folder a drafter spec names: None for 'ngram' and 'suffix', the shipped one for a name in
    SHIPPED."""
    spec, _ = split_chain(spec)
    if spec in TRAINING_FREE:
        return None
    if str(spec) in SHIPPED:
        folder = SHIPPED[str(spec)]
        if not (folder / "config.json").is_file():
            raise ValueError(f"the shipped drafter {str(spec)!r} is missing from this install ({folder})")
        return folder
    folder = Path(spec)
    if not folder.is_dir():
        raise ValueError(
            f"unknown drafter {str(spec)!r}: use {', '.join(map(repr, SHIPPED))}, 'ngram', 'suffix' or a DFlash "
            "checkpoint folder"
        )
    return folder


def load_drafter(spec: str | Path, target_hf_model, lookup: str | Path = "auto") -> Drafter:
    """A shipped drafter's name ('dflash', 'dflash-v1', 'exittrain'), 'ngram' (prompt lookup) or 'suffix' (suffix
    trees; both training-free), or a DFlash checkpoint folder for this target model; chain:SPEC for the best path
    of SPEC's trees.

    `lookup`: the corpus-lookup table a DFlash drafter adds to its trees (lookup.py). "auto": the shipped one
    for a shipped drafter, else the checkpoint folder's `lookup.safetensors` if it has one; "none": no table;
    or a table's path."""
    name, chained = split_chain(spec)
    folder = drafter_folder(spec)
    vocab_size = target_hf_model.get_output_embeddings().weight.shape[0]
    if folder is None:
        if str(lookup) not in ("auto", "none"):
            raise ValueError(f"a lookup table adds to a DFlash drafter's trees; {name!r} takes none")
        drafter = NgramDrafter() if name == "ngram" else SuffixDrafter(vocab_size)
    else:
        path = _lookup_path(name, folder, lookup)
        table = NgramTable.load(path, vocab_size) if path is not None else None
        drafter = DFlashDrafter.from_pretrained(folder, target_hf_model, lookup=table)
    return ChainDrafter(drafter) if chained else drafter


def _lookup_path(spec: str, folder: Path, lookup: str | Path) -> Path | None:
    """The lookup table's path for a DFlash drafter (see load_drafter), None for none."""
    if str(lookup) == "none":
        return None
    if str(lookup) != "auto":
        return Path(lookup)
    if spec in SHIPPED:
        return SHIPPED_LOOKUP
    return folder / LOOKUP_NAME if (folder / LOOKUP_NAME).is_file() else None
