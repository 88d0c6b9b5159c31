"""`exitspec train eval`'s comparisons of several drafters on the same held-out anchors.

Every drafter is measured at the same anchors of the same responses (acceptance.py draws them from the seed),
so drafters compare prompt by prompt:

- `paired_rows`: the last drafter listed (the candidate) minus each other one, per (budget, temperature), on
  each dataset and on all of them pooled: the per-prompt difference of mean E[τ] = 1 + C_p (Eq. 5) with its
  standard error and bootstrap 95% interval, and the relative change (paired.py).
- `exit_rows`: where the target's mass leaves each drafter's trees, Σ_{v at depth d} w(v) (Eq. 4) averaged
  over all anchors of all datasets; depth 0 is the root, mass no re-weighting of the drafter's nodes can move.
  `plot_exits` draws it, one panel per (budget, temperature).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from exitspec.drafters.chain import drafter_label
from exitspec.paired import paired_difference

ALL = "all"  # the pooled "dataset" of paired_rows


def paired_rows(rows: list[dict]) -> list[dict]:
    """[{"candidate", "other", "dataset", "budget", "temperature", **paired_difference}] (train eval rows in)."""
    tau: dict[tuple, dict[str, float]] = defaultdict(dict)  # (drafter, dataset, B, T) -> {rollout id: E[τ]}
    for r in rows:
        for key in (r["dataset"], ALL):
            tau[r["drafter"], key, r["budget"], r["temperature"]].update(r["tau_by_sequence"])
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    settings = sorted({(r["budget"], r["temperature"]) for r in rows})
    datasets = [*dict.fromkeys(r["dataset"] for r in rows), ALL]
    out = []
    for other in drafters[:-1]:
        for budget, temperature in settings:
            for dataset in datasets:
                diff = paired_difference(tau[drafters[-1], dataset, budget, temperature],
                                         tau[other, dataset, budget, temperature])
                if diff is not None:
                    out.append({"candidate": drafters[-1], "other": other, "dataset": dataset, "budget": budget,
                                "temperature": temperature, **diff})
    return out


def exit_rows(rows: list[dict]) -> list[dict]:
    """[{"drafter", "budget", "temperature", "anchors", "exit_by_depth", "tau"}]: the anchor-weighted mean over
    datasets of each drafter's exit mass per depth (index 0: the root) and of its E[τ]."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["drafter"], r["budget"], r["temperature"]].append(r)
    out = []
    for (drafter, budget, temperature), group in groups.items():
        anchors = sum(r["trees"] for r in group)
        depths = max(len(r["exit_by_depth"]) for r in group)
        exits = [sum(r["trees"] * (r["exit_by_depth"][d] if d < len(r["exit_by_depth"]) else 0.0) for r in group)
                 / anchors for d in range(depths)]
        out.append({"drafter": drafter, "budget": budget, "temperature": temperature, "anchors": anchors,
                    "exit_by_depth": exits, "tau": sum(r["trees"] * r["tau"] for r in group) / anchors})
    return out


def plot_exits(exits: list[dict], path: Path) -> None:
    """Grouped bars of exit_rows: exit mass by depth, one bar colour per drafter, one panel per (B, T)."""
    settings = sorted({(e["budget"], e["temperature"]) for e in exits})
    drafters = list(dict.fromkeys(e["drafter"] for e in exits))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.8), squeeze=False)
    width = 0.8 / len(drafters)
    for ax, (budget, temperature) in zip(axes[0], settings):
        for i, drafter in enumerate(drafters):
            for e in exits:
                if (e["drafter"], e["budget"], e["temperature"]) == (drafter, budget, temperature):
                    xs = [d + (i - (len(drafters) - 1) / 2) * width for d in range(len(e["exit_by_depth"]))]
                    ax.bar(xs, e["exit_by_depth"], width, color=f"C{i}",
                           label=f"{drafter_label(drafter)} (E[τ] {e['tau']:.2f})")
        ax.set(title=f"B = {budget}, T = {temperature:g}", xlabel="depth of the exit node (0: root)",
               ylabel="mean exit mass w")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
