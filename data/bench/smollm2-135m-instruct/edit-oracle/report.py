"""The oracle study's table (Markdown, stdout) and plot (oracle.png) from oracle.py's JSON files.

    python data/bench/smollm2-135m-instruct/edit-oracle/report.py edit.json table1.json
"""

import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

HERE = Path(__file__).parent


def pooled(answers: list[dict], key: str) -> float:
    """Mean over all rounds of the set (answers weighted by their rounds)."""
    return sum(a[key] * a["rounds"] for a in answers) / sum(a["rounds"] for a in answers)


def speedup(answers: list[dict], cost: list[float], coverage_of) -> float:
    """Σ (1 + C) t(0) / Σ t(N) over every round of the set."""
    tokens = seconds = 0.0
    for a in answers:
        for r, size in enumerate(a["sizes"] if coverage_of == "drafter" else a["best_sizes"]):
            tokens += 1 + (a["coverage"][r] if coverage_of == "drafter" else a["best"][r][size])
            seconds += cost[size]
    return tokens / seconds * cost[0]


def charged_ceiling(answers: list[dict], cost: list[float], draft_ms: float) -> float:
    """SR* when every round that drafts (N > 0) also pays `draft_ms`; each round's size chosen again."""
    tokens = seconds = 0.0
    for a in answers:
        for best in a["best"]:
            size = max(range(len(best)), key=lambda n: (1 + best[n]) / (cost[n] + (draft_ms if n else 0.0)))
            tokens += 1 + best[size]
            seconds += cost[size] + (draft_ms if size else 0.0)
    return tokens / seconds * cost[0]


DRAFT_MS = (0.0, 2.9, 5.0)  # free; DFlash's block forward steady; with the features it projects after cheap rounds


def main() -> None:
    rows = []
    for name in sys.argv[1:]:
        data = json.loads((HERE / name).read_text())
        for dataset, answers in data["sets"].items():
            rows.append({
                "set": dataset, "answers": len(answers), "rounds": sum(a["rounds"] for a in answers),
                "tau": pooled(answers, "tau"), "C": pooled(answers, "mean_coverage"),
                "C_same": pooled(answers, "mean_best_coverage_same_size"), "C_B": pooled(answers, "mean_best_coverage"),
                "SR_trees": speedup(answers, data["cost_ms"], "drafter"), "SR_best": speedup(answers, data["cost_ms"], "best"),
                "charged": [charged_ceiling(answers, data["cost_ms"], ms) for ms in DRAFT_MS],
            })  # fmt: skip
    print("| set | answers · rounds | τ | drafter C_p | best C*_p, same sizes | reached | best C*_p, N = 32 "
          "| SR of the drafter's trees, drafting free | SR*, best trees |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['answers']} · {r['rounds']} | {r['tau']:.2f} | {r['C']:.2f} | {r['C_same']:.2f} | "
              f"{r['C'] / r['C_same']:.0%} | {r['C_B']:.2f} | {r['SR_trees']:.2f}× | {r['SR_best']:.2f}× |")
    print("\n| set | " + " | ".join(f"SR*, drafting {ms} ms" for ms in DRAFT_MS) + " |")
    print("|---|" + "---|" * len(DRAFT_MS))
    for r in rows:
        print(f"| {r['set']} | " + " | ".join(f"{x:.2f}×" for x in r["charged"]) + " |")
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_c, ax_sr = fig.subplots(1, 2)
    x = range(len(rows))
    for i, (key, label) in enumerate([("C", "drafter's trees"), ("C_same", "best trees, same sizes"),
                                      ("C_B", "best trees, N = 32")]):
        ax_c.bar([j + 0.27 * (i - 1) for j in x], [r[key] for r in rows], 0.27, label=label)
    for i, (key, label) in enumerate([("SR_trees", "drafter's trees, drafting free"), ("SR_best", "best trees (SR*)")]):
        ax_sr.bar([j + 0.4 * (i - 0.5) for j in x], [r[key] for r in rows], 0.4, label=label)
    ax_sr.axhline(2.0, color="k", ls="--", lw=0.8, label="issue 35's T = 1 goal")
    for ax, title in [(ax_c, "mean coverage C_p per round (E[τ] = 1 + C_p)"), (ax_sr, "speed-up over the one-token step")]:
        ax.set_xticks(list(x), [r["set"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("T = 1: the drafter's trees against the target's own best trees (SmolLM2-135M-Instruct, bf16)")
    fig.savefig(HERE / "oracle.png", dpi=120)


if __name__ == "__main__":
    main()
