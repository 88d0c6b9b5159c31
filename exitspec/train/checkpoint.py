"""Training checkpoints without pickle, each one folder written as a temporary sibling and renamed into place:

    step-00000500/
        drafter/                the drafter, DFlashModel.save_pretrained (config.json + model.safetensors)
        optimizer.safetensors   AdamW state tensors, keyed "<parameter name>/<state key>" (exp_avg, step, ...)
        state.json              step, data position, run config, AdamW param-group scalars, world size
        rng-rank<r>.json        process r's RNG states: python, torch CPU, CUDA devices, the anchor generator

A folder that is not fully written never carries a step-* name, so the newest step-* folder is always whole.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from exitspec.atomic import replace_folder
from exitspec.drafters.dflash_model import WEIGHTS_NAME, DFlashModel
from exitspec.models import check_safetensors
from exitspec.train.dist import Dist, barrier

PREFIX = "step-"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "state.json"


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None."""
    done = [p for p in Path(folder).glob(f"{PREFIX}*") if (p / STATE_NAME).is_file()]
    return max(done, key=lambda p: p.name, default=None)


def save_checkpoint(
    folder: str | Path,
    step: int,
    drafter: DFlashModel,
    optimizer: torch.optim.Optimizer,
    state: dict,
    generator: torch.Generator,
    d: Dist,
    keep: int = 2,
) -> Path:
    """Collective: every process writes its RNG states, the main one the rest; keeps the newest `keep`."""
    folder = Path(folder)
    final, tmp = folder / f"{PREFIX}{step:08d}", folder / f".{PREFIX}{step:08d}.tmp"
    if d.main:
        for stale in folder.glob(f".{PREFIX}*.tmp"):  # left by a process killed while saving
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    barrier()
    _write_json(tmp / f"rng-rank{d.rank}.json", rng_state(generator))
    barrier()
    if d.main:
        drafter.save_pretrained(tmp / "drafter")
        tensors, groups = optimizer_to_flat(optimizer, drafter)
        save_file(tensors, tmp / OPTIMIZER_NAME, metadata={"format": "pt"})
        _write_json(tmp / STATE_NAME, {**state, "world_size": d.world, "optimizer_groups": groups})
        replace_folder(tmp, final)  # an existing one: the same step saved again by a rerun from an older checkpoint
        for old in sorted(folder.glob(f"{PREFIX}*"), key=lambda p: p.name)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def read_state(path: str | Path) -> dict:
    """A checkpoint's state.json: step, data position, run config, optimizer groups, world size."""
    return json.loads((Path(path) / STATE_NAME).read_text())


def load_checkpoint(
    path: str | Path, drafter: DFlashModel, optimizer: torch.optim.Optimizer, generator: torch.Generator, d: Dist
) -> dict:
    """Restores weights, optimizer state and this process's RNG states in place; returns state.json."""
    path = Path(path)
    state = read_state(path)
    if state["world_size"] != d.world:
        raise ValueError(
            f"{path} was written by {state['world_size']} processes; resume it with as many (this run has {d.world}) "
            "for the same data order and RNG streams, or start a new run with --init"
        )
    for weights in (path / "drafter" / WEIGHTS_NAME, path / OPTIMIZER_NAME):
        check_safetensors(weights, "delete this checkpoint to resume from the one before it")
    drafter.load_state_dict(load_file(path / "drafter" / WEIGHTS_NAME))
    optimizer_from_flat(optimizer, drafter, load_file(path / OPTIMIZER_NAME), state["optimizer_groups"])
    set_rng_state(json.loads((path / f"rng-rank{d.rank}.json").read_text()), generator)
    return state


# ---------------------------------------------------------------------------------------------------------
# Optimizer state <-> safetensors + JSON


def _param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Name of each optimizer parameter, in the optimizer's index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_to_flat(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[dict, list[dict]]:
    """(tensors {"<param>/<key>": Tensor}, param groups as JSON-able dicts with parameter names)."""
    names = _param_names(optimizer, model)
    sd = optimizer.state_dict()
    tensors = {f"{names[i]}/{k}": v.detach().contiguous().cpu() for i, s in sd["state"].items() for k, v in s.items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return tensors, groups


def optimizer_from_flat(optimizer: torch.optim.Optimizer, model: nn.Module, tensors: dict, groups: list[dict]) -> None:
    names = _param_names(optimizer, model)
    index = {n: i for i, n in enumerate(names)}
    state = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        state.setdefault(index[name], {})[field] = value
    groups = [{**g, "params": [index[n] for n in g["params"]], "betas": tuple(g["betas"])} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------------------
# RNG states <-> JSON


def rng_state(generator: torch.Generator) -> dict:
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "torch": _b64(torch.get_rng_state()),
        "anchors": _b64(generator.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict, generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    generator.set_state(_unb64(state["anchors"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _write_json(path: Path, obj) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
