"""`exitspec train curve`: the held-out curve of training runs, from their log.jsonl files.

The trainer logs, every --eval-every steps, the greedy check of heldout.py per held-out set: τ at T = 0 of
B = 32 DDTrees (1 + the tree path the target's own response follows, Eq. 5 at T = 0) and the top-1
accuracy per depth. This plots τ and the depth-1 top-1 against the sequence tokens trained on so far (the
sum of the log's `tokens` up to that step), one colour per held-out set and one line style per run, and
prints the same numbers as a table.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

STYLES = ("-", "--", ":", "-.")


def read_curve(run_dir: Path) -> list[dict]:
    """[{step, tokens, heldout: {set: {tau, acc_k, anchors}}}] of one run, in step order.

    A resumed run's log repeats the steps after its last checkpoint; the last record of a step wins."""
    log = run_dir / "log.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"no training log at {log}")
    windows, checks = {}, {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        (checks if "heldout" in record else windows)[record["step"]] = record
    if not checks:
        raise ValueError(f"{log} holds no held-out check; train with --eval-every N")
    points, tokens, steps = [], 0, sorted(windows)
    for step in sorted(checks):
        while steps and steps[0] <= step:
            tokens += windows[steps.pop(0)].get("tokens", 0)
        points.append({"step": step, "tokens": tokens, "heldout": checks[step]["heldout"]})
    return points


def run(args) -> int:
    curves = {str(d): read_curve(Path(d)) for d in args.run_dirs}
    table = Table(title="Held-out greedy check: τ (T = 0, B = 32) / top-1 at depth 1")
    sets = sorted({name for points in curves.values() for p in points for name in p["heldout"]})
    for col in ("run", "step", "tokens", *sets, "mean τ"):
        table.add_column(col, justify="left" if col == "run" else "right")
    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r, (name, points) in enumerate(curves.items()):
        for p in points:
            cells = [p["heldout"].get(s) for s in sets]
            taus = [c["tau"] for c in cells if c]
            table.add_row(name, str(p["step"]), f"{p['tokens'] / 1e6:.2f}M",
                          *(f"{c['tau']:.2f} / {c['acc_k'][0]:.2f}" if c else "-" for c in cells),
                          f"{sum(taus) / len(taus):.2f}")
        for i, s in enumerate(sets):
            xs = [p["tokens"] / 1e6 for p in points if s in p["heldout"]]
            style = {"color": f"C{i}", "linestyle": STYLES[r % len(STYLES)], "marker": "."}
            ax_tau.plot(xs, [p["heldout"][s]["tau"] for p in points if s in p["heldout"]],
                        label=f"{s} ({Path(name).name})", **style)
            ax_acc.plot(xs, [p["heldout"][s]["acc_k"][0] for p in points if s in p["heldout"]], **style)
    Console(width=160).print(table)
    ax_tau.set(xlabel="training sequence tokens (M)", ylabel="held-out τ, T = 0, B = 32")
    ax_acc.set(xlabel="training sequence tokens (M)", ylabel="held-out top-1 at depth 1")
    ax_acc.axhline(0.6, color="grey", linewidth=0.8)  # a depth-1 accuracy worth reaching (0.6)
    ax_tau.legend(fontsize=7)
    for ax in (ax_tau, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0
