"""Paired comparisons by prompt: is drafter A's τ really above drafter B's?

Both are measured on the same prompts, so the spread between prompts (an easy GSM8K question against a hard
MT-Bench turn) cancels in the per-prompt differences d_i = a_i − b_i. Reported: their mean, its standard error
s(d) / √n, and a 95% interval by the percentile bootstrap (the prompts resampled with replacement, a fixed
seed, so a report is reproducible): no normality assumed for the few dozen prompts of a benchmark. The relative
change mean(a) / mean(b) − 1 gets its interval from the same resamples.

Power: a comparison with standard error s detects a true difference δ in a two-sided test at 5% with 80%
power when δ >= (1.96 + 0.84)·s. Reported relative to mean(b), as the smallest relative change it detects,
and for n' prompts it scales as √(n / n') (`detectable_with`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

RESAMPLES = 10_000
DETECT_Z = 1.96 + 0.84  # a two-sided 5% test with 80% power


def paired_difference(a: Mapping[Hashable, float], b: Mapping[Hashable, float], seed: int = 0) -> dict | None:
    """a − b over the keys both hold: {"pairs", "mean", "stderr", "ci95", "relative", "relative_ci95",
    "detectable"} (the standard error, the intervals and the smallest detectable relative change, module
    docstring, are None with one pair), or None when they share no key."""
    keys = sorted(a.keys() & b.keys(), key=str)
    if not keys:
        return None
    x = torch.tensor([a[k] for k in keys], dtype=torch.float64)  # [n]
    y = torch.tensor([b[k] for k in keys], dtype=torch.float64)  # [n]
    n, diff = len(keys), x - y
    out = {"pairs": n, "mean": float(diff.mean()), "stderr": None, "ci95": None,
           "relative": float(x.mean() / y.mean() - 1), "relative_ci95": None, "detectable": None}
    if n > 1:
        picks = torch.randint(n, (RESAMPLES, n), generator=torch.Generator().manual_seed(seed))  # [R, n]
        levels = torch.tensor([0.025, 0.975], dtype=torch.float64)
        out["stderr"] = float(diff.std() / n**0.5)
        out["ci95"] = torch.quantile(diff[picks].mean(dim=1), levels).tolist()
        out["relative_ci95"] = torch.quantile(x[picks].mean(dim=1) / y[picks].mean(dim=1) - 1, levels).tolist()
        out["detectable"] = DETECT_Z * out["stderr"] / float(y.mean())
    return out


def detectable_with(value: dict, pairs: int) -> float:
    """The smallest relative change a paired_difference like `value` detects with `pairs` prompts instead."""
    return value["detectable"] * (value["pairs"] / pairs) ** 0.5


def paired_cell(value: dict | None, digits: int = 3) -> str:
    """A paired_difference as "+mean ± s.e. [low, high]" ("-" for None; no interval with one pair)."""
    if value is None:
        return "-"
    if value["stderr"] is None:
        return f"{value['mean']:+.{digits}f}"
    low, high = value["ci95"]
    return f"{value['mean']:+.{digits}f} ± {value['stderr']:.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"
