#!/usr/bin/env bash
# run.sh's comparison at T = 1 (top-p 1, top-k 0, seed 0 + repeat): exitspec against llama.cpp on the same weights,
# one sitting, 2 threads, Table 1's sets (3 prompts each, MT-Bench both turns), 128 new tokens, DFlash + TEV +
# --budget auto, llama.cpp's rows right after exitspec's on each prompt. Needs: bash scripts/setup.sh && bash
# scripts/llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")"
run() {  # $1: --dtype, then the peers
    local dtype=$1; shift
    exitspec bench --preset table1 --num-prompts 3 --temperatures 1 --budgets auto --verifiers tev \
        --max-new-tokens 128 --dtype "$dtype" --threads 2 --peers "$@" --out "$dtype-t1" --no-progress \
        > "$dtype-t1.log" 2>&1
}
run gguf llamacpp-q4_1
run bfloat16 llamacpp-bf16
