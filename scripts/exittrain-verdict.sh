#!/usr/bin/env bash
# ExitTrain's verdict (issue 37): does the exit-weighted likelihood beat its matched token-only control?
#
# Both arms fine-tune the shipped `dflash` drafter from the same weights on the committed greedy rollouts
# (data/rollouts/smollm2-135m-instruct, never a benchmark prompt), with the same data order, anchors, steps,
# learning rate and schedule (the trainer seeds both from --seed); only the weight of the second loss term differs:
#   none   L_tok                     (λ = 0: the token-only control)
#   exit   L_tok + λ·L_exit, ω = w(v) (ExitTrain: the exit mass of each node of the drafter's own B = 32 DDTree)
# The held-out evaluation is exact and timing-free (`exitspec train eval`: E[τ] = 1 + C_p of the drafters'
# DDTrees at the same 16 anchors of the target's greedy answers to the first 30 prompts of GSM8K, MATH-500,
# HumanEval and MT-Bench), paired by prompt, at B = 32 and 64, T = 0 and 1.
#
#   bash scripts/exittrain-verdict.sh            # every stage in order; rerun it to resume after an interruption
#   bash scripts/exittrain-verdict.sh eval       # one stage: pilot | arms | eval | record
#
# pilot: the power statement before any training: the same evaluation (20 prompts a set) of `dflash-v1` (the
#        first drafter, no longer shipped: restored from git history into runs/) against `dflash`, paired by
#        prompt as the arms will be; two unrelated drafters differ prompt by prompt more than two fine-tunings
#        of one init, so its standard error bounds the arms' from above.
#        power.txt: the smallest relative change it detects, at 20 and at PROMPTS prompts a set.
# arms:  the two fine-tunings (each resumes from its newest checkpoint; a finished one is skipped).
# eval:  the init, the control and ExitTrain, paired (ExitTrain minus each), with the exit mass by depth.
# record: the runs' logs and summaries, and the held-out curves, into the record folder.
#
# Every stage that runs appends its wall-clock seconds to $OUT/times.tsv; a done stage is skipped. Checkpoints live in $RUNS (local, not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-data/exittrain-runs/verdict}
RUNS=${RUNS:-runs/exittrain-verdict}
STEPS=${STEPS:-800}  # 2 epochs of the 800 rollouts at batch 2 (chosen from the measured step times: README)
LAM=${LAM:-32}       # λ = B: the exit term at about a third of the token loss (issue 4's choice, docs/training.md)
THREADS=${THREADS:-2}
INIT=exitspec/assets/dflash-smollm2-135m-instruct
PILOT_PROMPTS=${PILOT_PROMPTS:-20}  # per set, for the power statement
PROMPTS=${PROMPTS:-30}              # per set, for the verdict (chosen from the pilot: README)
EVAL=(--budgets 32 64 --temperatures 0 1 --anchors 16 --heldout runs/heldout --threads "$THREADS" --no-progress)
TRAIN=(--init "$INIT" --rollouts data/rollouts/smollm2-135m-instruct --budget 32 --steps "$STEPS" --batch-size 2
       --anchors 16 --gamma 4 --lr 3e-4 --warmup 10 --save-every 50 --log-every 10 --eval-every 100
       --eval-dir runs/heldout --threads "$THREADS" --no-progress)
mkdir -p "$OUT"

source scripts/timed.sh

V1=runs/dflash-v1
pilot() {
    mkdir -p "$OUT/pilot" "$V1"
    for f in config.json model.safetensors; do
        [ -s "$V1/$f" ] || git show "b11d43d:exitspec/assets/dflash-v1-smollm2-135m-instruct/$f" > "$V1/$f"
    done
    exitspec train eval --drafters "$V1" dflash "${EVAL[@]}" --num-prompts "$PILOT_PROMPTS" \
        --out "$OUT/pilot/heldout.json" > "$OUT/pilot/heldout.txt"
}

power() {  # the pilot's smallest detectable change, at its prompts and at the verdict's
    python - "$OUT/pilot/heldout.json" "$PROMPTS" > "$OUT/pilot/power.txt" <<'EOF'
import json, sys
from exitspec.paired import detectable_with
from exitspec.train.eval_report import ALL, paired_rows
per_set = int(sys.argv[2])
print("smallest relative E[τ] change detected (paired, 5% two-sided, 80% power), all four sets pooled")
for p in paired_rows(json.load(open(sys.argv[1]))["rows"]):
    if p["dataset"] == ALL:
        wanted = detectable_with(p, 4 * per_set)
        print(f"B = {p['budget']}, T = {p['temperature']:g}: s.e. {p['stderr']:.4f} -> {100 * p['detectable']:.2f}% "
              f"at {p['pairs']} prompts; {100 * wanted:.2f}% at {4 * per_set} prompts")
EOF
}

arm() {  # arm NAME WEIGHT LAM: one fine-tuning, resumed from its newest checkpoint if it has one
    exitspec train exit --weight "$2" --lam "$3" --run-dir "$RUNS/$1" "${TRAIN[@]}" >> "$OUT/$1.log" 2>&1
}

arms() {  # a finished arm is skipped
    [ -f "$RUNS/none/final/model.safetensors" ] || timed none arm none none 0
    [ -f "$RUNS/exit/final/model.safetensors" ] || timed exit arm exit exit "$LAM"
}

evaluate() {
    exitspec train eval --drafters dflash "$RUNS/none/final" "$RUNS/exit/final" "${EVAL[@]}" --num-prompts "$PROMPTS" \
        --out "$OUT/heldout.json" --plot "$OUT/exit-by-depth.png" > "$OUT/heldout.txt"
}

record() {
    for name in none exit; do
        mkdir -p "$OUT/$name"
        cp "$RUNS/$name/log.jsonl" "$RUNS/$name/summary.json" "$OUT/$name/"
    done
    exitspec train curve "$RUNS/none" "$RUNS/exit" --out "$OUT/curve.png" > "$OUT/curve.txt"
}

stage_pilot() { [ -f "$OUT/pilot/heldout.json" ] || timed pilot pilot; power; }
stage_eval() { [ -f "$OUT/heldout.json" ] || timed eval evaluate; }

case "${1:-all}" in
    pilot) stage_pilot ;;
    arms) arms ;;
    eval) stage_eval ;;
    record) record ;;
    all) stage_pilot; arms; stage_eval; record ;;
    *) echo "unknown stage '$1': use pilot, arms, eval or record" >&2; exit 2 ;;
esac
