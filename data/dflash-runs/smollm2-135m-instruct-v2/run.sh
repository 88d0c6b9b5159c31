#!/usr/bin/env bash
# The v2 DFlash drafter for SmolLM2-135M-Instruct (issue 17), stage by stage. Every stage resumes where it
# stopped (rollout and feature shards, training checkpoints), so rerun a stage to continue it:
#
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh greedy     # target rollouts, T = 0
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh t1         # target rollouts, T = 1, other prompts
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh features   # the target's features + top-32, once
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh ce|kl      # the matched-compute pair of runs
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh curve      # their held-out curves, plot and table
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh long       # the better loss, on all rollouts, long
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh curve-long # the long runs' held-out curves
#   bash data/dflash-runs/smollm2-135m-instruct-v2/run.sh ship       # the 1-layer run's final drafter -> `dflash`
#
# Rollouts are committed (data/rollouts/...); features and checkpoints live in runs/ (remade from the
# rollouts by this script). Run from the repository root.
set -euo pipefail
R=data/rollouts/smollm2-135m-instruct-v2
F=runs/features-v2
LAYERS=2,15,27  # low, middle and high target layers (EAGLE-3's choice of taps)
GEN="--max-new-tokens 256 --gen-batch-size 128 --shard-size 128 --threads 2"
# the drafter: 1 layer, block 8 (7 drafted depths), context window 128, a 16384-token draft vocabulary
DRAFTER="--target-layers $LAYERS --num-layers 1 --block-size 8 --gamma 4 --context-window 128 --draft-vocab 16384"
TRAIN="--batch-size 4 --anchors 64 --lr 1e-3 --warmup 100 --save-every 100 --log-every 10 --keep 2"

case "${1:?stage: greedy | t1 | features | ce | kl | long | curve | curve-long | ship}" in
  greedy)  # 2000 prompts each of GSM8K train, ShareGPT first turns and stdlib code prompts, interleaved
    exitspec train dflash --rollouts-only --rollouts $R/greedy --gsm8k 2000 --sharegpt 2000 --code 2000 \
      --temperature 0 $GEN ;;
  t1)  # the prompts after those 6000 in the same interleaved order, sampled at T = 1
    exitspec train dflash --rollouts-only --rollouts $R/t1 --gsm8k 3000 --sharegpt 3000 --code -1 \
      --skip-prompts 6000 --temperature 1 $GEN ;;
  features)
    exitspec train dflash --features-only --features $F --topk 32 --rollouts $R --target-layers $LAYERS \
      --threads 2 ;;
  ce|kl)  # the matched pair: the same drafter, data order, seeds and steps; only the block loss differs.
           # Session 26 ran both side by side, one thread each (THREADS=1), when $R held greedy/ alone.
    exitspec train dflash --rollouts $R --features $F --run-dir runs/dflash-v2-$1 --loss $1 $DRAFTER \
      $TRAIN --eval-every 250 --steps "${STEPS:-1000}" --threads "${THREADS:-2}" --no-progress ;;
  long)  # the drafter to ship: kl (the pair's better loss at T = 1, tied at T = 0) on every rollout, greedy and
         # T = 1, trained long. Session 27 ran the capacity pair side by side, one thread each:
         # THREADS=1 DRAFT_LAYERS=1 and THREADS=1 DRAFT_LAYERS=2 (same data order and seeds). Rerun to resume.
         # Session 28 went on with the 1-layer run alone, its schedule shortened: STEPS=3600 from step 1300,
         # then STEPS=3000 EVAL_EVERY=500 from step 1900 (the shipped drafter; see the README).
    exitspec train dflash --rollouts $R --features $F --run-dir runs/dflash-v2-long-${DRAFT_LAYERS:-1}l --loss kl \
      $DRAFTER --num-layers "${DRAFT_LAYERS:-1}" $TRAIN --eval-every "${EVAL_EVERY:-250}" --steps "${STEPS:-12000}" --threads "${THREADS:-2}" \
      --no-progress ;;
  curve)
    exitspec train curve runs/dflash-v2-ce runs/dflash-v2-kl --out data/dflash-runs/smollm2-135m-instruct-v2/ce-vs-kl/curve.png ;;
  curve-long)
    exitspec train curve runs/dflash-v2-long-1l runs/dflash-v2-long-2l --out data/dflash-runs/smollm2-135m-instruct-v2/long/curve.png ;;
  ship)  # the shipped `dflash` (the drafter it replaced, `dflash-v1`, no longer ships; git history holds it)
    cp runs/dflash-v2-long-1l/final/* exitspec/assets/dflash-smollm2-135m-instruct/ ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
