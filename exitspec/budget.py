"""`--budget auto`: each round, the tree size that maximises expected tokens per second.

A round with a tree of N draft tokens emits 1 + C_p(T) tokens in expectation (Eq. 5; exact for every
saturated verifier) and costs the draft plus the target stage (tree forward, verification, commit). With
the builder's nodes u_1, u_2, ... in best-first order and P̂(u_k) the learned estimate of P(u_k)
(estimates.py), the round keeps the first N nodes for

    N* = argmax_{0 ≤ N ≤ B}  (1 + Σ_{k≤N} P̂(u_k)) / (cost(N) + draft cost)

N is fixed before the target sees the tree, so exactness is untouched; N = 0 is a plain autoregressive step.

The cost side. `CostModel` is the target stage's seconds against N, measured at start-up at every tree size
up to DENSE and on a grid beyond, on the running device (one file per model, device, dtype, backend and
thread count in exitspec's cache, so later runs skip it), and corrected online: every round's measured
target-stage time updates a running ratio of measured to predicted seconds, which follows context length
and machine load. The measured cost need not grow with N: a CPU BLAS picks its kernel by the number of
rows, and on 2 cores MKL runs SmolLM2-135M's weight products on 4–16 rows far below its one-row speed
(13 rows cost more than 17). So on a CPU each size is measured with the weights whole and in each layout of
lean.LAYOUTS (transposed 32-row Panels, the cheapest at one row; oneDNN-Packed, the cheapest at a few rows),
and a tree of N tokens runs its weight products the cheapest way, on the rows of the cheapest measured size
at or above N (`row_plan`, handed to the lean forward); it costs what that size costs.

Which source to draft from. A round that runs the drafter's model (DFlash's block forward) pays its cost
before it knows its tree; a cheap round drafts from prompt lookup alone. Each kind keeps a running mean of
what it realised, (1 + C_p) over the round's seconds, and the better one drafts. The other one is tried
again after EXPLORE_EVERY rounds so that its mean stays current; each time it is still the worse, the wait
doubles (up to MAX_EXPLORE_EVERY), and it returns to EXPLORE_EVERY once it wins. At T = 1 with a weak
drafter, where a block forward costs a third of a step and almost never pays, the exploring rounds
otherwise cost about 4% of the run (MT-Bench).
"""

from __future__ import annotations

import bisect
import datetime
import hashlib
import itertools
import json
import math
import statistics
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from exitspec.atomic import write_atomic
from exitspec.lean import PLAN_GAIN, layouts_for
from exitspec.models import cache_dir
from exitspec.timing import timings
from exitspec.tree import DraftTree

DENSE = 32  # every tree size up to this is measured
SPARSE = (48, 64, 96, 128, 192, 256)  # and these beyond it
EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 256
MEASURE_VERSION = 7  # part of the cost cache's key: files from an older `measure` are measured again
MAX_OTHER_LOAD = 0.15  # a grid measured while other processes used more of the CPUs than this is not cached
MAX_SPREAD = 0.2  # nor one whose repeats disagreed by more (second-fastest over fastest, median over sizes)
SPOT_SIZES = (0, 2, 4, 8, 16)  # the sizes `agrees_with` re-times
SPOT_TOLERANCE = 1.5  # a cached grid whose cost ratios are off by more than this factor is measured again


@dataclass
class CostModel:
    """Seconds of the target stage for a tree of N draft tokens: measured sizes, linear in between."""

    sizes: list[int]
    seconds: list[float]
    ratio: float = 1.0  # running mean of measured / predicted seconds
    smoothing: float = 0.1
    layouts: list[str] | None = None  # per size: the weight layout measured cheapest (None: "whole" throughout)
    info: dict = field(default_factory=dict)  # how it was measured: measured_at, other_load, spread
    padded: list[int] = field(init=False)  # padded[i]: the index of the size whose rows a tree of sizes[i] runs on
    effective: list[float] = field(init=False)  # effective[i]: the seconds of the size a tree of sizes[i] runs as

    def __post_init__(self):
        self.layouts = self.layouts or ["whole"] * len(self.sizes)
        self.padded = []
        for i, own in enumerate(self.seconds):
            j = min(range(i, len(self.sizes)), key=self.seconds.__getitem__)  # the cheapest size at or above
            self.padded.append(j if self.seconds[j] < (1 - PLAN_GAIN) * own else i)
        self.effective = [self.seconds[j] for j in self.padded]

    def row_plan(self) -> dict[int, tuple[int, str]]:
        """{rows of a tree: (rows its weight products run on, layout)} wherever that is not (rows, "whole")."""
        plan = {self.sizes[i] + 1: (self.sizes[j] + 1, self.layouts[j]) for i, j in enumerate(self.padded)}
        return {rows: how for rows, how in plan.items() if how != (rows, "whole")}

    def base(self, n: int) -> float:
        """The measured seconds at N (of the size it runs as), linear between sizes and along the last segment
        beyond them."""
        sizes, seconds = self.sizes, self.effective
        if len(sizes) == 1:
            return seconds[0]
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)  # the segment [i-1, i] holding n
        return seconds[i - 1] + (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1]) * (seconds[i] - seconds[i - 1])

    def __call__(self, n: int) -> float:
        return self.ratio * self.base(n)

    def update(self, n: int, seconds: float) -> None:
        self.ratio += self.smoothing * (seconds / self.base(n) - self.ratio)

    @classmethod
    def measure(cls, target, max_size: int, context: int = 256, repeats: int = 3) -> CostModel:
        """Times forward + commit of chain trees of each size up to max_size (all up to DENSE, then SPARSE)
        after `context` cached tokens, with the weights whole and in each layout of lean.LAYOUTS (on the lean
        forward; each layout's copy of the weights must fit in half the free memory beside the others).

        Chains have the largest depth for their size, so positions and mask are the dearest case. Per way, one
        pass over all sizes warms every shape up; then each size keeps the fastest of `repeats` runs, since other
        work on the machine only ever adds time. `info` records when, how busy the rest of the machine was
        (`other_load`) and how far the repeats disagreed: `trustworthy` decides from it whether to cache the grid.
        The target's cache and row plan are left as they were.
        """
        sizes = sorted({*range(min(max_size, DENSE) + 1), *(n for n in SPARSE if n <= max_size), max_size})
        weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
        free = psutil.virtual_memory().available
        layouts = layouts_for(target.device) if target.weight_copies else []
        layouts = [layout for k, layout in enumerate(layouts) if 2 * (k + 1) * weight_bytes < free]
        plan = target.row_plan
        ways = ["whole", *layouts] if target.use_row_plan({}) else ["whole"]
        seconds, spreads = {}, []
        with other_load() as load:
            for way, runs in itertools.product(ways, (1, repeats)):  # per way: the warm-up pass, then the timed one
                target.use_row_plan({n + 1: (n + 1, way) for n in sizes})
                times = time_chains(target, sizes, runs, context)
                seconds[way] = [min(t) for t in times]
                spreads += [sorted(t)[1] / min(t) - 1 for t in times if len(t) > 1]
        target.use_row_plan(plan)
        best = [min(ways, key=lambda way: seconds[way][i]) for i in range(len(sizes))]
        best = [way if seconds[way][i] < (1 - PLAN_GAIN) * seconds["whole"][i] else "whole"
                for i, way in enumerate(best)]
        info = {"measured_at": datetime.datetime.now().isoformat(timespec="seconds"),
                "other_load": round(load["other"], 3),
                "spread": round(statistics.median(spreads), 3) if spreads else 0.0}
        return cls(sizes, [seconds[way][i] for i, way in enumerate(best)], layouts=best, info=info)

    def to_dict(self) -> dict:
        """What a cache file or a benchmark's env row keeps of it (`from_dict` reads it back)."""
        return {"sizes": self.sizes, "seconds": self.seconds, "layouts": self.layouts, "info": self.info}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """The model of a `to_dict`; KeyError or TypeError where one is not."""
        return cls(list(data["sizes"]), list(data["seconds"]), layouts=list(data["layouts"]), info=data.get("info", {}))

    def trustworthy(self) -> str | None:
        """None when the grid may be cached; else why not (measured under load, or repeats that disagree)."""
        if self.info.get("other_load", 0.0) > MAX_OTHER_LOAD:
            return f"other processes used {self.info['other_load']:.0%} of the CPUs while it was measured"
        if self.info.get("spread", 0.0) > MAX_SPREAD:
            return f"its repeats disagreed by {self.info['spread']:.0%} (median over sizes)"
        return None

    def agrees_with(self, target, context: int = 256) -> bool:
        """A quick check of a cached grid on the machine as it is now: trees of a few sizes, run with this grid's
        row plan, must cost what the grid says relative to one step (within a factor SPOT_TOLERANCE). Ratios,
        not seconds, so a busy machine does not fail a true grid; a grid measured under load (its N ≥ 1 costs
        inflated unevenly) fails."""
        sizes = [n for n in SPOT_SIZES if n <= self.sizes[-1]]
        plan = target.row_plan
        target.use_row_plan(self.row_plan())
        time_chains(target, sizes, 1, context)  # warm-up
        now = [min(t) for t in time_chains(target, sizes, 3, context)]
        target.use_row_plan(plan)
        return all(
            abs(math.log((now[k] / now[0]) / (self.base(n) / self.base(0)))) <= math.log(SPOT_TOLERANCE)
            for k, n in enumerate(sizes)
        )

    @classmethod
    def cached(cls, target, max_size: int, refresh: bool = False) -> CostModel:
        """`measure`, once per model, device, dtype, backend, thread count and max size, kept in exitspec's cache.

        A cached grid is used after `agrees_with` confirms it; one that does not (or `refresh`) is measured
        again, and a measurement is cached only when `trustworthy`: a busy machine never poisons the cache."""
        path = cost_path(target, max_size)
        if not refresh and path.is_file():
            try:
                data = json.loads(path.read_text())
                model = cls.from_dict(data)
            except (ValueError, KeyError, TypeError) as e:
                warnings.warn(f"{path}: a damaged cost grid ({e}); measuring again", stacklevel=2)
            else:
                if model.agrees_with(target):
                    return model
                warnings.warn(f"{path}: the cached cost grid disagrees with this machine now; measuring again",
                              stacklevel=2)
        model = cls.measure(target, max_size)
        why = model.trustworthy()
        if why is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(model.to_dict()))
        else:
            warnings.warn(f"the cost grid is used for this run but not cached: {why}", stacklevel=2)
        return model


def cost_path(target, max_size: int) -> Path:
    """The cost cache's file for this target (model, device, dtype, backend, its attention, threads, torch) and max
    size."""
    key = json.dumps([
        target.model.config.to_json_string(use_diff=False), str(target.device), target.precision,
        type(target.backend).__name__, target.attention, torch.get_num_threads(),
        torch.__version__, max_size, MEASURE_VERSION,
    ] + ([] if target.weight_copies else ["no weight copies"]))
    return cache_dir() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def calibrate(target, max_size: int = DENSE, refresh: bool = False, cost: CostModel | None = None) -> CostModel:
    """The target's cost grid (`CostModel.cached`, or `cost`: one already measured on the same weights), and its
    row plan installed on the target: the one place a row plan is set. Every later forward of this target runs
    by that plan."""
    cost = cost or CostModel.cached(target, max_size, refresh)
    target.use_row_plan(cost.row_plan())
    return cost


def time_chains(target, sizes: list[int], repeats: int, context: int) -> list[list[float]]:
    """Seconds of forward_tree + commit of a chain tree of each size after `context` cached tokens, `repeats`
    times each ([len(sizes)][repeats]); the target's cache is empty afterwards."""
    target.reset()
    runs = chain_runs(target, sizes, context)
    times = [timings(run, repeats, target.device) for run in runs]
    target.reset()
    return times


def chain_runs(target, sizes: list[int], context: int) -> list:
    """Prefills `context` tokens (fewer where the largest chain would not fit) and returns, per size N, a call
    that verifies a chain of N draft tokens and accepts none: forward_tree + commit, then the cache back to
    `context`."""
    context = max(1, min(context, target.max_context - max(sizes) - 2))
    target.prefill(torch.arange(context, device=target.device) % target.vocab_size)
    runs = []
    for n in sizes:
        tree = DraftTree.chain(1, [(7 * k + 3) % target.vocab_size for k in range(n)], device=target.device)

        def verify_nothing(tree: DraftTree = tree) -> None:
            target.forward_tree(tree)
            target.commit(tree, [])
            target.truncate(context)

        runs.append(verify_nothing)
    return runs


@contextmanager
def other_load() -> Iterator[dict[str, float]]:
    """Yields a dict whose "other" is set, when the `with` block ends, to the share of the machine's CPU time
    (0–1) that other processes used meanwhile: all CPUs' busy time (steal included) minus this process's own,
    over wall time × CPUs."""
    def busy(t) -> float:
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    share: dict[str, float] = {}
    wall0, system0, own0 = time.perf_counter(), psutil.cpu_times(), psutil.Process().cpu_times()
    yield share
    wall, system, own = time.perf_counter(), psutil.cpu_times(), psutil.Process().cpu_times()
    others = busy(system) - busy(system0) - (own.user + own.system - own0.user - own0.system)
    share["other"] = min(1.0, max(0.0, others) / max((wall - wall0) * (psutil.cpu_count() or 1), 1e-9))


def best_size(scores, cost: CostModel, draft_seconds: float, cap: int) -> int:
    """argmax_N (1 + Σ_{k≤N} scores[k]) / (cost(N) + draft_seconds) over N = 0..min(cap, len(scores) - 1).

    scores [N+1]: the tree's node estimates in best-first order (scores[0] is the root's and is skipped).
    """
    best, best_rate, expected = 0, 1.0 / (cost(0) + draft_seconds), 1.0
    for n in range(1, min(cap, len(scores) - 1) + 1):
        expected += scores[n]
        rate = expected / (cost(n) + draft_seconds)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


@dataclass
class AutoBudget:
    """The per-round choices of `--budget auto`: which source drafts, and how many of its nodes to keep."""

    cost: CostModel
    cap: int
    draft_seconds: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})  # cheap -> s
    rate: dict[bool, float | None] = field(default_factory=lambda: {False: None, True: None})  # cheap -> tok/s
    rounds: int = 0
    smoothing: float = 0.2
    explore_every: int = EXPLORE_EVERY  # rounds between tries of the worse kind (backs off while it stays worse)
    next_explore: int = EXPLORE_EVERY - 1  # the round that tries it next
    exploring: bool = False  # this round tries the worse kind

    def cheap_round(self) -> bool:
        """Draft from the cheapest source this round? The kind with the better realised rate, exploring."""
        full, cheap = self.rate[False], self.rate[True]
        if full is None or cheap is None:
            return full is not None  # try each kind once, the full one first
        better = cheap > full
        self.exploring = self.rounds >= self.next_explore
        return (not better) if self.exploring else better

    def choose(self, tree: DraftTree, cheap: bool) -> DraftTree:
        """The best head of the tree (best-first nodes) for this round; the whole tree if it has no scores."""
        if tree.scores is None:
            return tree.head(self.cap + 1)
        return tree.head(1 + best_size(tree.scores, self.cost, self.draft_seconds[cheap], self.cap))

    def record(self, cheap: bool, size: int, draft_seconds: float, target_seconds: float, coverage: float) -> None:
        """One round's measurements: N, draft and target-stage seconds, and C_p of the tree verified."""
        self.rounds += 1
        self.cost.update(size, target_seconds)
        self.draft_seconds[cheap] += self.smoothing * (draft_seconds - self.draft_seconds[cheap])
        realised = (1.0 + coverage) / (draft_seconds + target_seconds)
        old = self.rate[cheap]
        self.rate[cheap] = realised if old is None else old + self.smoothing * (realised - old)
        if self.exploring:  # the worse kind was tried: wait twice as long next time if it is still worse
            still_worse = self.rate[cheap] < self.rate[not cheap]
            self.explore_every = min(2 * self.explore_every, MAX_EXPLORE_EVERY) if still_worse else EXPLORE_EVERY
            self.next_explore = self.rounds + self.explore_every - 1
            self.exploring = False

    def state(self) -> dict:
        """The running rates and the exploring schedule, JSON-ready (not the cost model: it follows the machine)."""
        kinds = {"full": False, "cheap": True}
        return {
            "draft_seconds": {name: self.draft_seconds[cheap] for name, cheap in kinds.items()},
            "rate": {name: self.rate[cheap] for name, cheap in kinds.items()},
            "rounds": self.rounds, "explore_every": self.explore_every, "next_explore": self.next_explore,
        }

    def restore(self, state: dict) -> None:
        """Continues from a `state()`; ValueError (and nothing changed) unless each field is there and in range."""
        def number(x) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0

        try:
            seconds, rate = ([state[part][kind] for kind in ("full", "cheap")] for part in ("draft_seconds", "rate"))
            counters = [state[name] for name in ("rounds", "explore_every", "next_explore")]
        except (KeyError, TypeError) as e:
            raise ValueError(f"an auto-budget state without {e}") from None
        if not (all(map(number, seconds)) and all(r is None or number(r) for r in rate)
                and all(isinstance(c, int) and c >= 0 for c in counters)
                and EXPLORE_EVERY <= counters[1] <= MAX_EXPLORE_EVERY):
            raise ValueError(f"an auto-budget state out of range: {state}")
        self.draft_seconds, self.rate = dict(zip((False, True), seconds)), dict(zip((False, True), rate))
        self.rounds, self.explore_every, self.next_explore = counters
        self.exploring = False
