#!/usr/bin/env bash
# Issue 4's crossed evaluation of the shipped DFlash drafter and its three fine-tunings
# (scripts/exittrain-controls.sh): drafter {original, none, prefix, exit} x verifier {predraw, tev}
# x B {32, 64} x temperature {0, 1} on held-out GSM8K test, HumanEval and MT-Bench prompts.
#
#   bash scripts/exittrain-crossed.sh      # both parts; a rerun skips a written heldout.json, resumes the bench
#
# Part 1, exact τ without timing noise: `exitspec train eval` scores each drafter's inference DDTree at
# anchors along the target's own responses; E[τ] = 1 + C_p is what every saturated verifier (predraw and
# TEV alike) accepts in expectation, so it has no verifier axis.
# Part 2, τ and SR by decoding: `exitspec bench`, all settings crossed and measured side by side against
# autoregressive decoding in one run. On 2 CPU cores it is scaled down (PROMPTS prompts per dataset,
# TOKENS new tokens); on a GPU raise both.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-5}
TOKENS=${TOKENS:-64}
OUT=${OUT:-data/exittrain-runs/smollm2-135m-instruct/crossed}  # tracked: a later session (a fresh machine) resumes it
# the original, the two controls' final weights (remade by scripts/exittrain-controls.sh into RUNS; weights
# ship only in exitspec/assets, so they are not committed) and ExitTrain's (shipped as exittrain)
RUNS=${RUNS:-runs/exittrain}
DRAFTERS=(dflash "$RUNS/none/final" "$RUNS/prefix/final" exittrain)
mkdir -p "$OUT"
[ -f "$OUT/heldout.json" ] || exitspec train eval --drafters "${DRAFTERS[@]}" --budgets 32 64 \
    --temperatures 0 1 --num-prompts 20 --anchors 16 --threads 2 --no-progress --out "$OUT/heldout.json"
exitspec bench --datasets gsm8k humaneval mtbench --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS" \
    --drafters "${DRAFTERS[@]}" --budgets 32 64 --verifiers predraw tev --temperatures 0 1 \
    --threads 2 --out "$OUT/bench" --no-progress
