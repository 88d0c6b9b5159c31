#!/usr/bin/env bash
# Table 1 with the fair baseline (session 33): every SR is over exitspec's own autoregressive loop on the same
# target object, same row plan (forward_config recorded in each row). T = 0 and 1, 20 prompts per set.
# Then the peers on the T = 0 rows of the first 10 prompts per set.
set -euo pipefail
D=data/bench/smollm2-135m-instruct/fair-table1
exitspec bench --preset table1 --drafters dflash --verifiers tev --budgets auto --num-prompts 20 \
    --max-new-tokens 128 --threads 2 --no-progress --out $D
exitspec bench --preset table1 --drafters dflash --verifiers tev --budgets auto --num-prompts 10 \
    --max-new-tokens 128 --threads 2 --no-progress --temperatures 0 --out $D \
    --peers hf-lookup vllm-fp32 vllm-bf16 vllm-ngram --vllm-python "${VLLM_PYTHON:-/tmp/vllm-venv/bin/python}"
