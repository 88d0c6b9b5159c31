"""The chat record's table: per prompt the median tok/s of each way (speculative, autoregressive, llama.cpp), τ,
the speedup over exitspec's own loop and over llama.cpp, and their means.  python table.py results.jsonl"""

import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| prompt | speculative tok/s | autoregressive tok/s | llama.cpp tok/s | τ | speculative / AR | "
      "speculative / llama.cpp | = AR |")
print("|---|---|---|---|---|---|---|---|")
over_llama = []
for r in rows:
    rates = {way: statistics.median(runs) for way, runs in r["tokens_per_second"].items()}
    llama = next(v for k, v in rates.items() if k.startswith("llama.cpp"))
    over_llama.append(rates["speculative"] / llama)
    print(f"| {r['prompt'][:45]} | {rates['speculative']:.1f} | {rates['autoregressive']:.1f} | {llama:.1f} | "
          f"{r['stats']['tau']:.2f} | {r['speedup']:.2f}× | {over_llama[-1]:.2f}× | {r['identical_to_autoregressive']} |")
print(f"\nmean: speculative / AR {statistics.mean(r['speedup'] for r in rows):.2f}×, speculative / llama.cpp "
      f"{statistics.mean(over_llama):.2f}× over {len(rows)} prompts")
