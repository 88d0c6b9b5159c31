"""Held-out responses for measuring a drafter, and the cheap greedy check that training logs as it goes.

`make_heldout` has the target answer the first turns of benchmark prompts greedily (sets that are never
trained on), one rollout folder per dataset, made once and cached.

`GreedyCheck` scores a drafter on those responses at T = 0 without any target forward. A held-out response
is the target's own greedy continuation, so a round that starts at anchor a accepts exactly the longest path
of the drafter's DDTree that follows the response: τ = 1 + that length, the T = 0 case of acceptance.py's
1 + C_p (Eq. 5). The target's features of the held-out sequences are computed once, at construction, so a
check costs one drafter forward per sequence and the tree builds. It also reports the top-1 accuracy per
depth over every valid block slot; at depth 1 that is the acceptance of a one-token draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from exitspec.data import load_dataset
from exitspec.decode import encode_prompt
from exitspec.train.dflash_loss import DFlashObjective, sample_anchors, target_features
from exitspec.train.rollouts import GenerationSettings, Rollout, load_rollouts, make_rollouts, stop_and_pad
from exitspec.train.tree_eval import build_anchor_trees

HELDOUT_TOKENS = 128  # length of the target's held-out responses (as `exitspec train eval`'s default)


def heldout_prompts(samples, tokenizer, dataset: str, limit: int | None) -> list[tuple[str, list[int]]]:
    """(id, chat-template ids) of the first turn of the first `limit` benchmark samples (None: all).

    Later MT-Bench turns would need the model's own first answer in the prompt; the first turn suffices to put
    the held-out responses in the evaluation's domain."""
    return [(f"{dataset}/{s.id}", encode_prompt(tokenizer, s.prompt(0))) for s in samples[:limit]]


def make_heldout(
    model, tokenizer, target_name: str, datasets: Sequence[str], folder: str | Path, num_prompts: int | None,
    max_new_tokens: int, data_dir=None, progress: bool = True,
) -> dict[str, list[Rollout]]:
    """Dataset name -> the target's greedy responses to its first `num_prompts` prompts, made where missing
    (in folder/<name>) and read back in prompt order."""
    if tokenizer is None:
        raise ValueError("held-out prompts are text: the target folder needs a tokenizer")
    eos_ids, pad_id = stop_and_pad(model, tokenizer)
    settings = GenerationSettings(model=target_name, max_new_tokens=max_new_tokens)
    out = {}
    for spec in datasets:
        name, samples = load_dataset(spec, data_dir)
        prompts = heldout_prompts(samples, tokenizer, name, num_prompts)
        make_rollouts(model, prompts, Path(folder) / name, settings, eos_ids, pad_id, progress=progress)
        done = {r.id: r for r in load_rollouts(Path(folder) / name)}
        out[name] = [done[pid] for pid, _ in prompts]
    return out


class GreedyCheck:
    """τ at T = 0 and top-1 accuracy per depth of a drafter on held-out greedy responses (module docstring)."""

    def __init__(self, target, heldout: dict[str, list[Rollout]], layer_ids, anchors: int = 32, seed: int = 0):
        device = next(target.parameters()).device
        gen = torch.Generator().manual_seed(seed)
        self.sequences: dict[str, list[tuple[Tensor, ...]]] = {}
        for name, rollouts in heldout.items():
            rows = []
            for r in rollouts:
                if len(r.response_ids) < 2:
                    continue
                ids = torch.tensor([r.prompt_ids + r.response_ids], device=device)  # [1, L]
                lengths = torch.tensor([ids.shape[1]], device=device)
                starts = torch.tensor([len(r.prompt_ids)])
                picked, keep = sample_anchors(starts, lengths.cpu(), anchors, gen)  # [1, N] each, fixed
                features = target_features(target, ids, lengths, layer_ids).to(torch.float16)  # [1, L, F]
                rows.append((ids, lengths, picked.to(device), keep.to(device), features))
            self.sequences[name] = rows

    @torch.no_grad()
    def __call__(self, objective: DFlashObjective, budget: int = 32) -> dict[str, dict]:
        """Per dataset: anchors measured, mean τ of budget-`budget` DDTrees, and top-1 accuracy per depth."""
        drafter = objective.drafter
        was_training = drafter.training
        drafter.eval()
        horizon = drafter.block_size - 1
        results = {}
        for name, rows in self.sequences.items():
            taus, correct, counted = [], torch.zeros(horizon), torch.zeros(horizon)
            for ids, lengths, anchors, keep, features in rows:
                logits = objective.draft_logits(ids, features, anchors)  # [1, N, H, Vd]
                targets, valid = objective.slot_targets(ids, lengths, anchors, keep)  # [1, N, H] each
                correct += ((logits.argmax(dim=-1) == objective.head.columns(targets)) & valid).sum(dim=(0, 1)).cpu()
                counted += valid.sum(dim=(0, 1)).cpu()
                trees = build_anchor_trees(objective.head.expand(logits), ids.gather(1, anchors), keep, budget)
                follow = targets.masked_fill(~valid, -1).flatten(0, 1)  # [N, H]: the response's tokens to follow
                taus.append(1 + followed_length(trees, follow)[keep.flatten()])
            taus = torch.cat(taus).double()
            results[name] = {"anchors": int(taus.numel()), "tau": round(float(taus.mean()), 4),
                             "acc_k": [round(float(c / max(n, 1)), 4) for c, n in zip(correct, counted, strict=True)]}
        drafter.train(was_training)
        return results


def followed_length(trees, follow: Tensor) -> Tensor:
    """trees [T, M] (TreeBatch, parents first); follow [T, H]: the token each depth must carry (−1: none).
    Returns [T]: how deep the path of nodes whose tokens follow `follow` from the root goes."""
    on = torch.zeros(trees.tokens.shape, dtype=torch.bool, device=follow.device)  # [T, M]
    on[:, 0] = True
    rows = torch.arange(on.shape[0], device=follow.device)
    for m in range(1, on.shape[1]):
        d = trees.depths[:, m]  # [T]
        wanted = follow.gather(1, (d - 1).clamp(min=0, max=follow.shape[1] - 1)[:, None])[:, 0]
        on[:, m] = trees.valid[:, m] & (d >= 1) & (trees.tokens[:, m] == wanted) & on[rows, trees.parents[:, m]]
    return on[:, 1:].sum(dim=1)  # the followed nodes form one chain (siblings carry distinct tokens)
