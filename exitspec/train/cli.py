"""`exitspec train dflash | exit | lookup | eval`: make rollouts of the target, train a DFlash drafter on them,
count their n-grams into a corpus-lookup table, measure held-out acceptance.

exitspec train dflash --rollouts-only --gsm8k 2000 --sharegpt 2000     # target rollouts -> runs/rollouts
exitspec train dflash --steps 2000 --run-dir runs/dflash                # train (resumes runs/dflash if any)
torchrun --nproc_per_node 8 -m exitspec train dflash --steps 2000       # the same on 8 processes (DDP)
exitspec train exit --weight exit --lam 1 --budget 32                   # plus λ·L_exit on the drafter's own trees
torchrun --nproc_per_node 8 -m exitspec train exit --steps 2000         # the exit loss on 8 processes
exitspec train eval --drafters dflash runs/exit/final --budgets 32 64    # held-out E[τ] = 1 + C_p, no decoding
exitspec train lookup --rollouts runs/rollouts --out runs/dflash/final/lookup.safetensors  # corpus lookup
exitspec train lookup --rollouts runs/rollouts --out lookup.safetensors --memory  # and seed the suffix memory
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import torch
from rich.console import Console
from rich.table import Table

from exitspec.app import free_memory, load_decoders
from exitspec.drafters import NgramTable, drafter_folder, split_chain
from exitspec.drafters.chain import drafter_label
from exitspec.drafters.suffix import SuffixMemory, tokenizer_digest
from exitspec.models import load_model_and_tokenizer, model_config, model_name, resolve_device, resolve_dtype
from exitspec.paired import paired_cell
from exitspec.train import dist
from exitspec.train.acceptance import measure_acceptance
from exitspec.train.config import TrainConfig
from exitspec.train.dflash_loss import DFlashObjective
from exitspec.train.eval_report import exit_rows, paired_rows, plot_exits
from exitspec.train.features import cache_features
from exitspec.train.heldout import make_heldout
from exitspec.train.online import training_prompts
from exitspec.train.rollouts import (
    GenerationSettings,
    RolloutData,
    load_rollouts,
    make_rollouts,
    stop_and_pad,
    summarize_rollouts,
)
from exitspec.train.trainer import make_drafter, train
from exitspec.warm import memory_path


def training_dtype(name: str, device: torch.device) -> str:
    """The target's dtype in training and its evaluation: "auto" is fp32 on a CPU (the rollouts and features the
    shipped drafters were trained on), resolve_dtype's choice elsewhere."""
    if name == "auto" and device.type == "cpu":
        return "float32"
    return str(resolve_dtype(name, device)).removeprefix("torch.")


def run_train(args) -> int:
    """`exitspec train dflash | exit`: rollouts (--rollouts-only), or training that resumes its run folder."""
    device = resolve_device(args.device)
    dtype = training_dtype(args.dtype, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.rollouts_only:
            return run_rollouts(args, dtype)
        if args.features_only:
            return run_features(args, dtype)
        check_training_memory(args.model, args.batch_size, args.anchors, args.block_size, args.draft_vocab, device)
        train(train_config(args, dtype), stop_at=args.stop_at, progress=not args.no_progress, device=args.device)
        return 0
    finally:
        dist.teardown()


def check_training_memory(model, batch_size: int, anchors: int, block_size: int, draft_vocab: int, device) -> None:
    """Raises ValueError when a step's largest tensors cannot fit: the draft logits and their gradient,
    2 · batch·anchors·block·V fp32 (V: the draft vocabulary), must fit in half the free memory of the device."""
    vocab = draft_vocab or model_config(model).vocab_size
    need, free = 2 * 4 * batch_size * anchors * block_size * vocab, free_memory(device)
    if need > free / 2:
        raise ValueError(f"--batch-size {batch_size} × --anchors {anchors} × block {block_size} needs about "
                         f"{need / 2**30:.1f} GiB of draft logits per step, over half of the {free / 2**30:.1f} GiB "
                         "free here; lower one of them")


def run_lookup(args) -> int:
    """`exitspec train lookup`: the n-gram table of every response in a rollout folder (drafters/lookup.py),
    each counted after its prompt's last tokens, written atomically."""
    rollouts = load_rollouts(args.rollouts)
    sequences = (r.prompt_ids[-args.orders :] + r.response_ids for r in rollouts)
    table = NgramTable.from_sequences(
        sequences, model_config(args.model).vocab_size, args.orders, args.width, args.min_count
    )
    table.save(args.out)
    tokens = sum(len(r.response_ids) for r in rollouts)
    print(f"wrote {args.out}: {len(table)} contexts of 1-{args.orders} tokens from {len(rollouts)} "
          f"responses ({tokens} tokens)")
    if args.memory:
        seed_memory(args.model, [r.response_ids for r in rollouts])
    return 0


def seed_memory(model, responses: list[list[int]]) -> None:
    """Adds `responses` to the target's suffix memory in exitspec's cache (warm.py), where decoding's suffix trees
    find them; the memory keeps its bound, so only the newest answers stay if there are more."""
    hf_model, tokenizer = load_model_and_tokenizer(model)
    memory = SuffixMemory(hf_model.get_output_embeddings().weight.shape[0])
    path, digest = memory_path(hf_model.config), tokenizer_digest(tokenizer)
    if path.is_file():
        memory.restore(path, digest)
    for response in responses:
        memory.add(response)
    memory.save(path, digest)
    print(f"wrote {path}: the suffix memory holds {len(memory.answers)} answers ({memory.stored} tokens)")


def run_eval_command(args) -> int:
    """`exitspec train eval`: a table of E[τ] per drafter, dataset, budget and temperature; with several
    drafters, the last one paired with each other one by prompt, and where the target leaves each one's trees."""
    rows = run_eval(args)
    console = Console(width=160)
    table = Table(title="Held-out E[τ] = 1 + C_p (± s.e.), and P(accept >= d) by depth d")
    for col in ("drafter", "dataset", "B", "T", "anchors", "E[τ]", "P(>=d), d = 1, 2, ..."):
        table.add_column(col, justify="left" if col in ("drafter", "dataset") else "right")
    for r in rows:
        table.add_row(
            r["drafter"], r["dataset"], str(r["budget"]), f"{r['temperature']:g}", str(r["trees"]),
            f"{r['tau']:.3f} ± {r['tau_stderr']:.3f}", " ".join(f"{x:.2f}" for x in r["reach_by_depth"][1:]),
        )
    console.print(table)
    paired, exits = paired_rows(rows), exit_rows(rows)
    if paired:
        table = Table(title=f"Paired by prompt: {drafter_label(paired[0]['candidate'])} minus each other drafter, "
                            "E[τ] difference ± s.e. [95% bootstrap interval], relative change [interval], and the "
                            "smallest relative change detected (5% two-sided, 80% power)")
        for col in ("minus", "dataset", "B", "T", "prompts", "difference", "relative", "detects"):
            table.add_column(col, justify="left" if col in ("minus", "dataset") else "right")
        for p in paired:
            relative = f"{100 * p['relative']:+.1f}%"
            if p["relative_ci95"] is not None:
                relative += " [{:+.1f}%, {:+.1f}%]".format(*(100 * x for x in p["relative_ci95"]))
            detects = "-" if p["detectable"] is None else f"{100 * p['detectable']:.1f}%"
            table.add_row(drafter_label(p["other"]), p["dataset"], str(p["budget"]), f"{p['temperature']:g}",
                          str(p["pairs"]), paired_cell(p), relative, detects)
        console.print(table)
    table = Table(title="Where the target leaves the tree: mean exit mass w by depth, all datasets (depth 0: root)")
    for col in ("drafter", "B", "T", "E[τ]", "w at depth 0, 1, 2, ..."):
        table.add_column(col, justify="left" if col == "drafter" else "right")
    for e in exits:
        table.add_row(drafter_label(e["drafter"]), str(e["budget"]), f"{e['temperature']:g}", f"{e['tau']:.3f}",
                      " ".join(f"{x:.3f}" for x in e["exit_by_depth"]))
    console.print(table)
    if args.plot:
        plot_exits(exits, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items() if k != "run"},
                                        "rows": rows, "paired": paired, "exit_by_depth": exits}, indent=1) + "\n")
    return 0


def run_eval(args) -> list[dict]:
    """Makes the held-out responses that are not cached yet, then measures every drafter on every dataset."""
    if any(drafter_folder(spec) is None or split_chain(spec)[1] for spec in args.drafters):
        raise ValueError("held-out acceptance measures DFlash drafters; 'ngram' and chains have no draft logits to "
                         "build from")
    dtype = training_dtype(args.dtype, resolve_device(args.device))
    decoders = load_decoders(args.model, args.drafters, args.device, dtype, args.threads, budgets=(),
                             warm_start=not args.no_warm_start, learn=False)
    model, tokenizer = next(iter(decoders.values())).target.model, next(iter(decoders.values())).target.tokenizer
    heldout = make_heldout(model, tokenizer, model_name(args.model), args.datasets, args.heldout, args.num_prompts,
                           args.max_new_tokens, args.data_dir, progress=not args.no_progress)
    data = {name: RolloutData(rollouts, max_len=1 << 20, seed=args.seed) for name, rollouts in heldout.items()}
    rows = []
    for spec, decoder in decoders.items():
        drafter = decoder.drafter  # a DFlashDrafter, checked against the target when it loaded
        objective = DFlashObjective(drafter.model, drafter.embed, drafter.lm_head)
        for name, sequences in data.items():
            results = measure_acceptance(
                objective, model, sequences, args.budgets, args.temperatures, args.anchors, args.batch_size,
                args.seed, progress=not args.no_progress,
            )
            rows += [{"drafter": spec, "dataset": name, **asdict(r)} for r in results]
    return rows


def run_features(args, dtype: str) -> int:
    """Caches the target's features of every rollout not yet in --features (one process)."""
    if not args.features:
        raise ValueError("--features-only needs --features DIR, the cache folder")
    if dist.setup(args.device).world > 1:
        raise ValueError("make the feature cache with one process")
    model, _ = load_model_and_tokenizer(args.model, resolve_device(args.device), getattr(torch, dtype))
    layer_ids = make_drafter(train_config(args, dtype), model).config.target_layer_ids  # the run's context layers
    rollouts = load_rollouts(args.rollouts)
    n = cache_features(model, rollouts, args.features, layer_ids, model_name(args.model),
                       getattr(torch, args.features_dtype), args.topk, progress=not args.no_progress)
    print(f"{n} rollouts' features added to {args.features} (layers {list(layer_ids)}, {args.features_dtype})")
    return 0


def train_config(args, dtype: str) -> TrainConfig:
    """The TrainConfig of a parsed `train dflash | exit` command line."""
    names = {f.name for f in fields(TrainConfig)} - {"dtype", "target", "data_dir"}
    data_dir = None if args.data_dir is None else str(args.data_dir)
    return TrainConfig(**{k: getattr(args, k) for k in names}, target=args.model, dtype=dtype, data_dir=data_dir)


def run_rollouts(args, dtype: str) -> int:
    """Generates the rollouts not yet in args.rollouts (one process: the folder is not shared between ranks)."""
    if dist.setup(args.device).world > 1:
        raise ValueError("make rollouts with one process (exitspec train dflash --rollouts-only ...)")
    model, tokenizer = load_model_and_tokenizer(args.model, resolve_device(args.device), getattr(torch, dtype))
    if tokenizer is None:
        raise ValueError("rollouts from text prompts need a tokenizer, and the target folder has none")
    prompts = training_prompts(tokenizer, args.gsm8k, args.sharegpt, args.code, args.skip_prompts,
                               args.max_prompt_tokens, args.data_dir)
    settings = GenerationSettings(
        model=model_name(args.model),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        loop_repeats=args.loop_repeats,
    )
    n = make_rollouts(model, prompts, args.rollouts, settings, *stop_and_pad(model, tokenizer), args.gen_batch_size,
                      args.shard_size, progress=not args.no_progress)
    total = summarize_rollouts(args.rollouts)
    print(f"{n} new rollouts in {args.rollouts}; in all {total['rollouts']} rollouts, {total['response_tokens']} "
          f"response tokens, {total['looped']} stopped in a repetition loop (cutting at most "
          f"{total['loop_tokens_cut']} loop tokens)")
    return 0
