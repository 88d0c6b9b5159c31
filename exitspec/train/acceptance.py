"""Held-out acceptance of a drafter's trees, exact and without decoding: E[τ] = 1 + C_p(T).

For a held-out sequence (a prompt and the target's own response to it) and an anchor a in the response, the
drafter's DDTree T_a of budget B is built as at inference from its block at a (context x_0..x_{a−1}), and the
frozen target scores every node under its true tree context (`tree_eval.tree_logits`). By the exit law
(paper Eqs. 2 and 5) every exact saturated verifier accepts C_p(T_a) = Σ_{u≠root} P(u) draft tokens in
expectation, so a round that starts at a emits 1 + C_p tokens on average; at T = 0 (one-hot warp) C_p is
exactly the greedy match length. Per depth d, Σ_{u at depth d} P(u) is the probability that a round accepts
at least d draft tokens: where it falls off is where acceptance collapses.

Anchors are spread over the response positions (teacher forcing along the target's continuation), where a
decode weights the positions at which rounds happen to start; the two agree when the drafter's quality does
not depend on the position. `exitspec train eval` uses the target's greedy responses as contexts for every
temperature (a sampled decode at T > 0 would wander off them a little). No timing is involved, so the estimate
has no machine noise, and it is cheap: per batch one target forward (the drafter's features and the context's
KV cache), one drafter forward, and per budget one target forward over the trees after that cache, for all
temperatures at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from exitspec.flow import tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.train.dflash_loss import DFlashObjective, features_and_cache, sample_anchors
from exitspec.train.rollouts import RolloutData
from exitspec.train.tree_eval import build_anchor_trees, tree_logits


@dataclass(frozen=True)
class Acceptance:
    budget: int
    temperature: float
    trees: int  # anchors measured
    tau: float  # mean 1 + C_p(T_a): expected tokens per round, bonus included
    tau_stderr: float  # standard error of that mean over anchors
    reach_by_depth: list[float]  # [H+1] mean Σ_{u at depth d} P(u): P(a round accepts >= d draft tokens)
    exit_by_depth: list[float]  # [H+1] mean Σ_{v at depth d} w(v): where the target leaves the tree
    tau_by_sequence: dict[str, float]  # rollout id -> mean 1 + C_p over its anchors (paired comparisons, paired.py)


@torch.no_grad()
def measure_acceptance(
    objective: DFlashObjective,
    target,
    data: RolloutData,
    budgets: list[int],
    temperatures: list[float],
    anchors: int = 16,
    batch_size: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> list[Acceptance]:
    """E[τ] of the drafter's DDTrees on every sequence of `data`, `anchors` random anchors per sequence.

    objective: the drafter with the target's frozen embeddings and LM head; target: the frozen HF causal LM.
    Returns one Acceptance per (budget, temperature), budgets outermost.
    """
    drafter = objective.drafter.eval()
    device = drafter.fc.weight.device
    gen = torch.Generator().manual_seed(seed)
    horizon = drafter.block_size - 1
    sums = {(b, t): _Sums(horizon, device) for b in budgets for t in temperatures}
    bar = tqdm(total=len(data), desc="acceptance", unit="seq", disable=not progress)
    for position in range(0, len(data), batch_size):
        count = min(batch_size, len(data) - position)
        ids, starts, lengths = data.batch(position, 0, count)  # one epoch: every sequence once
        keys = data.keys_at(position, 0, count)
        picked, keep = sample_anchors(starts, lengths, anchors, gen)
        ids, lengths, picked, keep = (x.to(device) for x in (ids, lengths, picked, keep))
        features, cache = features_and_cache(target, ids, lengths, drafter.config.target_layer_ids)  # [B, L, F]
        draft_logits = objective.head.expand(objective.draft_logits(ids, features, picked))  # [B, N, H, V]
        kept = keep.flatten()  # [B*N]
        sequence = [key for key in keys for _ in range(keep.shape[1])]  # [B*N]: each tree's rollout id
        for budget in budgets:
            trees = build_anchor_trees(draft_logits, ids.gather(1, picked), keep, budget)  # [B*N, M]
            logits = tree_logits(target, ids, picked, trees, cache)  # [B*N, M, V]
            for temperature in temperatures:
                flow = tree_flow(trees, target_probs(logits, SamplingParams(temperature)), check=False)
                sums[budget, temperature].add(flow.reach, flow.exit, trees.depths, kept, sequence)
        bar.update(count)
    bar.close()
    return [sums[b, t].result(b, t) for b in budgets for t in temperatures]


class _Sums:
    """Running sums over anchors of 1 + C_p, its square, its sum and count per sequence, and reach / exit mass
    per depth."""

    def __init__(self, horizon: int, device):
        self.n, self.tau, self.tau_sq = 0, 0.0, 0.0
        self.by_sequence: dict[str, list[float]] = {}  # rollout id -> [Σ (1 + C_p), anchors]
        self.reach = torch.zeros(horizon + 1, dtype=torch.float64, device=device)  # [H+1]
        self.exit = torch.zeros(horizon + 1, dtype=torch.float64, device=device)  # [H+1]

    def add(self, reach: Tensor, exit_mass: Tensor, depths: Tensor, kept: Tensor, sequence: list[str]) -> None:
        """reach, exit_mass, depths [T, M] (tree_flow gives padded slots no mass); kept [T]: the anchors that count;
        sequence [T]: the rollout id of each tree."""
        reach, exit_mass, depths = reach[kept], exit_mass[kept], depths[kept]
        tau = 1.0 + reach[:, 1:].sum(dim=1).double()  # [T']
        for key, value in zip((k for k, keep in zip(sequence, kept.tolist()) if keep), tau.tolist()):
            total = self.by_sequence.setdefault(key, [0.0, 0])
            total[0] += value
            total[1] += 1
        self.n += int(tau.numel())
        self.tau += float(tau.sum())
        self.tau_sq += float(tau.square().sum())
        self.reach.scatter_add_(0, depths.flatten(), reach.flatten().double())
        self.exit.scatter_add_(0, depths.flatten(), exit_mass.flatten().double())

    def result(self, budget: int, temperature: float) -> Acceptance:
        if self.n == 0:
            raise ValueError("no anchor was measured: the held-out responses are all shorter than two tokens")
        mean = self.tau / self.n
        var = max(self.tau_sq / self.n - mean * mean, 0.0)
        stderr = (var / max(self.n - 1, 1)) ** 0.5
        reach = [round(float(x) / self.n, 5) for x in self.reach]
        exits = [round(float(x) / self.n, 5) for x in self.exit]
        by_sequence = {key: total / count for key, (total, count) in self.by_sequence.items()}
        return Acceptance(budget, temperature, self.n, mean, stderr, reach, exits, by_sequence)
