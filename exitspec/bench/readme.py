"""The README's results table, made from the committed record it cites, so that no number in it is typed by hand.

    python -m exitspec.bench.readme          # rewrites the table between its markers in README.md
    tests/test_repository.py                 # fails when README.md's table is not what this makes

The record is one sitting (RECORD/run.sh): exitspec's autoregressive and speculative runs and llama.cpp on the
same weights, interleaved prompt by prompt (results.jsonl per weight format), and the one-step timings beside
llama-bench (forward-*.json). Speeds are tokens per second pooled over all prompts, prefill included; the ratio
is the mean over the four sets of speculative over llama.cpp tok/s, with the lowest set, and the same without
the prompts whose answers loop (report.looping_prompts): the headline, in bold.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from exitspec.bench.report import looping_prompts, pooled_rates
from exitspec.bench.rows import PeerRow
from exitspec.bench.runner import ResultsFile

RECORD = Path("data/bench/smollm2-135m-instruct/llamacpp-zen1")
WEIGHTS = (  # (the README's name, results folder, one-step timings, llama.cpp's peer row of the same weights)
    ("the default GGUF file, Q4_1 (`--dtype gguf`, the default on CPUs without native bf16)", "gguf",
     "forward-gguf.json", "llamacpp-q4_1"),
    ("BF16 (`--dtype bfloat16`)", "bfloat16", "forward-bf16.json", "llamacpp-bf16"),
)
BEGIN, END = "<!-- results table: made by python -m exitspec.bench.readme -->", "<!-- end of results table -->"


def results_table(root: Path) -> list[str]:
    """The table's Markdown lines, from the record under `root` (the repository)."""
    lines = [("| weights | one step, exitspec / llama.cpp | exitspec AR | exitspec speculative | llama.cpp AR | "
             "speculative / llama.cpp, mean of 4 sets (lowest) | the same without loops |"),
             "|---|---|---|---|---|---|---|"]
    for name, folder, forward, peer in WEIGHTS:
        rows = ResultsFile(root / RECORD / folder / "results.jsonl").rows
        step = next(r for r in json.loads((root / RECORD / forward).read_text())["rows"] if r["n"] == 0)
        peered = {(r.dataset, r.temperature, r.prompt_id, r.turn, r.repeat) for r in rows if isinstance(r, PeerRow)}
        pooled = pooled_rates(rows, peered, by=lambda r: "all")["all"]
        spec = next(k for k in pooled if k.startswith("exitspec ") and k != "exitspec AR")
        ratios = [rates[spec] / rates[peer] for rates in pooled_rates(rows, peered).values()]
        clean = [rates[spec] / rates[peer] for rates in pooled_rates(rows, peered - looping_prompts(rows)).values()]
        lines.append(f"| {name} | {step['decoder']['ms']:.1f} / {step['llama.cpp']['ms']:.1f} ms | "
                     f"{pooled['exitspec AR']:.1f} | {pooled[spec]:.1f} | {pooled[peer]:.1f} | "
                     f"{statistics.mean(ratios):.2f}× ({min(ratios):.2f}×) | "
                     f"**{statistics.mean(clean):.2f}×** ({min(clean):.2f}×) |")
    return lines


def readme_block(readme: str) -> list[str]:
    """The lines between the markers in README.md's text."""
    lines = readme.splitlines()
    return lines[lines.index(BEGIN) + 1 : lines.index(END)]


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    path = root / "README.md"
    text = path.read_text()
    lines = text.splitlines()
    start, end = lines.index(BEGIN), lines.index(END)
    path.write_text("\n".join(lines[: start + 1] + results_table(root) + lines[end:]) + "\n")
    print(f"wrote the results table of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
