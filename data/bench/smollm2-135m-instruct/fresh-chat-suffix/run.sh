#!/usr/bin/env bash
# Session 34: fresh-process chat speedups with suffix trees in DFlash's trees (fp32, warm), as fresh-chat/run.sh.
set -euo pipefail
C=data/bench/smollm2-135m-instruct/fresh-chat-suffix
rm -f $C/*.jsonl
bash scripts/chat-compare.sh $C/fp32-warm.jsonl -- --threads 2 > $C/fp32-warm.txt
