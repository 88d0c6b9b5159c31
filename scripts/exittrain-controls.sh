#!/usr/bin/env bash
# ExitTrain and its two controls for the default model (issue 4): three fine-tunings of the shipped DFlash
# drafter at matched initialisation, data, steps and anchors, differing only in the node weights of the
# second loss term: none (token loss only, λ = 0), prefix (P(v) rescaled to the tree's exit mass), exit (w(v)).
#
#   bash scripts/exittrain-controls.sh            # runs (or resumes) all three, one after the other
#   STOP_AT=100 bash scripts/exittrain-controls.sh  # brings each run to step 100 at most, then stops
#
# Each run checkpoints every 25 steps under runs/exittrain/<weight>/ and resumes from its newest checkpoint
# when the command is repeated; a finished run is skipped.
#
# λ = 32 = B: L_exit divides by the number of non-root nodes (about B per tree) while each tree's exit weights
# sum to at most 1, so at λ = 1 the exit term is about 1/100 of the token loss (0.04 against 4.2) and a prefix
# run's training loss and accuracy matched the token-only run's to three decimals.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
LAM=${LAM:-32}
for weight in none prefix exit; do
    exitspec train exit --weight "$weight" --lam "$LAM" --budget 32 \
        --init exitspec/assets/dflash-v1-smollm2-135m-instruct \
        --rollouts data/rollouts/smollm2-135m-instruct --run-dir "runs/exittrain/$weight" \
        --steps "$STEPS" ${STOP_AT:+--stop-at "$STOP_AT"} --batch-size 2 --anchors 16 --gamma 4 \
        --lr 3e-4 --warmup 10 --save-every 25 --log-every 5 --threads 2 --no-progress
done
