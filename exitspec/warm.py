"""Warm start: what a decoder learns while it decodes, kept from one process to the next.

Two things learn online: the drafter's estimators (estimates.py: what a node's score is worth in reach
probability P(u), per sampling setting) and `--budget auto`'s running rates (budget.AutoBudget: what a
round of each kind realised, and when to try the worse kind again). A fresh process would start both from
their priors, which are cautious, and keep small trees until it has seen a few dozen rounds. So after each
run a decoder writes both to exitspec's cache, and its first run under the same settings in a later
process starts from there:

    warm/estimates-<hash>.json     per target model, drafter, device type, dtype and sampling settings
    warm/auto-<hash>.json          the same, and the budget's cap
    warm/suffix-<hash>.safetensors per target model: its earlier answers, which suffix drafting copies from
                                   (drafters/suffix.py; checked against the tokenizer on load)

A file is JSON, written atomically: {"version", "key", "state"}, where the key's fields, in the clear, are
what its name hashes. A file that is damaged, of another version or made for another key is never trusted:
it is ignored with one warning and replaced after the run. `--no-warm-start` (SpeculativeDecoder's
`warm_start=False`) neither reads nor writes.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

from transformers import PretrainedConfig

from exitspec.atomic import write_atomic
from exitspec.budget import AutoBudget
from exitspec.drafters import Drafter
from exitspec.drafters.suffix import tokenizer_digest
from exitspec.models import cache_dir
from exitspec.sampling import SamplingParams
from exitspec.target import TargetModel

VERSION = 1  # of the files' layout: a file of another version is replaced


def key(kind: str, target: TargetModel, drafter: Drafter, params: SamplingParams, cap: int | None = None) -> dict:
    """What a learned state of `kind` ("estimates" or "auto") belongs to: the target (sha256 of its full
    config), the drafter's identity, the device type, the dtype, the sampling settings and, for `--budget
    auto`'s rates, the cap."""
    fields = {
        "kind": kind,
        "model": model_digest(target.model.config),
        "drafter": drafter.identity(),
        "device": target.device.type,
        "dtype": target.precision,
        "temperature": float(params.temperature),
        "top_k": int(params.top_k),
        "top_p": float(params.top_p),
    }
    return fields if cap is None else fields | {"cap": cap}


def model_digest(config: PretrainedConfig) -> str:
    """16 hex digits of sha256 of a target's full config."""
    return hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def memory_path(config: PretrainedConfig) -> Path:
    """The file of the suffix memory of the target with this config:
    cache_dir()/warm/suffix-<model_digest>.safetensors."""
    return cache_dir() / "warm" / f"suffix-{model_digest(config)}.safetensors"


def path(key: dict) -> Path:
    """The file of `key`: cache_dir()/warm/<kind>-<16 hex digits of sha256 of the key>.json."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "warm" / f"{key['kind']}-{digest}.json"


def restore(key: dict, load: Callable[[dict], None]) -> None:
    """Hands the state saved under `key` to `load` (which raises ValueError on a state that does not fit), if
    there is one. A file that is damaged, of another version or made for another key: one warning, no state."""
    file = path(key)
    if not file.is_file():
        return
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != VERSION or "state" not in data:
            raise ValueError(f"not a version-{VERSION} warm-start file")
        if data.get("key") != key:
            raise ValueError(f"made for {data.get('key')}, not {key}")
        load(data["state"])
    except (OSError, ValueError) as e:
        warnings.warn(f"{file}: ignoring a warm-start file ({e}); starting cold, it is replaced after the run",
                      stacklevel=2)


def save(key: dict, state: dict) -> None:
    """Writes `state` under `key`, atomically; an empty state (a drafter that learns nothing) writes nothing."""
    if state:
        file = path(key)
        file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(file, json.dumps({"version": VERSION, "key": key, "state": state}) + "\n")


class WarmStart:
    """A decoder's learned state on disk. Each key's file is read once per process, before the first run under
    it (later runs hold that state in memory already); every run writes its keys' files back."""

    def __init__(self, target: TargetModel, drafter: Drafter):
        self.target, self.drafter = target, drafter
        self.memory_file = memory_path(target.model.config)  # the suffix memory's file (bench --learn keeps its own)
        self.read: set[Path] = set()  # the files read (or found missing) in this process
        self._tokenizer: str | None = None

    def tokenizer(self) -> str:
        """The target tokenizer's digest, which a suffix memory's file records (computed once)."""
        if self._tokenizer is None:
            self._tokenizer = tokenizer_digest(self.target.tokenizer)
        return self._tokenizer

    def parts(self, params: SamplingParams, auto: AutoBudget | None) -> list[tuple[dict, Callable, Callable]]:
        """(key, state getter, state loader) of the drafter's estimates and, under `--budget auto`, its rates."""
        target, drafter = self.target, self.drafter
        parts = [(key("estimates", target, drafter, params), drafter.estimates_state, drafter.load_estimates)]
        if auto is not None:
            parts.append((key("auto", target, drafter, params, auto.cap), auto.state, auto.restore))
        return parts

    def load(self, params: SamplingParams, auto: AutoBudget | None, memory: bool) -> None:
        """Before a run: the saved state of each key not read yet in this process, and with `memory` the
        drafter's suffix memory."""
        for part_key, _, load in self.parts(params, auto):
            if path(part_key) not in self.read:
                self.read.add(path(part_key))
                restore(part_key, load)
        held = self.drafter.memory() if memory else None
        file = self.memory_file
        if held is not None and file not in self.read:
            self.read.add(file)
            if file.is_file():
                try:
                    digest = held.restore(file, self.tokenizer())
                    if self._tokenizer == "none":  # keep the digest of the entry point that knew the tokenizer
                        self._tokenizer = digest
                except ValueError as e:
                    warnings.warn(f"ignoring a suffix memory ({e}); it is replaced after the run", stacklevel=2)

    def save(self, params: SamplingParams, auto: AutoBudget | None, memory: bool) -> None:
        """After a run: the state of each key, as it is now, and with `memory` (the run added its answer to it) the
        drafter's suffix memory."""
        for part_key, state, _ in self.parts(params, auto):
            save(part_key, state())
        held = self.drafter.memory() if memory else None
        if held is not None and held.answers:
            held.save(self.memory_file, self.tokenizer())
