#!/usr/bin/env bash
# Fresh-process speedups: `exitspec generate --compare --json` once per prompt of a JSONL file, each in a new
# process, as a user runs it (load and the cost grid's spot check happen before the timed runs; each process
# starts from what earlier ones learned unless --no-warm-start is among the extra options).
#   bash scripts/chat-compare.sh OUT.jsonl [PROMPTS.jsonl] [-- generate options...]
# Appends one JSON object per prompt to OUT.jsonl, each run's warnings (a cost grid measured on a busy machine,
# say) to OUT.log beside it, and prints the per-prompt and mean speedup.
set -euo pipefail
out=$1; shift
prompts=data/prompts/everyday-chat.jsonl
if [[ $# -gt 0 && $1 != -- ]]; then prompts=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
python -c 'import json, sys; [print(json.loads(l)["prompt"]) for l in open(sys.argv[1]) if l.strip()]' "$prompts" |
while IFS= read -r prompt; do
    exitspec generate "$prompt" --compare --json "$@" >> "$out" 2>> "${out%.jsonl}.log"
done
python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for r in rows:
    s = r["stats"]
    print(f"SR {r['speedup']:.2f} (range {min(r['speedups']):.2f}-{max(r['speedups']):.2f})  τ {s['tau']:.2f}  "
          f"{s['tokens_per_second']:.1f} vs {r['autoregressive']['tokens_per_second']:.1f} tok/s  "
          f"identical {r['identical_to_autoregressive']}  {r['prompt'][:50]}")
print(f"mean SR {statistics.mean(r['speedup'] for r in rows):.2f} over {len(rows)} prompts, mean τ "
      f"{statistics.mean(r['stats']['tau'] for r in rows):.2f}")
PY
