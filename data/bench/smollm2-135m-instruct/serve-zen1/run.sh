#!/usr/bin/env bash
# exitspec serve against the decoding it wraps: 10 everyday chat prompts, greedy, 128 tokens, a streamed then a
# whole request each (openai client); commit b11d43d with serve.py as committed next (first text timed from arrival), 2-core first-generation EPYC, quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
python scripts/serve-bench.py data/bench/smollm2-135m-instruct/serve-zen1/results.jsonl > data/bench/smollm2-135m-instruct/serve-zen1/table.md
