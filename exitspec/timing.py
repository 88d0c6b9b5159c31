"""One way to time: `StageTimer`, for every second exitspec measures: a generate call's stages, its prefill and
total; transformers' generate and the in-process peers beside it; the cost grid, the latency, forward and suffix
benches (through `timings` where they repeat a call). Training's progress rates are not measurements.

A timer starts when it is made, after the device's queued work (`synchronize`: a no-op on the CPU), and
`elapsed()` waits for the device again, so the prefill, a whole run and every call `timings` measures hold
their device time. A round's stages (`timer("draft")`, ...) take no sync of their own: on a GPU a sync drains
the queue, and a round reads the device at most a few times (bench/rounds.py). Each half of a round ends in a
host read that waits for the device anyway: the draft half (draft + build) in the drafter's one transfer of its
candidates, the target half (target + verify + commit) in the verdict's. So on a GPU the halves' sums, which
`--budget auto` weighs, are right; within a half the device time lands in the stage that waits for it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar

import torch

STAGE: ContextVar[str | None] = ContextVar("exitspec_stage", default=None)  # the stage running now (bench/rounds.py)


def synchronize(device: torch.device | None) -> None:
    """Waits for the device's queued work (a no-op on the CPU and for None), so wall-clock time covers it."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class StageTimer:
    """Wall-clock seconds per named stage, and since the timer was made (`elapsed`, device work included)."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = defaultdict(float)  # each stage's latest interval
        synchronize(device)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the timer was made, once the device's queued work is done."""
        synchronize(self.device)
        return time.perf_counter() - self.start

    @contextmanager
    def __call__(self, stage: str):
        token = STAGE.set(stage)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last[stage] = time.perf_counter() - start
            self.seconds[stage] += self.last[stage]
            STAGE.reset(token)

    @contextmanager
    def round(self):
        """One round's bookkeeping between the stages (stats, `auto`'s record, the drafter's observe): stage "loop"."""
        self.last.clear()
        token = STAGE.set("loop")
        try:
            yield
        finally:
            STAGE.reset(token)


def timings(run, repeats: int, device: torch.device, reset=lambda: None) -> list[float]:
    """Seconds of each of `repeats` calls of run() (the device's queued work included), calling reset() untimed
    after each."""
    seconds = []
    for _ in range(repeats):
        timer = StageTimer(device)
        run()
        seconds.append(timer.elapsed())
        reset()
    return seconds


def fastest(run, repeats: int, device: torch.device, reset=lambda: None) -> float:
    """Seconds of the fastest of `repeats` calls of run(): other work on the machine only ever adds time."""
    return min(timings(run, repeats, device, reset))
