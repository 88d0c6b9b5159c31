"""Where a round's launches and host syncs go: torch ops dispatched and device→host syncs, by stage, per round.

    exitspec latency --stage round [--round-budgets 32 auto] [--temperatures 0 1] [--prompts 2]

On a GPU every torch op is a kernel launch (≈ 5–10 µs of CPU), and every host read of device data drains
the queue, so the launches of the next stage cannot hide behind the work already queued. Both can be counted
on any device, CPU included, by watching the code run:

    ops     every aten op dispatched (a TorchDispatchMode) but those that hand back their input untouched (x.to of
            x's own dtype), by stage: draft, build, target, verify, commit, and
            loop (the round's bookkeeping between them, timing.StageTimer.round)
    syncs   every host read of a tensor on the decoder's device: .item(), bool(t), int(t), float(t), .tolist(),
            .numpy(), .cpu(), .to("cpu"), and the ops whose output shape depends on the data (nonzero,
            unique, masked_select, boolean indexing); each with its call site in exitspec (file:line)

On the CPU every tensor counts as device data, which is what the same code does on CUDA, where the tree and
the logits live on the GPU. Prefill and set-up are not counted; the counts are per decoding round.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from exitspec.app import load_decoders
from exitspec.decode import STAGES, SpeculativeDecoder
from exitspec.drafters import default_drafter
from exitspec.timing import STAGE

aten = torch.ops.aten
SHAPE_SYNC_OPS = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten._local_scalar_dense.default}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
ROUND_STAGES = (*STAGES, "loop")
PACKAGE = str(Path(__file__).resolve().parents[1])  # exitspec/
HERE = str(Path(__file__).resolve())


def call_site() -> str:
    """file:line of the innermost exitspec frame outside this module (the code that asked for the op)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) and name != HERE:
            return f"{Path(name).relative_to(Path(PACKAGE).parent)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclass
class RoundCounts:
    """Ops and syncs counted while a decoder ran `rounds` rounds."""

    ops: Counter = field(default_factory=Counter)  # stage → aten ops
    syncs: Counter = field(default_factory=Counter)  # stage → host syncs
    sites: Counter = field(default_factory=Counter)  # (stage, file:line, what) → host syncs
    op_names: Counter = field(default_factory=Counter)  # (stage, aten op) → count
    rounds: int = 0

    def merge(self, other: RoundCounts) -> None:
        for mine, theirs in ((self.ops, other.ops), (self.syncs, other.syncs), (self.sites, other.sites),
                             (self.op_names, other.op_names)):
            mine.update(theirs)
        self.rounds += other.rounds

    def per_round(self) -> dict:
        n = max(self.rounds, 1)
        ops = {s: self.ops[s] / n for s in ROUND_STAGES}
        syncs = {s: self.syncs[s] / n for s in ROUND_STAGES}
        return {
            "rounds": self.rounds,
            "ops": ops,
            "ops_outside_target": sum(v for s, v in ops.items() if s != "target"),
            "syncs": syncs,
            "syncs_total": sum(syncs.values()),
            "sites": [{"stage": stage, "site": site, "what": what, "per_round": count / n}
                      for (stage, site, what), count in self.sites.most_common()],
            "op_names": {s: {op: count / n for (stage, op), count in self.op_names.most_common() if stage == s}
                         for s in ROUND_STAGES},  # which ops make up each stage's count
        }


class _Syncs(TorchFunctionMode):
    """Host reads that torch does not dispatch (tolist, numpy, cpu, to("cpu"))."""

    def __init__(self, counts: RoundCounts, device: torch.device):
        super().__init__()
        self.counts, self.device = counts, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stage = STAGE.get()
        if stage is not None and args and isinstance(args[0], torch.Tensor) and args[0].device == self.device:
            to_host = (func is torch.Tensor.to and self.device.type != "cpu"  # on the CPU, .to(device) is a no-op
                       and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device"))))
            if func in HOST_READS or to_host:
                self.counts.syncs[stage] += 1
                self.counts.sites[stage, call_site(), func.__name__] += 1
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    """Every aten op, and the ones that read device data on the host (item, bool(), data-dependent shapes)."""

    def __init__(self, counts: RoundCounts, device: torch.device):
        super().__init__()
        self.counts, self.device = counts, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        stage = STAGE.get()
        if stage is not None:
            if out is not (args[0] if args else None) or func._schema.is_mutable:  # a no-op (x.to(x.dtype)) is not
                self.counts.ops[stage] += 1
                self.counts.op_names[stage, func.__name__] += 1
            bool_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
            if func in SHAPE_SYNC_OPS or bool_index:
                self.counts.syncs[stage] += 1
                self.counts.sites[stage, call_site(), "boolean index" if bool_index else func.__name__] += 1
        return out


def _is_cpu(value) -> bool:
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu"


def count_rounds(decoder: SpeculativeDecoder, prompt, **settings) -> tuple[RoundCounts, object]:
    """Runs decoder.generate(prompt, **settings) under the counters; returns the counts and the result."""
    counts = RoundCounts()
    device = decoder.target.device
    with _Syncs(counts, device), _Ops(counts, device):
        result = decoder.generate(prompt, **settings)
    counts.rounds = len(result.rounds)
    return counts, result


VERIFIERS = ("tev", "greedy", "predraw", "sequential")  # greedy only at temperature 0
TOKENS = 64  # new tokens a prompt is decoded for


def measure(prompts: Sequence[str], model=None, drafter=None, device=None, dtype="auto", threads=None,
            budgets=("32", "auto"), temperatures=(0.0, 1.0), verifiers=VERIFIERS) -> dict:
    """Per (budget, temperature, verifier): ops and syncs per round over `prompts`, each decoded for TOKENS
    tokens after an uncounted warm-up."""

    spec = str(drafter or default_drafter(model))
    decoder = load_decoders(model, [spec], device, dtype, threads)[spec]
    decoder.generate(prompts[0], max_new_tokens=8, learn=False)  # one-time costs (the cost grid) stay uncounted
    rows = []
    for budget in budgets:
        for temperature in temperatures:
            for verifier in verifiers:
                if verifier == "greedy" and temperature:
                    continue
                counts = RoundCounts()
                for prompt in prompts:
                    one, _ = count_rounds(decoder, prompt, max_new_tokens=TOKENS, budget=budget,
                                          temperature=temperature, verifier=verifier, learn=False)
                    counts.merge(one)
                rows.append({"budget": str(budget), "temperature": temperature, "verifier": verifier,
                             **counts.per_round()})
    return {"drafter": spec, "device": str(decoder.target.device), "tokens": TOKENS, "prompts": len(prompts),
            "rows": rows}


def print_table(result: dict, console: Console) -> None:
    """Ops and syncs per round by stage, then each configuration's sync sites."""
    table = Table(title=f"Per round, drafter {result['drafter']} on {result['device']}: torch ops dispatched "
                        f"(by stage) and host syncs")
    for col in ("B", "T", "verifier", "rounds", *ROUND_STAGES, "ops outside target", "syncs"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(row["budget"], f"{row['temperature']:g}", row["verifier"], str(row["rounds"]),
                      *(f"{row['ops'][s]:.0f}" for s in ROUND_STAGES), f"{row['ops_outside_target']:.0f}",
                      f"{row['syncs_total']:.1f}")
    console.print(table)
    for row in result["rows"]:
        sites = ", ".join(f"{s['site']} {s['what']} ×{s['per_round']:.2f}" for s in row["sites"])
        console.print(f"B={row['budget']} T={row['temperature']:g} {row['verifier']}: {sites or 'no syncs'}")
