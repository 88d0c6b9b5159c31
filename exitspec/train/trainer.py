"""Training loop for the DFlash drafter: AdamW, warmup + cosine, grad clipping, DDP, exact resume.

One step: a batch of rollout sequences per process -> target features (one frozen causal forward) -> random
anchors -> block loss (dflash_loss) -> backward -> clip -> AdamW. Under torchrun every process takes its own
slice of the global batch and DDP averages the gradients, so the replicas stay identical.

A run folder holds

    checkpoints/step-*/   see checkpoint.py; the newest one is resumed automatically
    log.jsonl             one line of metrics per log interval
    final/                the trained drafter (DFlashModel.save_pretrained), when the last step is done
    summary.json          the final metrics
    online/chunk-*/       with --online: the rollouts the target made as training reached them (online.py)

Resuming is exact: weights, AdamW state, RNG states and the data position come back, so a run stopped at step
k and resumed ends bit-for-bit where an uninterrupted run does.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from exitspec.drafters.dflash_model import DFlashModel
from exitspec.drafters.vocab import frequent_tokens
from exitspec.models import load_model_and_tokenizer, model_name
from exitspec.train import dist
from exitspec.train.checkpoint import latest_checkpoint, load_checkpoint, read_state, save_checkpoint
from exitspec.train.config import EXIT_FIELDS, ExitConfig, TrainConfig
from exitspec.train.dflash_loss import (
    BlockLoss,
    DFlashObjective,
    features_and_cache,
    real_tokens,
    sample_anchors,
    target_features,
)
from exitspec.train.exit_loss import ExitLoss, TrainLoss, train_loss
from exitspec.train.features import FeatureStore
from exitspec.train.heldout import HELDOUT_TOKENS, GreedyCheck, make_heldout
from exitspec.train.online import OnlineData, training_prompts
from exitspec.train.rollouts import GenerationSettings, RolloutData, end_tokens, load_rollouts

BETAS = (0.9, 0.95)
# config fields a resumed run may change (the data itself is checked by its size)
RESUMABLE_CHANGES = {"run_dir", "rollouts", "steps", "save_every", "log_every", "keep", "init", "features",
                     "eval_every", "eval_dir", "eval_datasets", "eval_prompts", "data_dir", "gen_batch_size"}
# the prompt stream's fields: free to change unless the run trains online
ONLINE_FIELDS = {"online_temperatures", "gsm8k", "sharegpt", "code", "skip_prompts", "max_prompt_tokens",
                 "max_new_tokens", "loop_repeats"}


@dataclass
class TrainResult:
    drafter: DFlashModel  # the trained drafter (unwrapped), on the training device
    summary: dict


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr down to min_lr_ratio × lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    floor = cfg.lr * cfg.min_lr_ratio
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return floor + 0.5 * (1 + math.cos(math.pi * t)) * (cfg.lr - floor)


class Window:
    """Metric sums over the steps since the last log line, by name, kept on the device (no sync per step)."""

    def __init__(self, block_size: int, device: torch.device):
        self.k = block_size - 1
        sizes = {"weighted_ce": 1, "weight": 1, "tokens": 1, "grad_norm": 1, "correct_k": self.k, "counted_k": self.k,
                 "exit_loss": 1, "coverage": 1, "trees": 1}
        self.sums = {name: torch.zeros(n, dtype=torch.float64, device=device) for name, n in sizes.items()}
        self.steps, self.start = 0, time.perf_counter()

    def add(self, out: BlockLoss, tokens: int, grad_norm: Tensor) -> None:
        w, s = out.weights.detach(), self.sums
        s["weighted_ce"] += (out.ce.detach() * w).sum()
        s["weight"] += w.sum()
        s["tokens"] += tokens
        s["grad_norm"] += grad_norm.detach().double()
        s["correct_k"] += out.correct.sum(dim=(0, 1))
        s["counted_k"] += (w > 0).sum(dim=(0, 1))
        self.steps += 1

    def add_exit(self, out: ExitLoss) -> None:
        self.sums["exit_loss"] += out.loss.detach()
        self.sums["coverage"] += out.coverage.sum()
        self.sums["trees"] += (out.nodes > 0).sum()

    def reduce(self, world: int) -> dict:
        """Collective: the window's metrics over all processes."""
        flat = dist.all_reduce_sum(torch.cat(list(self.sums.values())))  # one all-reduce for every sum
        s = {name: part.tolist() for name, part in zip(self.sums, flat.split([t.numel() for t in self.sums.values()]))}
        seconds = time.perf_counter() - self.start
        (tokens,), (trees,) = s["tokens"], s["trees"]
        acc = [c / max(n, 1) for c, n in zip(s["correct_k"], s["counted_k"], strict=True)]
        exit_metrics = {"exit_loss": s["exit_loss"][0] / (self.steps * world), "coverage": s["coverage"][0] / trees
                        } if trees else {}
        return {
            **exit_metrics,
            "loss": s["weighted_ce"][0] / max(s["weight"][0], 1e-12),
            "acc": sum(s["correct_k"]) / max(sum(s["counted_k"]), 1),
            "acc_k": [round(a, 5) for a in acc],
            "grad_norm": s["grad_norm"][0] / (self.steps * world),
            "tokens": int(tokens),
            "tok_per_s": tokens / seconds,
        }


@dataclass
class _Session:
    """What a training run holds between steps: the frozen target, the drafter and its optimizer, the data stream
    and where in it the run is, the objective (DDP-wrapped under torchrun), and the optional feature cache,
    held-out check and log."""

    cfg: TrainConfig
    d: dist.Dist
    target: torch.nn.Module
    drafter: DFlashModel
    optimizer: torch.optim.AdamW
    data: RolloutData | OnlineData
    objective: DFlashObjective
    model: torch.nn.Module  # the objective, or its DDP wrapper
    anchor_gen: torch.Generator
    store: FeatureStore | None = None
    check: GreedyCheck | None = None
    log: object = None
    resumed: Path | None = None
    step: int = 0
    position: int = 0


def train(
    cfg: TrainConfig, stop_at: int | None = None, progress: bool = True, device: str | None = None
) -> TrainResult:
    """Trains (or resumes) the run in cfg.run_dir up to cfg.steps, or stops at step `stop_at` with a checkpoint.

    Runs as one process, or as one of several under torchrun (DDP: nccl on GPUs, gloo on CPUs)."""
    run = _start(cfg, progress, device)
    end = min(cfg.steps, stop_at if stop_at is not None else cfg.steps)
    started, last = run.step, None
    bar = tqdm(total=cfg.steps, initial=run.step, desc="train dflash", unit="step",
               disable=not (progress and run.d.main))
    window = Window(run.drafter.block_size, run.d.device)
    while run.step < end:
        lr, out, tokens, grad_norm = _step(run)
        window.add(out.block, tokens, grad_norm)
        if out.exit is not None:
            window.add_exit(out.exit)
        bar.update(1)
        if run.step % cfg.log_every == 0 or run.step == end:
            last = {"step": run.step, "epoch": round(run.position / len(run.data), 4), "lr": lr,
                    **window.reduce(run.d.world)}
            window = Window(run.drafter.block_size, run.d.device)
            _log(run, last)
            bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['acc']:.3f}", tok_s=f"{last['tok_per_s']:.0f}")
        if run.check is not None and (run.step % cfg.eval_every == 0 or run.step == end):
            _log(run, {"step": run.step, "epoch": round(run.position / len(run.data), 4),
                       "heldout": run.check(run.objective)})
        if run.step % cfg.save_every == 0 or run.step == end:
            state = {"step": run.step, "data": {"position": run.position, "sequences": len(run.data)},
                     "config": asdict(cfg)}
            save_checkpoint(Path(cfg.run_dir) / "checkpoints", run.step, run.drafter, run.optimizer, state,
                            run.anchor_gen, run.d, cfg.keep)
    bar.close()
    return _finish(run, started, last)


def _start(cfg: TrainConfig, progress: bool, device: str | None) -> _Session:
    """Loads the target, makes the drafter, optimizer and data, then resumes the latest checkpoint (or scales a
    fresh drafter's fc to the first batch's features) and opens the log."""
    d = dist.setup(device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_model_and_tokenizer(cfg.target, d.device, getattr(torch, cfg.dtype))
    drafter = make_drafter(cfg, target).to(d.device).train()
    data = make_data(cfg, target, tokenizer, d, progress)
    if cfg.draft_vocab:
        apply_draft_vocab(drafter, cfg.draft_vocab, data, target)
    objective = DFlashObjective(
        drafter, target.get_input_embeddings(), target.get_output_embeddings(), cfg.gamma, cfg.loss
    )
    # DDP averages the drafter's gradients; its one buffer, the draft vocabulary, is the same everywhere
    model = objective if d.world == 1 else DistributedDataParallel(
        objective, device_ids=[d.device] if d.device.type == "cuda" else None, broadcast_buffers=False
    )
    run = _Session(cfg, d, target, drafter, make_optimizer(drafter, cfg), data, objective, model,
                   torch.Generator().manual_seed(cfg.seed * 65_536 + d.rank + 1))
    if cfg.features:  # the target's features read from the cache: the steps skip the target forward
        run.store = FeatureStore(cfg.features, drafter.config.target_layer_ids, model_name(cfg.target))
        run.store.check_covers(data.keys)
    _resume(run)
    if cfg.eval_every and d.main:  # the held-out greedy check, logged every eval_every steps (heldout.py)
        heldout = make_heldout(target, tokenizer, model_name(cfg.target), cfg.eval_datasets, cfg.eval_dir,
                               cfg.eval_prompts, HELDOUT_TOKENS, cfg.data_dir, progress=progress)
        run.check = GreedyCheck(target, heldout, drafter.config.target_layer_ids, seed=cfg.seed)
    if d.main:
        run.log = _open_log(Path(cfg.run_dir) / "log.jsonl", run.step)
        where = f"resuming {run.resumed} at step {run.step}" if run.resumed else "starting"
        what = (f"{len(data)} prompts answered online, {cfg.online} at a time" if cfg.online
                else f"{len(data)} sequences ({data.dropped} too short dropped)")
        tqdm.write(
            f"{where}: {what}, drafter "
            f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, {d.world} process(es) on {d.device}"
        )
    return run


def _resume(run: _Session) -> None:
    """Restores the latest checkpoint of the run folder; without one, a fresh drafter's fc is scaled to the
    features of the first batch (the same on every rank)."""
    cfg, d = run.cfg, run.d
    run.resumed = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
    if run.resumed is not None:
        # before weights of another shape fail
        _check_resumable(read_state(run.resumed), cfg, len(run.data), run.resumed)
        state = load_checkpoint(run.resumed, run.drafter, run.optimizer, run.anchor_gen, d)
        run.step, run.position = state["step"], state["data"]["position"]
    elif not cfg.init:
        ids, _, lengths = run.data.batch(0, 0, cfg.batch_size)
        ids, lengths = ids.to(d.device), lengths.to(d.device)
        features = target_features(run.target, ids, lengths, run.drafter.config.target_layer_ids)  # [B, L, F]
        real = real_tokens(ids, lengths)  # [B, L]
        real[:, 0] = False  # the first token is an attention sink with a huge norm
        run.drafter.rescale_fc(features[real])


def _step(run: _Session) -> tuple[float, TrainLoss, int, Tensor]:
    """One optimizer step on the next batch: (learning rate, the loss's parts, tokens seen, gradient norm)."""
    cfg, d = run.cfg, run.d
    ids, starts, lengths = run.data.batch(run.position, d.rank, cfg.batch_size)
    anchors, keep = sample_anchors(starts, lengths, cfg.anchors, run.anchor_gen)
    ids, lengths, anchors, keep = (t.to(d.device) for t in (ids, lengths, anchors, keep))
    soft, cache, layer_ids = None, None, run.drafter.config.target_layer_ids
    if run.store is None and cfg.exit_config().active:  # the exit loss's tree forward reuses the context's cache
        features, cache = features_and_cache(run.target, ids, lengths, layer_ids)  # [B, L, F], L positions
    elif run.store is None:
        features = target_features(run.target, ids, lengths, layer_ids)  # [B, L, F]
    else:
        keys = run.data.keys_at(run.position, d.rank, cfg.batch_size)
        features = run.store.batch(keys, lengths, d.device, run.target.dtype)  # [B, L, F]
        soft = run.store.soft_targets(keys, lengths, d.device) if cfg.loss != "ce" else None  # [B, L, k] x 2
    lr = lr_at(run.step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        out = train_loss(run.model, run.target, ids, features, lengths, anchors, keep, cfg.exit_config(), soft,
                         cache)
    run.optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.grad_clip)
    run.optimizer.step()
    run.step, run.position = run.step + 1, run.position + d.world * cfg.batch_size
    return lr, out, int(lengths.sum()), grad_norm


def _log(run: _Session, record: dict) -> None:
    """One line of log.jsonl (the main process only)."""
    if run.log is not None:
        run.log.write(json.dumps(record) + "\n")
        run.log.flush()


def _finish(run: _Session, started: int, last: dict | None) -> TrainResult:
    """Closes the log; a run that reached cfg.steps saves the drafter as run_dir/final with a summary."""
    run_dir = Path(run.cfg.run_dir)
    summary = {"step": run.step, "steps": run.cfg.steps, "steps_this_run": run.step - started, "last_window": last}
    if run.d.main:
        run.log.close()
        if run.step == run.cfg.steps and run.step > started:
            run.drafter.save_pretrained(run_dir / "final")
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print_summary(summary, run_dir)
    dist.barrier()
    return TrainResult(run.drafter, summary)


def make_data(cfg: TrainConfig, target, tokenizer, d: dist.Dist, progress: bool) -> RolloutData | OnlineData:
    """The training stream: the rollout folder, or (cfg.online) the target's answers as training reaches them."""
    if not cfg.online:
        return RolloutData(load_rollouts(cfg.rollouts), cfg.max_len, cfg.seed, step_size=d.world * cfg.batch_size)
    if tokenizer is None:
        raise ValueError("--online answers text prompts, so the target folder needs a tokenizer, and it has none")
    prompts = training_prompts(tokenizer, cfg.gsm8k, cfg.sharegpt, cfg.code, cfg.skip_prompts, cfg.max_prompt_tokens,
                               cfg.data_dir)
    settings = GenerationSettings(model_name(cfg.target), cfg.max_new_tokens, 0.0, cfg.seed, cfg.loop_repeats)
    return OnlineData(target, tokenizer, prompts, Path(cfg.run_dir) / "online", settings, cfg.online_temperatures,
                      cfg.online, cfg.max_len, cfg.seed, cfg.gen_batch_size, d, cfg.batch_size, progress and d.main)


def make_drafter(cfg: TrainConfig, target) -> DFlashModel:
    """A fresh drafter for the target, or the --init checkpoint, checked against the target either way."""
    tc = target.config.get_text_config()
    if cfg.init:
        drafter = DFlashModel.from_pretrained(cfg.init, dtype=torch.float32)
    else:
        drafter = DFlashModel.for_target(
            tc, num_layers=cfg.num_layers, block_size=cfg.block_size, target_layer_ids=cfg.target_layers,
            context_window=cfg.context_window,
        )
    vocab = target.get_output_embeddings().weight.shape[0]
    drafter.config.check_target(tc.hidden_size, vocab, tc.num_hidden_layers)
    return drafter


def apply_draft_vocab(drafter: DFlashModel, size: int, data: RolloutData | OnlineData, target) -> None:
    """Gives a drafter without a draft vocabulary the `size` tokens most frequent in the training sequences
    (vocab.frequent_tokens); a drafter that has one (from --init) must have this size."""
    if drafter.draft_vocab is not None:
        if drafter.draft_vocab.numel() != size:
            raise ValueError(f"the --init drafter has a draft vocabulary of {drafter.draft_vocab.numel()} tokens, "
                             f"not --draft-vocab {size}")
        return
    eos = end_tokens(target)
    responses, prompts = (ids[start:] for ids, start in data.seqs), (ids[:start] for ids, start in data.seqs)
    drafter.use_draft_vocab(frequent_tokens(responses, size, drafter.config.vocab_size, eos, prompts))


def make_optimizer(drafter: DFlashModel, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms or the mask embedding)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=BETAS)


def print_summary(summary: dict, run_dir: Path) -> None:
    w = summary["last_window"]
    lines = [f"DFlash training: step {summary['step']}/{summary['steps']} ({summary['steps_this_run']} in this run)"]
    if w is not None:
        lines.append(f"  loss {w['loss']:.4f}  accuracy {w['acc']:.4f}  {w['tok_per_s']:.0f} tok/s (last log window)")
        lines.append(
            "  accuracy by block position k: " + "  ".join(f"{k}:{a:.3f}" for k, a in enumerate(w["acc_k"], 1))
        )
    if summary["step"] == summary["steps"]:
        lines.append(f"  drafter saved to {run_dir / 'final'}")
    tqdm.write("\n".join(lines))


def _check_resumable(state: dict, cfg: TrainConfig, sequences: int, path: Path) -> None:
    saved = state["config"]
    defaults = {f.name: f.default for f in fields(TrainConfig)}  # runs saved before a field existed used its default
    current = json.loads(json.dumps(asdict(cfg)))  # as saved: tuples become lists
    was = ExitConfig(saved.get("exit_weight", defaults["exit_weight"]), saved.get("lam", defaults["lam"]))
    exit_fields = {mine for mine, _ in EXIT_FIELDS}  # inert, so free to differ, while no run uses the exit loss
    free = RESUMABLE_CHANGES | (exit_fields if not (was.active or cfg.exit_config().active) else set())
    free |= ONLINE_FIELDS if not (saved.get("online") or cfg.online) else set()
    changed = sorted(k for k, v in current.items() if k not in free and saved.get(k, defaults[k]) != v)
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in changed)
        raise ValueError(f"cannot resume {path} with a different configuration ({detail}); use a new --run-dir")
    if state["data"]["sequences"] != sequences:
        raise ValueError(
            f"{path} was trained on {state['data']['sequences']} sequences, the rollouts now give {sequences}; "
            "resuming needs the same data (start a new run with --init to train on the new data)"
        )


def _open_log(path: Path, step: int):
    """The metrics log for appending, first cut back to the lines of steps <= `step` (those a resumed run
    repeats are written again)."""
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in lines))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a", encoding="utf-8")
