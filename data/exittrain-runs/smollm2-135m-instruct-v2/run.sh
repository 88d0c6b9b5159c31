#!/usr/bin/env bash
# ExitTrain at the paper's setting on the v2 drafter (issue 19), stage by stage. Every stage resumes where it
# stopped (online chunks, training checkpoints every 25 steps, bench rows), so rerun a stage to continue it:
#
#   python data/exittrain-runs/smollm2-135m-instruct-v2/make-validation.py   # the λ sweep's validation split
#   bash data/exittrain-runs/smollm2-135m-instruct-v2/run.sh sweep        # exit weight at each λ of LAMS, SWEEP steps
#   bash data/exittrain-runs/smollm2-135m-instruct-v2/run.sh sweep-eval   # their E[τ] on the validation split
#   LAM=... bash data/exittrain-runs/smollm2-135m-instruct-v2/run.sh arms  # exit, none, prefix, reach to STEPS
#   bash data/exittrain-runs/smollm2-135m-instruct-v2/run.sh eval         # held-out E[τ], paired, exit by depth
#
# All arms: the same init (the shipped `dflash`), online data stream (one folder of chunks, made by the first
# run that reaches a chunk and read by the others: the target's answers are a function of the stream position
# alone, online.py), seeds, anchors, steps and schedule. They differ only in the node weight of L_exit and λ.
# Checkpoints live in runs/exittrain-v2/<arm>/ (local); logs are copied here by `logs`. Run from the repo root.
set -euo pipefail
HERE=data/exittrain-runs/smollm2-135m-instruct-v2
RUNS=runs/exittrain-v2
STEPS=${STEPS:-400}  # the schedule's length (cosine to 0.1·lr); the same for every arm
# the paper's setting: init from the shipped drafter, B = 64 training trees, lr 1e-4, batch 4, online T = 1 and
# greedy chunks; the stream: GSM8K train, ShareGPT first turns, stdlib code prompts (never a benchmark set)
COMMON="--init exitspec/assets/dflash-smollm2-135m-instruct --online 64 --online-temperatures 1 0 \
  --gsm8k 7000 --sharegpt 7000 --code 2500 --max-new-tokens 256 --gen-batch-size 64 \
  --budget 64 --lr 1e-4 --warmup 10 --batch-size 4 --anchors ${ANCHORS:-8} --gamma 4 --steps $STEPS \
  --save-every 25 --log-every 5 --keep 2 --threads ${THREADS:-2} --no-progress"

arm() {  # arm NAME WEIGHT LAM [STOP_AT]
  mkdir -p "$RUNS/online" "$RUNS/$1"
  ln -sfn ../online "$RUNS/$1/online"  # one stream of chunks for every arm
  exitspec train exit --run-dir "$RUNS/$1" --weight "$2" --lam "$3" $COMMON ${4:+--stop-at "$4"}
}

case "${1:?stage: sweep | sweep-eval | arms | eval | logs}" in
  sweep)  # the first SWEEP steps of the exit arm at each λ: the winner goes on to STEPS in `arms`
    for lam in ${LAMS:-16 64 256}; do arm "exit-lam$lam" exit "$lam" "${SWEEP:-100}"; done ;;
  sweep-eval)
    exitspec train eval --drafters exitspec/assets/dflash-smollm2-135m-instruct \
      $(for lam in ${LAMS:-16 64 256}; do echo "$RUNS/exit-lam$lam/checkpoints/step-$(printf %08d "${SWEEP:-100}")/drafter"; done) \
      --datasets $HERE/validation/gsm8k-train.jsonl $HERE/validation/sharegpt.jsonl $HERE/validation/code.jsonl \
      --rollouts runs/validation --num-prompts 40 --budgets 64 --temperatures 0 1 --anchors 16 --threads 2 \
      --no-progress --out $HERE/sweep/eval.json --plot $HERE/sweep/exit-by-depth.png ;;
  arms)  # LAM: the sweep's choice; the released TEV code's variant takes P(v) as is, at 0.1 per tree (= 6.4 here)
    arm "exit-lam${LAM:?the sweep\'s λ}" exit "$LAM" ${STOP_AT:-}
    arm none none 0 ${STOP_AT:-}
    arm "prefix-lam$LAM" prefix "$LAM" ${STOP_AT:-}
    arm reach-lam6.4 reach 6.4 ${STOP_AT:-} ;;
  eval)
    exitspec train eval --drafters exitspec/assets/dflash-smollm2-135m-instruct "$RUNS/none/final" \
      "$RUNS/prefix-lam${LAM:?}/final" "$RUNS/reach-lam6.4/final" "$RUNS/exit-lam$LAM/final" \
      --budgets 32 64 128 --temperatures 0 1 --anchors 16 --threads 2 --no-progress \
      --out $HERE/eval/heldout.json --plot $HERE/eval/exit-by-depth.png ;;
  logs)  # the runs' metrics logs and summaries into the record
    for d in "$RUNS"/*/; do
      name=$(basename "$d"); [ "$name" = online ] && continue
      mkdir -p "$HERE/$name"; cp "$d"log.jsonl "$HERE/$name/"; [ -f "$d"summary.json ] && cp "$d"summary.json "$HERE/$name/"
    done ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
