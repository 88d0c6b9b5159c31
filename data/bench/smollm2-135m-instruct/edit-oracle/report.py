"""The oracle study's tables (Markdown, stdout) and plot from oracle.py's JSON files.

    python data/bench/smollm2-135m-instruct/edit-oracle/report.py edit.json table1.json              # oracle.png
    python data/bench/smollm2-135m-instruct/edit-oracle/report.py edit-full.json --cost-from edit.json \
        --plot oracle-full.png

--cost-from prices every round with another file's cost model (its t(N) for the sizes up to this file's
budget), so that studies measured with different calibrations compare on one cost curve.
"""

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

HERE = Path(__file__).parent


def pooled(answers: list[dict], key: str) -> float:
    """Mean over all rounds of the set (answers weighted by their rounds)."""
    return sum(a[key] * a["rounds"] for a in answers) / sum(a["rounds"] for a in answers)


def drafter_speedup(answers: list[dict], cost: list[float]) -> float:
    """Σ (1 + C_p) t(0) / Σ t(N) over every round of the set, at the drafter's own tree sizes."""
    tokens = sum(1 + c for a in answers for c in a["coverage"])
    seconds = sum(cost[n] for a in answers for n in a["sizes"])
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
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--cost-from", help="price the rounds with this JSON file's cost model")
    ap.add_argument("--plot", default="oracle.png")
    args = ap.parse_args()
    rows = []
    for name in args.files:
        data = json.loads((HERE / name).read_text())
        budget = data["settings"]["budget"]
        if args.cost_from:
            data["cost_ms"] = json.loads((HERE / args.cost_from).read_text())["cost_ms"][: budget + 1]
        for dataset, answers in data["sets"].items():
            rows.append({
                "set": dataset, "budget": budget, "answers": len(answers), "rounds": sum(a["rounds"] for a in answers),
                "tau": pooled(answers, "tau"), "C": pooled(answers, "mean_coverage"),
                "C_same": pooled(answers, "mean_best_coverage_same_size"), "C_B": pooled(answers, "mean_best_coverage"),
                "SR_trees": drafter_speedup(answers, data["cost_ms"]), "SR_best": charged_ceiling(answers, data["cost_ms"], 0.0),
                "charged": [charged_ceiling(answers, data["cost_ms"], ms) for ms in DRAFT_MS],
            })  # fmt: skip
    print("| set | answers · rounds | τ | drafter C_p | best C*_p, same sizes | reached | best C*_p, N = B "
          "| SR of the drafter's trees, drafting free | SR*, best trees |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['answers']} · {r['rounds']} | {r['tau']:.2f} | {r['C']:.2f} | {r['C_same']:.2f} | "
              f"{r['C'] / r['C_same']:.0%} | {r['C_B']:.2f} (B = {r['budget']}) | {r['SR_trees']:.2f}× | "
              f"{r['SR_best']:.2f}× |")
    print("\n| set | " + " | ".join(f"SR*, drafting {ms} ms" for ms in DRAFT_MS) + " |")
    print("|---|" + "---|" * len(DRAFT_MS))
    for r in rows:
        print(f"| {r['set']} | " + " | ".join(f"{x:.2f}×" for x in r["charged"]) + " |")
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_c, ax_sr = fig.subplots(1, 2)
    x = range(len(rows))
    for i, (key, label) in enumerate([("C", "drafter's trees"), ("C_same", "best trees, same sizes"),
                                      ("C_B", "best trees, N = B")]):
        ax_c.bar([j + 0.27 * (i - 1) for j in x], [r[key] for r in rows], 0.27, label=label)
    for i, (key, label) in enumerate([("SR_trees", "drafter's trees, drafting free"), ("SR_best", "best trees (SR*)")]):
        ax_sr.bar([j + 0.4 * (i - 0.5) for j in x], [r[key] for r in rows], 0.4, label=label)
    ax_sr.axhline(2.0, color="k", ls="--", lw=0.8, label="issue 35's T = 1 goal")
    for ax, title in [(ax_c, "mean coverage C_p per round (E[τ] = 1 + C_p)"), (ax_sr, "speed-up over the one-token step")]:
        ax.set_xticks(list(x), [r["set"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("T = 1: the drafter's trees against the target's own best trees (SmolLM2-135M-Instruct, bf16)")
    fig.savefig(HERE / args.plot, dpi=120)


if __name__ == "__main__":
    main()
