"""The record's table: tokens per second per set and pooled for exitspec (autoregressive, speculative) and the
llama.cpp peers of each run, their ratios, and the same without the answers that loop.

    python table.py gguf/results.jsonl bfloat16/results.jsonl > table.md

A speculative answer loops when at least half of its tokens sit in an 8-gram that already occurred earlier in it.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

GRAM = 8


def loops(tokens: list[int]) -> bool:
    seen, repeated = set(), 0
    for i in range(len(tokens) - GRAM + 1):
        gram = tuple(tokens[i : i + GRAM])
        repeated += gram in seen
        seen.add(gram)
    return repeated >= len(tokens) / 2


def table(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    env = next(r for r in rows if "forward" in r)
    turns = defaultdict(dict)  # (dataset, prompt, turn) -> engine -> (tokens, seconds)
    tau, looping = {}, set()  # (dataset, prompt, turn) -> the speculative run's τ
    for r in rows:
        key = (r.get("dataset"), r.get("prompt_id"), r.get("turn"))
        if r.get("kind") == "baseline":
            turns[key]["exitspec AR"] = (len(r["ar"]["tokens"]), r["ar"]["total_seconds"])
        elif "peer" in r:
            turns[key][r["peer"]] = (r["new_tokens"], r["total_seconds"])
        elif "drafter" in r:
            turns[key]["exitspec spec"] = (r["new_tokens"], r["total_seconds"])
            tau[key] = r["tau"]
            if loops(r["tokens"]):
                looping.add(key)
    engines = list(dict.fromkeys(e for t in turns.values() for e in t))
    out = [f"### {env['forward']['dtype']} ({path})", "",
           (f"{env['device_name']}, {env['threads']} threads, torch {env['torch']}, load average at start "
            f"{env['load_average'][0]:.2f}; {len(turns)} turns, {len(looping)} looping"), "",
           "| set | " + " | ".join(f"{e} tok/s" for e in engines) + " | τ | spec / llama.cpp |",
           "|---|" + "---|" * (len(engines) + 2)]
    for subset, skip in (("", set()), (" (no loops)", looping)):
        pooled = defaultdict(lambda: [0, 0.0])
        for ds in dict.fromkeys(k[0] for k in turns):
            sums = defaultdict(lambda: [0, 0.0])
            for key, t in turns.items():
                if key[0] != ds or key in skip:
                    continue
                for e, (n, s) in t.items():
                    sums[e][0] += n
                    sums[e][1] += s
                    pooled[e][0] += n
                    pooled[e][1] += s
            out.append(line(ds + subset, engines, sums, [t for k, t in tau.items() if k[0] == ds and k not in skip]))
        out.append(line(f"**pooled{subset}**", engines, pooled, [t for k, t in tau.items() if k not in skip]))
    return "\n".join(out)


def line(name, engines, sums, taus) -> str:
    rate = {e: sums[e][0] / sums[e][1] for e in engines if sums[e][1]}
    peers = [e for e in engines if e.startswith("llamacpp")]
    ratios = " / ".join(f"{rate['exitspec spec'] / rate[p]:.2f}×" for p in peers if p in rate)
    return (f"| {name} | " + " | ".join(f"{rate[e]:.1f}" if e in rate else "–" for e in engines)
            + f" | {sum(taus) / len(taus):.2f} | {ratios} |")


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
