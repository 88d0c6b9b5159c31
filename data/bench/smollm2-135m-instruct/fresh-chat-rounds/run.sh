#!/usr/bin/env bash
# Session 35: fresh-process chat speedups after the sync-free rounds (fp32, warm), as fresh-chat-suffix/run.sh.
set -euo pipefail
C=data/bench/smollm2-135m-instruct/fresh-chat-rounds
rm -f $C/*.jsonl
bash scripts/chat-compare.sh $C/fp32-warm.jsonl -- --threads 2 > $C/fp32-warm.txt
