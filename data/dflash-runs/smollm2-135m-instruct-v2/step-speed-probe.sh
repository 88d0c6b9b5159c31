#!/bin/bash
# training step speed probes (rollouts paused meanwhile)
PID=$(pgrep -f "rollouts-only" | head -1)
kill -STOP $PID
common="--rollouts runs/probe-rollouts --target-layers 2,15,27 --block-size 8 --gamma 4 --batch-size 4 --anchors 64 --steps 8 --log-every 4 --save-every 100 --threads 2 --no-progress --context-window 128"
run() { name=$1; shift; rm -rf runs/probe-$name; /usr/bin/time -f "$name wall %e s" exitspec train dflash $common --run-dir runs/probe-$name "$@" > runs/probe-$name.out 2>&1; echo "$name $(tail -1 runs/probe-$name/log.jsonl | python -c 'import json,sys; d=json.loads(sys.stdin.read()); print("tok/s", round(d["tok_per_s"],1))')"; }
run target-full
run cache-full --features runs/probe-features
run cache-v16k --features runs/probe-features --draft-vocab 16384
run cache-v8k --features runs/probe-features --draft-vocab 8192
run cache-v16k-kl --features runs/probe-features --draft-vocab 16384 --loss kl
run cache-v16k-2l --features runs/probe-features --draft-vocab 16384 --num-layers 2
kill -CONT $PID
