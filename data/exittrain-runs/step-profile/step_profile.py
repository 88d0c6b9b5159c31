"""Where an ExitTrain step's time goes (issue 37, item 1), at the controls' settings (scripts/exittrain-controls.sh:
batch 2, 16 anchors, B = 32, γ 4, exit weight, λ 32), from the shipped `dflash` drafter on the committed
rollouts, 2 threads. The trainer's own `_start` and `_step` run; the step's parts are timed by wrapping the
functions it calls (this script only), each part's seconds summed over STEPS steps after WARMUP.

    python step_profile.py --out exit.json [--steps 5] [--warmup 2] [--weight exit|none]
"""

import argparse
import json
import tempfile
import time
from collections import defaultdict

import torch

import exitspec
from exitspec.drafters import SHIPPED
from exitspec.settings import cpu_name
from exitspec.train import dflash_loss, exit_loss, trainer
from exitspec.train.config import TrainConfig

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--weight", default="exit")
parser.add_argument("--out", required=True)
args = parser.parse_args()
exitspec.setup_cpu()
torch.set_num_threads(2)
seconds: dict[str, float] = defaultdict(float)


def timed(module, name: str, part: str) -> None:
    """Replaces module.name by a wrapper that adds its wall-clock seconds to seconds[part]."""
    inner = getattr(module, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        out = inner(*a, **k)
        seconds[part] += time.perf_counter() - start
        return out

    setattr(module, name, wrapper)


timed(trainer, "target_features", "target features (forward over the batch)")
timed(trainer, "features_and_cache", "target features (forward over the batch)")
timed(trainer, "sample_anchors", "anchors")
timed(exit_loss, "build_anchor_trees", "tree building (DDTree per anchor)")
timed(exit_loss, "evaluate_trees", "tree evaluation (one target forward over the trees after the cached context, warped)")
timed(exit_loss, "exit_loss", "exit loss (flow, weights, likelihood)")
timed(dflash_loss.DFlashObjective, "__call__", "drafter forward + block loss")
with tempfile.TemporaryDirectory() as run_dir:
    cfg = TrainConfig(
        rollouts="data/rollouts/smollm2-135m-instruct", run_dir=run_dir, init=str(SHIPPED["dflash"]),
        steps=args.warmup + args.steps, batch_size=2, anchors=16, gamma=4.0, lr=3e-4, warmup=10, save_every=10_000,
        log_every=10_000, eval_every=0, exit_weight=args.weight, lam=32.0 if args.weight != "none" else 0.0,
        budget=32,
    )
    run = trainer._start(cfg, progress=False, device="cpu")
    steps = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            seconds.clear()
        start = time.perf_counter()
        trainer._step(run)
        if i >= args.warmup:
            steps.append(time.perf_counter() - start)
total = sum(steps)
parts = {part: s / args.steps for part, s in seconds.items()}
parts["backward, optimizer and the rest"] = total / args.steps - sum(parts.values())
record = {"settings": vars(args), "cpu": cpu_name(),
          "step_seconds": total / args.steps, "steps": steps, "parts_seconds": parts}
with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
