#!/usr/bin/env bash
# The README's main command on the 10 everyday chat prompts, a fresh process each, as a user runs it: speculative
# and autoregressive runs alternated (3 pairs) and llama.cpp's server on the same Q4_1 file after each pair
# (generate --compare adds it where scripts/llamacpp.sh built it). --no-warm-start: no process starts from what
# earlier ones learned (nor from a suffix memory that may hold these answers). 2-core first-generation EPYC,
# commit b11d43d with the JSON's per-run rates of every row.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=data/bench/smollm2-135m-instruct/chat-zen1/results.jsonl
rm -f "$out"
python -c 'import json; [print(json.loads(l)["prompt"]) for l in open("data/prompts/everyday-chat.jsonl")]' |
while IFS= read -r prompt; do
    exitspec generate "$prompt" --compare --json --no-warm-start >> "$out"
done
python data/bench/smollm2-135m-instruct/chat-zen1/table.py "$out"
