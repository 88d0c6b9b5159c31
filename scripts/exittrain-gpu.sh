#!/usr/bin/env bash
# ExitTrain at the paper's scale (issue 19's protocol), for a GPU machine, in one command under torchrun.
#
#   bash scripts/exittrain-gpu.sh              # every stage in order, on every GPU here; rerun it to resume
#   bash scripts/exittrain-gpu.sh arms         # one stage: sweep | sweep-eval | arms | eval | record
#
# Stages (each resumes: online chunks and checkpoints every 25 steps are kept in $RUNS, a done stage is skipped):
#   sweep       the exit arm at each λ of LAMS for its first SWEEP steps (of the STEPS-step schedule)
#   sweep-eval  their held-out E[τ] at B = 64, T = 0 and 1, on a validation split (never a benchmark set);
#               the λ with the highest mean E[τ] goes on ($OUT/sweep/lam.txt)
#   arms        four arms to STEPS: exit (w(v)) at the chosen λ, continuing its sweep run; none (token-only,
#               λ = 0); prefix (P(v) rescaled to the tree's exit mass) at the chosen λ; and the released TEV
#               code's variant, raw P(v) at λ = 6.4 (its CE + 0.1·L_exit averaged per tree, about 64 nodes)
#   eval        held-out E[τ] of the init and the four arms at B = 32, 64, 128 and T = 0, 1 on the first 20
#               prompts of GSM8K, MATH-500, HumanEval and MT-Bench, paired by prompt (exit minus each other),
#               with the exit mass by depth
#   record      the runs' logs and summaries, and their held-out curves, into $OUT
#
# The paper's setting: init from the shipped `dflash`, online rollouts (the frozen target answers chunks of
# ONLINE fresh prompts as training reaches them, T = 1 and greedy chunks alternating; every arm reads the same
# stream, one folder of chunks), DDTrees of B = 64, lr 1e-4, batch 4 sequences per process, 8 anchors each.
# Under DDP each of NPROC processes takes its own 4 sequences, so the global batch is 4·NPROC.
#
# Expected time on one H100: about half an hour, an estimate (no GPU has been lent to this project yet; basis in
# data/exittrain-runs/smollm2-135m-instruct-v2/README.md). Each stage appends its seconds to $OUT/times.tsv,
# so the first GPU run measures it.
#
# CI runs this script at tiny sizes on the CPU (tests/test_exittrain_gpu.py: MODEL, INIT, DATA_DIR and the
# sizes below set by the test, NPROC=1, DEVICE=cpu), so it cannot rot before a GPU is lent.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-data/exittrain-runs/gpu}
RUNS=${RUNS:-runs/exittrain-gpu}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
NPROC=$((NPROC > 0 ? NPROC : 1))
INIT=${INIT:-exitspec/assets/dflash-smollm2-135m-instruct}
STEPS=${STEPS:-400}
SWEEP=${SWEEP:-100}
LAMS=${LAMS:-16 64 256}
HERE=data/exittrain-runs/smollm2-135m-instruct-v2/validation
VALIDATION=${VALIDATION:-$HERE/gsm8k-train.jsonl $HERE/sharegpt.jsonl $HERE/code.jsonl}
DATASETS=${DATASETS:-gsm8k math500 humaneval mtbench}  # held-out: the evaluation's and the training curves'
# shellcheck disable=SC2206  # the optional arguments split on purpose
MODEL_ARGS=(${MODEL:+--model "$MODEL"} ${DEVICE:+--device "$DEVICE"} ${DATA_DIR:+--data-dir "$DATA_DIR"})
COMMON=("${MODEL_ARGS[@]}" --init "$INIT" --online "${ONLINE:-64}" --online-temperatures 1 0
        --gsm8k "${GSM8K:-7000}" --sharegpt "${SHAREGPT:-7000}" --code "${CODE:-2500}"
        --max-new-tokens "${MAX_NEW_TOKENS:-256}" --gen-batch-size "${ONLINE:-64}" --budget "${BUDGET:-64}"
        --lr 1e-4 --warmup "${WARMUP:-10}" --batch-size 4 --anchors "${ANCHORS:-8}" --gamma 4 --steps "$STEPS"
        --save-every "${SAVE_EVERY:-25}" --log-every 5 --keep 2 --eval-every "${EVAL_EVERY:-50}"
        --eval-dir "$RUNS/heldout" --eval-datasets $DATASETS --eval-prompts "${EVAL_PROMPTS:-20}" --no-progress)
EVAL=("${MODEL_ARGS[@]}" --temperatures 0 1 --anchors 16 --no-progress)
mkdir -p "$OUT" "$RUNS/online"

source scripts/timed.sh

arm() {  # arm NAME WEIGHT LAM [STOP_AT]: one training run under torchrun, on the shared stream of online chunks
    mkdir -p "$RUNS/$1"
    ln -sfn ../online "$RUNS/$1/online"
    torchrun --standalone --nproc_per_node "$NPROC" -m exitspec train exit --run-dir "$RUNS/$1" --weight "$2" \
        --lam "$3" "${COMMON[@]}" ${4:+--stop-at "$4"} >> "$OUT/$1.log" 2>&1
}

sweep() {  # a run already at step SWEEP is skipped
    local lam
    for lam in $LAMS; do
        [ -d "$RUNS/exit-lam$lam/checkpoints/step-$(printf %08d "$SWEEP")" ] ||
            timed "sweep-$lam" arm "exit-lam$lam" exit "$lam" "$SWEEP"
    done
}

sweep_eval() {
    mkdir -p "$OUT/sweep"
    local drafters=() lam
    for lam in $LAMS; do drafters+=("$RUNS/exit-lam$lam/checkpoints/step-$(printf %08d "$SWEEP")/drafter"); done
    # shellcheck disable=SC2086  # VALIDATION is a list of files
    exitspec train eval --drafters "$INIT" "${drafters[@]}" --datasets $VALIDATION --heldout "$RUNS/validation" \
        --num-prompts "${VALIDATION_PROMPTS:-40}" --budgets 64 "${EVAL[@]}" --out "$OUT/sweep/eval.json" \
        > "$OUT/sweep/eval.txt"
    python - "$OUT/sweep/eval.json" > "$OUT/sweep/lam.txt" <<'EOF'
import json, re, sys
taus = {}
for row in json.load(open(sys.argv[1]))["exit_by_depth"]:  # pooled over the validation sets, per (B, T)
    found = re.search(r"exit-lam([0-9.]+)/", row["drafter"])
    if found:
        taus.setdefault(found.group(1), []).append(row["tau"])
print(max(taus, key=lambda lam: sum(taus[lam]) / len(taus[lam])))
EOF
}

arms() {  # a finished arm is skipped
    local lam
    lam=$(cat "$OUT/sweep/lam.txt")
    finished "exit-lam$lam" || timed exit arm "exit-lam$lam" exit "$lam"
    finished none || timed none arm none none 0
    finished "prefix-lam$lam" || timed prefix arm "prefix-lam$lam" prefix "$lam"
    finished reach-lam6.4 || timed reach arm reach-lam6.4 reach 6.4
}

finished() { [ -f "$RUNS/$1/final/model.safetensors" ]; }

evaluate() {
    local lam
    lam=$(cat "$OUT/sweep/lam.txt")
    mkdir -p "$OUT/eval"
    # shellcheck disable=SC2086  # DATASETS is a list of names
    exitspec train eval --drafters "$INIT" "$RUNS/none/final" "$RUNS/prefix-lam$lam/final" "$RUNS/reach-lam6.4/final" \
        "$RUNS/exit-lam$lam/final" --datasets $DATASETS --heldout "$RUNS/heldout" --num-prompts "${EVAL_PROMPTS:-20}" \
        --budgets 32 64 128 "${EVAL[@]}" --out "$OUT/eval/heldout.json" --plot "$OUT/eval/exit-by-depth.png" \
        > "$OUT/eval/heldout.txt"
}

record() {
    local runs=() d
    for d in "$RUNS"/*/; do
        [ -f "$d/log.jsonl" ] || continue
        mkdir -p "$OUT/$(basename "$d")"
        cp "$d/log.jsonl" "$OUT/$(basename "$d")/"
        [ -f "$d/summary.json" ] && cp "$d/summary.json" "$OUT/$(basename "$d")/"
        runs+=("$d")
    done
    exitspec train curve "${runs[@]}" --out "$OUT/curve.png" > "$OUT/curve.txt"
}

stage_sweep_eval() { [ -f "$OUT/sweep/lam.txt" ] || timed sweep-eval sweep_eval; }
stage_eval() { [ -f "$OUT/eval/heldout.json" ] || timed eval evaluate; }

case "${1:-all}" in
    sweep) sweep ;;
    sweep-eval) stage_sweep_eval ;;
    arms) arms ;;
    eval) stage_eval ;;
    record) record ;;
    all) sweep; stage_sweep_eval; arms; stage_eval; record ;;
    *) echo "unknown stage '$1': use sweep, sweep-eval, arms, eval or record" >&2; exit 2 ;;
esac
