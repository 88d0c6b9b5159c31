"""`exitspec train dflash | exit`: make rollouts of the target, then train a DFlash drafter on them.

exitspec train dflash --rollouts-only --gsm8k 2000 --sharegpt 2000     # target rollouts -> runs/rollouts
exitspec train dflash --steps 2000 --run-dir runs/dflash                # train (resumes runs/dflash if any)
torchrun --nproc_per_node 8 -m exitspec.train.dflash --steps 2000       # the same on 8 processes (DDP)
exitspec train exit --weight exit --lam 1 --budget 32                   # plus λ·L_exit on the drafter's own trees
torchrun --nproc_per_node 8 -m exitspec.cli train exit --steps 2000     # the exit loss on 8 processes
exitspec train eval --drafters dflash runs/exit/final --budgets 32 64    # held-out E[τ] = 1 + C_p, no decoding
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from itertools import islice
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from exitspec.bench.datasets import load_dataset
from exitspec.decode import encode_prompt
from exitspec.drafters import DFlashDrafter, drafter_folder
from exitspec.models import DEFAULT_MODEL, load_model_and_tokenizer
from exitspec.train import dist
from exitspec.train.acceptance import heldout_prompts, measure_acceptance
from exitspec.train.dflash_loss import DFlashObjective
from exitspec.train.exit_loss import WEIGHT_MODES
from exitspec.train.prompts import gsm8k_train, interleave, sharegpt
from exitspec.train.rollouts import GenerationSettings, load_rollouts, make_rollouts
from exitspec.train.trainer import RolloutData, TrainConfig, train


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring verbatim, and every option's default."""


def build_parser(command: str = "dflash") -> argparse.ArgumentParser:
    """The options of `exitspec train dflash`; `exit` adds the exit-loss group (dflash runs with the loss off)."""
    p = argparse.ArgumentParser(prog=f"exitspec train {command}", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--target", help=f"target HF causal-LM folder (default: {DEFAULT_MODEL})")
    p.add_argument("--device", help="default: cuda:LOCAL_RANK if CUDA is available, else cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="target dtype; bfloat16 also trains under bf16 autocast (auto: bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--rollouts", default="runs/rollouts", help="rollout folder")

    g = p.add_argument_group("rollouts")
    g.add_argument("--rollouts-only", action="store_true", help="make (or extend) the rollouts and exit")
    g.add_argument("--data-dir", type=Path, help="default: $EXITSPEC_DATA, else shared/data next to the repo")
    g.add_argument("--gsm8k", type=int, default=2000, help="GSM8K train prompts (-1: all 7473)")
    g.add_argument("--sharegpt", type=int, default=2000, help="ShareGPT first-turn prompts (-1: all)")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--gen-batch-size", type=int, default=16, help="prompts per generate call")
    g.add_argument("--shard-size", type=int, default=64, help="prompts per JSONL shard")

    t = p.add_argument_group("training")
    d = TrainConfig(rollouts="", run_dir="")
    t.add_argument("--run-dir", default=f"runs/{command}", help="checkpoints, log, final drafter")
    t.add_argument("--init", help="start from this drafter checkpoint folder instead of a fresh drafter")
    t.add_argument("--stop-at", type=int, help="stop at this step (with a checkpoint); a later run resumes")
    t.add_argument("--num-layers", type=int, default=d.num_layers, help="draft layers of a fresh drafter")
    t.add_argument("--block-size", type=int, default=d.block_size, help="block size of a fresh drafter")
    t.add_argument("--target-layers", type=lambda v: tuple(int(i) for i in v.split(",")),
                   help="context layers of a fresh drafter, e.g. 15,27 (default: the DFlash reference's choice)")
    t.add_argument("--context-window", type=int,
                   help="fresh drafter: blocks see only the last W context rows, in training and inference (default: all)")
    t.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    t.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per process and step")
    t.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence")
    t.add_argument("--max-len", type=int, default=d.max_len, help="cut sequences to this many tokens")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    t.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor / lr")
    t.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW, on matrices only")
    t.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm")
    t.add_argument("--gamma", type=float, default=d.gamma,
                   help="loss weight exp(-(k-1)/gamma) of block slot k; DFlash: 7 for block 16, 5 for 10, 4 for 8")
    t.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint interval in steps")
    t.add_argument("--log-every", type=int, default=d.log_every, help="log interval in steps")
    t.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept")
    if command != "exit":
        p.set_defaults(exit_weight=d.exit_weight, lam=d.lam, budget=d.budget, exclude_horizon_leaves=False)
        return p
    x = p.add_argument_group("exit loss: L_tok + λ·L_exit on the drafter's own DDTrees (exitspec.train.exit_loss)")
    x.add_argument("--weight", dest="exit_weight", choices=WEIGHT_MODES, default="exit",
                   help="node weights: exit w(v) = P(v)·rho(v); prefix P(v) rescaled to the tree's exit mass; none")
    x.add_argument("--lam", type=float, default=1.0, help="λ")
    x.add_argument("--budget", type=int, default=d.budget, help="DDTree budget B of the trees the target scores")
    x.add_argument("--exclude-horizon-leaves", action="store_true", help="drop the nodes at the block's last depth")
    return p


def main_dflash(argv: list[str] | None = None, command: str = "dflash") -> int:
    args = build_parser(command).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype
    if dtype == "auto":
        dtype = (
            "bfloat16"
            if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
            else "float32"
        )
    try:
        if args.rollouts_only:
            return run_rollouts(args, dtype)
        cfg = TrainConfig(
            **{f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name != "dtype"}, dtype=dtype
        )
        train(cfg, stop_at=args.stop_at, progress=not args.no_progress, device=args.device)
        return 0
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as e:
        print(f"exitspec train {command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        dist.teardown()


def main_exit(argv: list[str] | None = None) -> int:
    """`exitspec train exit`: `train dflash` plus the exit loss."""
    return main_dflash(argv, command="exit")


def build_eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="exitspec train eval", formatter_class=_HelpFormatter,
        description="Held-out acceptance of DFlash drafters, exact and without decoding (exitspec.train.acceptance): "
        "E[τ] = 1 + C_p of each drafter's DDTrees at anchors along the target's own responses to benchmark prompts.",
    )
    p.add_argument("--drafters", nargs="+", default=["dflash"], metavar="SPEC",
                   help="shipped drafters ('dflash', 'exittrain') or DFlash checkpoint folders")
    p.add_argument("--target", help=f"target HF causal-LM folder (default: {DEFAULT_MODEL})")
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mtbench"], metavar="NAME",
                   help="benchmark sets (exitspec.bench.datasets); their first turns are the held-out prompts")
    p.add_argument("--data-dir", type=Path, help="GSM8K/MATH-500 folder (default: $EXITSPEC_DATA, else shared/data)")
    p.add_argument("--num-prompts", type=int, default=20, help="the first N samples of each dataset")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's held-out responses")
    p.add_argument("--rollouts", default="runs/heldout", help="held-out responses, cached per dataset here")
    p.add_argument("--budgets", type=int, nargs="+", default=[32], help="DDTree budgets B")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="target warps")
    p.add_argument("--anchors", type=int, default=16, help="anchors per response")
    p.add_argument("--batch-size", type=int, default=1, help="responses per target forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main_eval(argv: list[str] | None = None) -> int:
    """`exitspec train eval`: a table of E[τ] per drafter, dataset, budget and temperature."""
    args = build_eval_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rows = run_eval(args)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as e:
        print(f"exitspec train eval: error: {e}", file=sys.stderr)
        return 1
    table = Table(title="Held-out E[τ] = 1 + C_p (± s.e.), and P(accept >= d) by depth d")
    for col in ("drafter", "dataset", "B", "T", "anchors", "E[τ]", "P(>=d), d = 1, 2, ..."):
        table.add_column(col, justify="left" if col in ("drafter", "dataset") else "right")
    for r in rows:
        table.add_row(
            r["drafter"], r["dataset"], str(r["budget"]), f"{r['temperature']:g}", str(r["trees"]),
            f"{r['tau']:.3f} ± {r['tau_stderr']:.3f}", " ".join(f"{x:.2f}" for x in r["reach_by_depth"][1:]),
        )
    Console(width=160).print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                       indent=1) + "\n")
    return 0


def run_eval(args) -> list[dict]:
    """Makes the held-out responses that are not cached yet, then measures every drafter on every dataset."""
    folders = [drafter_folder(spec) for spec in args.drafters]
    if None in folders:
        raise ValueError("held-out acceptance measures DFlash drafters; 'ngram' has no draft logits to build from")
    model, tokenizer = load_model_and_tokenizer(args.target, args.device, torch.float32)
    if tokenizer is None:
        raise ValueError("held-out prompts are text: the target folder needs a tokenizer")
    settings = GenerationSettings(
        model=str(Path(args.target).resolve()) if args.target else DEFAULT_MODEL,
        max_new_tokens=args.max_new_tokens, temperature=0.0, seed=args.seed,
    )
    data = {}
    for spec in args.datasets:
        name, samples = load_dataset(spec, args.data_dir)
        folder = Path(args.rollouts) / name
        prompts = heldout_prompts(samples, tokenizer, name, args.num_prompts)
        make_rollouts(model, prompts, folder, settings, *stop_and_pad(model, tokenizer), progress=not args.no_progress)
        wanted = {pid for pid, _ in prompts}
        data[name] = RolloutData([r for r in load_rollouts(folder) if r.id in wanted], max_len=1 << 20, seed=args.seed)
    rows = []
    for spec, folder in zip(args.drafters, folders, strict=True):
        drafter = DFlashDrafter.from_pretrained(folder, model)  # checked against the target
        objective = DFlashObjective(drafter.model, drafter.embed, drafter.lm_head)
        for name, sequences in data.items():
            results = measure_acceptance(
                objective, model, sequences, args.budgets, args.temperatures, args.anchors, args.batch_size,
                args.seed, progress=not args.no_progress,
            )
            rows += [{"drafter": spec, "dataset": name, **asdict(r)} for r in results]
    return rows


def run_rollouts(args, dtype: str) -> int:
    """Generates the rollouts not yet in args.rollouts (one process: the folder is not shared between ranks)."""
    if dist.setup(args.device).world > 1:
        raise ValueError("make rollouts with one process (python -m exitspec.train.dflash --rollouts-only ...)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model_and_tokenizer(args.target, device, getattr(torch, dtype))
    if tokenizer is None:
        raise ValueError("rollouts from text prompts need a tokenizer, and the target folder has none")
    sources = []
    if args.gsm8k:
        sources.append(encode(gsm8k_train(args.data_dir), tokenizer, args.gsm8k, args.max_prompt_tokens))
    if args.sharegpt:
        sources.append(encode(sharegpt(), tokenizer, args.sharegpt, args.max_prompt_tokens))
    settings = GenerationSettings(
        model=str(Path(args.target).resolve()) if args.target else DEFAULT_MODEL,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    prompts = interleave(*sources)
    n = make_rollouts(model, prompts, args.rollouts, settings, *stop_and_pad(model, tokenizer), args.gen_batch_size,
                      args.shard_size, progress=not args.no_progress)
    print(f"{n} new rollouts in {args.rollouts}")
    return 0


def stop_and_pad(model, tokenizer) -> tuple[list[int], int]:
    """The end-of-sequence ids that end a rollout, and the id that pads a batch."""
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def encode(prompts, tokenizer, limit: int, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(id, chat-template ids) of the first `limit` prompts (-1: all) of at most `max_tokens` tokens."""
    fitting = ((p.id, ids) for p in prompts if len(ids := encode_prompt(tokenizer, p.text)) <= max_tokens)
    return list(fitting if limit < 0 else islice(fitting, limit))
