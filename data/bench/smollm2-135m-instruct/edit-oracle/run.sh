#!/usr/bin/env bash
# The best trees against the drafter's at T = 1: the edit preset's three sets (8 prompts each, as in edit-bf16),
# then the Table 1 sets (4 prompts each) for comparison; 48 rounds an answer, B = 32, bf16 (--dtype auto here).
set -euo pipefail
R=data/bench/smollm2-135m-instruct/edit-oracle
lscpu | grep -E "Model name|Flags" | sed 's/Flags:.*avx512_bf16.*/Flags: ... avx512_bf16 .../' > $R/cpu.txt
python $R/oracle.py --sets humaneval-edit gsm8k-rewrite mtbench-revise --num-prompts 8 --out $R/edit.json \
    2>&1 | grep -v Warning > $R/edit.txt
python $R/oracle.py --sets mtbench humaneval gsm8k math500 --num-prompts 4 --out $R/table1.json \
    2>&1 | grep -v Warning > $R/table1.txt
# Whole answers (up to 256 tokens, as in the bench) for the edit sets, the best trees up to N = 16 (half the
# forwards of N = 32; the most profitable size is 5 at the median)
python $R/oracle.py --sets humaneval-edit gsm8k-rewrite mtbench-revise --num-prompts 8 --rounds 100000 \
    --budget 16 --out $R/edit-full.json 2>&1 | grep -v Warning > $R/edit-full.txt
# Which source falls short, and where (fixed trees of 5 nodes; a few minutes each)
python $R/sources.py 5 2>&1 | grep -v Warning > $R/sources.txt
python $R/shape.py 2>&1 | grep -v Warning > $R/shape.txt
python $R/report.py edit.json table1.json > $R/table.md
python $R/report.py edit-full.json --cost-from edit.json --plot oracle-full.png > $R/table-full.md
