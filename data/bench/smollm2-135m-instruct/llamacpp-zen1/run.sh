#!/usr/bin/env bash
# exitspec against llama.cpp on the same weights, one sitting, 2 threads, T = 0, Table 1's sets (3 prompts each,
# MT-Bench both turns), 128 new tokens, DFlash + TEV + --budget auto. llama.cpp's rows run on each prompt right
# after exitspec's (bench's interleaving). Needs: bash scripts/setup.sh && bash scripts/llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")"
run() {  # $1: --dtype, then the peers
    local dtype=$1; shift
    exitspec bench --preset table1 --num-prompts 3 --temperatures 0 --budgets auto --verifiers tev \
        --max-new-tokens 128 --dtype "$dtype" --threads 2 --peers "$@" --out "$dtype" --no-progress > "$dtype.log" 2>&1
}
run gguf llamacpp-q4_1 llamacpp-q4_1-ngram
run bfloat16 llamacpp-bf16 llamacpp-q4_1
exitspec latency --stage forward --dtype gguf --llamacpp --sizes 0 1 3 7 15 --context 300 --repeats 5 --threads 2 \
    --out forward-gguf.json > forward-gguf.txt 2>&1
exitspec latency --stage forward --dtype bfloat16 --llamacpp --sizes 0 1 3 7 15 --context 300 --repeats 5 --threads 2 \
    --out forward-bf16.json > forward-bf16.txt 2>&1
lscpu > cpu.txt
