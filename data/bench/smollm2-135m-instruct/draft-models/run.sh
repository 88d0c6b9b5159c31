#!/usr/bin/env bash
# Draft models as tree drafters (issue 39): the default target's first K layers (layers:K, sharing its weights) as
# exitspec's tree drafter, against transformers' assisted generation with the same draft model (hf-assistant:layers:K,
# chains of the same 6 draft forwards a round); then the target drafting for itself (the ceiling check).
set -euo pipefail
cd "$(dirname "$0")"
exitspec bench --datasets gsm8k mtbench --num-prompts 4 --max-new-tokens 64 --temperatures 0 1 --threads 2 \
    --drafters layers:4 layers:8 layers:12 --budgets 32 auto --verifiers tev \
    --peers hf-assistant:layers:4 hf-assistant:layers:8 hf-assistant:layers:12 --out layers --no-progress
exitspec bench --datasets gsm8k mtbench --num-prompts 4 --max-new-tokens 64 --temperatures 0 --threads 2 \
    --drafters "model:$HOME/.cache/exitspec/models/SmolLM2-135M-Instruct" --budgets 32 --verifiers tev \
    --out self --no-progress
