"""Benchmark rows: one dataclass per kind, written by `dump_row` and read by `load_row`, one JSON line each.

    EnvRow       a session's header: machine, versions, model and drafter hashes
    BaselineRow  one prompt's baselines: exitspec's autoregressive loop (ARRun) and transformers' generate (HFRun)
    SpecRow      one speculative run of one config on that prompt, with its SRs against the baseline row
    PeerRow      one peer's run on that prompt (bench/peers.py: transformers' prompt lookup, vLLM's CPU build)

Version 2 added `version` itself; rows written before it are version 1 and load with the defaults of the
fields they lack (`tree_sizes`, which arrived with `--budget auto`). Version 3 added `forward`, the target's
forward configuration (TargetModel.forward_config) of each run and of the session; older rows have {};
and `warm_start` and `cost` to the env row, and peer rows. A row of a newer
version than this code knows is refused, never half read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

ROW_VERSION = 3
LOOP_SPAN = 16  # tokens: an answer whose last LOOP_SPAN tokens came before is in a repetition loop


@dataclass(kw_only=True)
class EnvRow:
    created: str
    device: str
    device_name: str
    dtype: str
    threads: int
    torch: str
    transformers: str
    python: str
    load_average: list[float] | None
    model: str
    model_sha: str
    drafters: dict[str, str]  # spec -> checkpoint hash (the spec itself for training-free drafters)
    lookup: str = "auto"  # the DFlash drafters' corpus-lookup table: --lookup as given
    forward: dict = field(default_factory=dict)  # the baseline target's forward configuration, row plan included
    warm_start: bool = False  # the decoders started from what earlier processes learned (exitspec.warm)
    cost: dict = field(default_factory=dict)  # the cost grid it ran by (CostModel.to_dict), row plan and all
    kind: str = "env"
    version: int = ROW_VERSION


@dataclass(kw_only=True)
class ARRun:
    """exitspec's autoregressive loop on one prompt: the SR baseline."""

    tokens: list[int]
    text: str | None
    new_tokens: int
    total_seconds: float
    prefill_seconds: float
    tokens_per_second: float
    stage_seconds: dict[str, float]
    stopped_by: str
    forward: dict = field(default_factory=dict)  # TargetModel.forward_config() it ran with


@dataclass(kw_only=True)
class HFRun:
    """transformers' model.generate on one prompt: the SR_HF baseline."""

    tokens: list[int]
    new_tokens: int
    total_seconds: float
    tokens_per_second: float


@dataclass(kw_only=True)
class PromptRow:
    """What names a measured prompt (runner.BASELINE_KEY), and the prompt's size and hash."""

    dataset: str
    prompt_id: str
    turn: int
    repeat: int
    seed: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    prompt_tokens: int
    prompt_sha: str


@dataclass(kw_only=True)
class BaselineRow(PromptRow):
    ar: ARRun
    hf: HFRun
    kind: str = "baseline"
    version: int = ROW_VERSION


@dataclass(kw_only=True)
class SpecRow(PromptRow):
    drafter: str
    budget: int | str  # B, or "auto:B"
    verifier: str
    tokens: list[int]
    new_tokens: int
    rounds: int
    tau: float
    mean_coverage: float
    accepted_lengths: list[int]
    tokens_per_second: float
    prefill_seconds: float
    total_seconds: float
    stage_seconds: dict[str, float]
    stopped_by: str
    sr_ar: float | None  # against the baseline row's ARRun
    sr_hf: float | None
    ar_seconds: float
    ar_tokens: int
    hf_seconds: float
    hf_tokens: int
    matches_ar: bool  # the same tokens as the autoregressive loop (always, at temperature 0)
    tree_sizes: list[int] = field(default_factory=list)  # N per round (version 1 rows before --budget auto lack it)
    forward: dict = field(default_factory=dict)  # TargetModel.forward_config() it ran with: the baseline's
    kind: str = "spec"
    version: int = ROW_VERSION


@dataclass(kw_only=True)
class PeerRow(PromptRow):
    peer: str  # bench.peers.PEERS
    tokens: list[int]
    new_tokens: int
    total_seconds: float
    tokens_per_second: float
    matches_ar: bool  # the same tokens as the baseline row's autoregressive loop
    version_info: str  # the peer's version (vLLM's, or transformers')
    rounds: int | None = None  # target forwards (hf-assistant: one per verified chain), where the peer shows them
    draft_forwards: int | None = None  # the draft model's forwards (hf-assistant)
    draft_seconds: float | None = None  # the time spent in them
    kind: str = "peer"
    version: int = ROW_VERSION


Row = EnvRow | BaselineRow | SpecRow | PeerRow
KINDS: dict[str, type] = {"env": EnvRow, "baseline": BaselineRow, "spec": SpecRow, "peer": PeerRow}
NESTED = {"ar": ARRun, "hf": HFRun}


def dump_row(row: Row) -> str:
    """One JSON line (without the newline)."""
    return json.dumps(asdict(row))


def load_row(line: str) -> Row:
    """The row of one JSON line; ValueError names what is wrong with it."""
    data = json.loads(line)
    kind, version = data.get("kind"), data.get("version", 1)
    if kind not in KINDS:
        raise ValueError(f"unknown row kind {kind!r}")
    if not isinstance(version, int) or version > ROW_VERSION:
        raise ValueError(f"row version {version!r} is newer than this exitspec reads ({ROW_VERSION}); upgrade exitspec")
    cls = KINDS[kind]
    names = {f.name for f in fields(cls)}
    if unknown := sorted(data.keys() - names):
        raise ValueError(f"{kind} row has unknown fields {unknown}")
    values = {k: NESTED[k](**v) if k in NESTED else v for k, v in data.items()}
    values["version"] = ROW_VERSION  # upgraded in memory: the missing fields took their defaults
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"{kind} row is incomplete: {e}") from None


def loops(answer: Sequence[int], earlier: Sequence[Sequence[int]] = ()) -> bool:
    """Whether an answer ends in a repetition loop: its last LOOP_SPAN tokens occurred before, in the answer itself
    or in the earlier answers of its conversation (`earlier`, a second turn that repeats the first). Such answers
    are what suffix trees predict whole (τ of 15-26 on MT-Bench), so every table shows its means without them."""
    if len(answer) < 2 * LOOP_SPAN:
        return False
    tail = tuple(answer[-LOOP_SPAN:])
    texts = [tuple(answer[:-1])] + [tuple(e) for e in earlier]  # an earlier start, possibly overlapping the tail
    return any(text[i : i + LOOP_SPAN] == tail for text in texts for i in range(len(text) - LOOP_SPAN + 1))
