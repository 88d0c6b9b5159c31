"""Drafters propose future tokens; `base.Drafter` is the protocol the decode loop speaks."""

from __future__ import annotations

from pathlib import Path

from exitspec.drafters.base import Drafter
from exitspec.drafters.chain import ChainDrafter, split_chain
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.lookup import LOOKUP_NAME, NgramTable
from exitspec.drafters.model import ModelDrafter, first_layers, load_draft_model
from exitspec.drafters.ngram import NgramDrafter
from exitspec.drafters.suffix import SuffixDrafter
from exitspec.models import default_model_path
from exitspec.settings import DRAFT_MODEL_PREFIXES, DRAFTER_HELP

__all__ = [
    "DRAFTER_HELP", "SHIPPED", "SHIPPED_LOOKUP", "ChainDrafter", "DFlashDrafter", "Drafter", "ModelDrafter",
    "NgramDrafter", "NgramTable", "SuffixDrafter", "default_drafter", "draft_model", "drafter_folder", "load_drafter",
    "split_chain",
]

TRAINING_FREE = ("ngram", "suffix")  # drafters without a checkpoint: prompt lookup, suffix trees
_ASSETS = Path(__file__).resolve().parent.parent / "assets"
# the DFlash drafter shipped for the default model (SmolLM2-135M-Instruct), by spec name: trained on 8626 target
# rollouts (chat, code, math; greedy and T = 1) with the kl (Draft-OPD) loss; record in
# data/dflash-runs/smollm2-135m-instruct-v2
SHIPPED = {"dflash": _ASSETS / "dflash-smollm2-135m-instruct"}
# the corpus-lookup table of the default model's own responses, which the shipped drafter uses
SHIPPED_LOOKUP = _ASSETS / "lookup-smollm2-135m-instruct" / LOOKUP_NAME


def default_drafter(model) -> str:
    """The drafter used when none is named: 'dflash' (shipped) for the default model (None, or a loaded model read
    from exitspec's converted folder of it), else 'ngram'."""
    if hasattr(model, "name_or_path"):  # a loaded transformers model
        return "dflash" if Path(model.name_or_path).resolve() == default_model_path().resolve() else "ngram"
    return "dflash" if model is None else "ngram"


def drafter_folder(spec: str | Path) -> Path | None:
    """The DFlash checkpoint folder a drafter spec names: None for 'ngram', 'suffix' and draft models (model:PATH,
    layers:K), the shipped one for a name in SHIPPED."""
    spec, _ = split_chain(spec)
    if spec in TRAINING_FREE or str(spec).startswith(DRAFT_MODEL_PREFIXES):
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


def load_drafter(spec: str | Path, target_hf_model, lookup: str | Path = "auto", weight_copies: bool = True) -> Drafter:
    """A shipped drafter's name ('dflash'), 'ngram' (prompt lookup) or 'suffix' (suffix
    trees; both training-free), a DFlash checkpoint folder for this target model, a draft model (model:PATH, a
    causal LM folder of the target's tokenizer; layers:K, the target's first K layers), each growing dynamic
    trees (model.py; `weight_copies` as the target's: TargetModel); chain:SPEC for the best path of SPEC's trees.

    `lookup`: the corpus-lookup table a DFlash drafter adds to its trees (lookup.py). "auto": the shipped one
    for a shipped drafter, else the checkpoint folder's `lookup.safetensors` if it has one; "none": no table;
    or a table's path."""
    name, chained = split_chain(spec)
    folder = drafter_folder(spec)
    vocab_size = target_hf_model.get_output_embeddings().weight.shape[0]
    if name.startswith(DRAFT_MODEL_PREFIXES):
        if str(lookup) not in ("auto", "none"):
            raise ValueError(f"a lookup table adds to a DFlash drafter's trees; {name!r} takes none")
        drafter = ModelDrafter(draft_model(name, target_hf_model), name, weight_copies=weight_copies)
    elif folder is None:
        if str(lookup) not in ("auto", "none"):
            raise ValueError(f"a lookup table adds to a DFlash drafter's trees; {name!r} takes none")
        drafter = NgramDrafter() if name == "ngram" else SuffixDrafter(vocab_size)
    else:
        path = _lookup_path(name, folder, lookup)
        table = NgramTable.load(path, vocab_size) if path is not None else None
        drafter = DFlashDrafter.from_pretrained(folder, target_hf_model, lookup=table, weight_copies=weight_copies)
    return ChainDrafter(drafter) if chained else drafter


def draft_model(spec: str, target_hf_model):
    """The draft model of a model:PATH or layers:K spec (a transformers model: transformers' assisted generation
    takes it too, bench/peers.py)."""
    kind, _, value = spec.partition(":")
    if kind == "layers":
        if not value.isdigit():
            raise ValueError(f"drafter {spec!r}: layers:K takes a number of the target's layers, e.g. layers:4")
        return first_layers(target_hf_model, int(value))
    folder = Path(value).expanduser()
    if not value or not folder.is_dir():
        raise ValueError(f"drafter {spec!r}: model:PATH takes a local causal-LM folder, and {value!r} is not a folder")
    return load_draft_model(folder, target_hf_model)


def _lookup_path(spec: str, folder: Path, lookup: str | Path) -> Path | None:
    """The lookup table's path for a DFlash drafter (see load_drafter), None for none."""
    if str(lookup) == "none":
        return None
    if str(lookup) != "auto":
        return Path(lookup)
    if spec in SHIPPED:
        return SHIPPED_LOOKUP
    return folder / LOOKUP_NAME if (folder / LOOKUP_NAME).is_file() else None
