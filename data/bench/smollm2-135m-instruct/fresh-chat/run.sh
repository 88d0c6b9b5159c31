#!/usr/bin/env bash
# Fresh-process `generate --compare` (3 alternated pairs, 128 tokens, T = 0) on the 10 everyday chat prompts
# of data/prompts/everyday-chat.jsonl, one process per prompt: warm (from what earlier runs saved), cold
# (--no-warm-start), and bf16 (warm).
set -euo pipefail
C=data/bench/smollm2-135m-instruct/fresh-chat
rm -f $C/*.jsonl
bash scripts/chat-compare.sh $C/fp32-warm.jsonl -- --threads 2 > $C/fp32-warm.txt
bash scripts/chat-compare.sh $C/fp32-cold.jsonl -- --threads 2 --no-warm-start > $C/fp32-cold.txt
bash scripts/chat-compare.sh $C/bf16-warm.jsonl -- --threads 2 --dtype bfloat16 > $C/bf16-warm.txt
exitspec latency --stage profile --sizes 0 4 8 16 --threads 2 --json $C/../forward-cost-packed/profile-fp32.json \
    > $C/../forward-cost-packed/profile-fp32.txt
exitspec latency --stage profile --sizes 0 4 8 16 --threads 2 --dtype bfloat16 \
    --json $C/../forward-cost-packed/profile-bf16.json > $C/../forward-cost-packed/profile-bf16.txt
