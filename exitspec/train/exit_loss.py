"""The exit loss: teach the drafter's per-depth marginals where the target's mass leaves the drafter's own trees.

For anchor i, T_i is the drafter's inference-time DDTree over its block's detached logits and p_v the frozen
target's distribution at node v (tree_eval.py). The exit law (flow.tree_flow, paper Eqs. 1–4):

    P(root) = 1,   P(u) = P(parent(u)) · p_parent(u)(x_u),   rho(v) = 1 − Σ_{c ∈ children(v)} p_v(x_c),
    w(v) = P(v) · rho(v)

and, with every weight ω detached,

    L_exit = −Σ_i Σ_{v ∈ T_i, v ≠ root} ω_i(v) · log q_{θ,depth(v)}(x_v | c_i)  /  Σ_i (|T_i| − 1)

where q_{θ,d} = softmax of row d−1 of the draft logits of anchor i's block and |T_i| counts the root. Weights:

    exit     ω = w
    prefix   ω = P · s_i,  s_i = Σ_{v≠root} w_i(v) / Σ_{v≠root} P_i(v): the tree's non-root exit mass, spread like P
    reach    ω = P, unscaled: the released TEV code's variant (its loss is CE + 0.1 · L_exit)
    none     no exit loss (λ = 0): `train_loss` skips the trees and the target forward

Nodes at the hard horizon H (the block's last drafted depth) are leaves whose w also holds the target mass that
would continue past H; they count by default, `exclude_horizon_leaves` drops them (from both sums of s_i too).

Efficient form: the nodes on one draft row r = (i, d) share its log-normaliser, so with z the draft logits

    L_exit = [ −Σ_v ω(v) · z_{r(v)}[x_v] + Σ_r W_r · logsumexp(z_r) ] / Σ_i (|T_i| − 1),   W_r = Σ_{v on r} ω(v)

one logsumexp per row and one gather per node.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from transformers import DynamicCache

from exitspec.flow import tree_flow
from exitspec.sampling import SamplingParams
from exitspec.train.config import ExitConfig
from exitspec.train.dflash_loss import BlockLoss
from exitspec.train.tree_eval import build_anchor_trees, evaluate_trees
from exitspec.tree import TreeBatch


class ExitLoss(NamedTuple):
    loss: Tensor  # scalar L_exit
    weights: Tensor  # [T, M] detached ω; 0 at roots, padding and dropped horizon leaves
    coverage: Tensor  # [T] C_p(T_i) = Σ_{u≠root} P(u): the target's expected accepted length on each tree
    nodes: Tensor  # [T] |T_i| − 1, the tree's draft tokens (0 for a dropped anchor's bare root)


def node_weights(
    trees: TreeBatch, probs: Tensor, horizon: int, weight: str = "exit", exclude_horizon_leaves: bool = False
) -> tuple[Tensor, Tensor]:
    """Detached ω [T, M] of the module docstring and the coverage C_p [T], from target probs [T, M, V]."""
    if weight not in ("exit", "prefix", "reach"):
        raise ValueError(f"node weights are 'exit', 'prefix' or 'reach', got {weight!r}")
    flow = tree_flow(trees, probs.detach(), check=False)
    counted = trees.valid & (trees.depths > 0)  # [T, M]: non-root nodes (padding has depth 1 but valid False)
    if exclude_horizon_leaves:
        counted &= trees.depths < horizon
    exit_w = flow.exit * counted  # [T, M]
    if weight == "exit":
        return exit_w, flow.coverage
    reach = flow.reach * counted  # [T, M]
    if weight == "reach":
        return reach, flow.coverage
    total = reach.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(reach.dtype).tiny)  # [T, 1]; 0 only if w is 0
    return reach * (exit_w.sum(dim=-1, keepdim=True) / total), flow.coverage


def exit_loss(
    draft_logits: Tensor, trees: TreeBatch, probs: Tensor, weight: str = "exit", exclude_horizon_leaves: bool = False,
    columns: Tensor | None = None,
) -> ExitLoss:
    """L_exit for draft logits [T, H, Vd] (row d−1: depth d; with grad), trees [T, M] and target probs [T, M, V].

    Tree t must have been built from draft_logits[t] (depths <= H). columns [T, M]: each node's column in the
    draft logits (default: its token, for logits over the whole vocabulary). Gradients flow into draft_logits only.
    """
    t, h, v = draft_logits.shape
    omega, coverage = node_weights(trees, probs, h, weight, exclude_horizon_leaves)  # [T, M], [T]
    row = (trees.depths - 1).clamp(min=0)  # [T, M]: draft row of each node (the root's weight is 0)
    logits = draft_logits.float()
    columns = trees.tokens if columns is None else columns
    picked = logits.flatten(1).gather(1, row * v + columns)  # [T, M]: z_{row(v)}[x_v]
    row_weight = omega.new_zeros(t, h).scatter_add_(1, row, omega)  # [T, H]: W_r
    nodes = trees.valid[:, 1:].sum(dim=-1)  # [T]: |T_i| − 1
    loss = ((row_weight * logits.logsumexp(dim=-1)).sum() - (omega * picked).sum()) / nodes.sum().clamp(min=1)
    return ExitLoss(loss, omega, coverage, nodes)


class TrainLoss(NamedTuple):
    loss: Tensor  # L_tok + λ·L_exit: what backward() takes
    block: BlockLoss  # the DFlash block loss (L_tok = block.loss) and its per-slot metrics
    exit: ExitLoss | None  # None when the exit loss is off


def train_loss(
    model: nn.Module,
    target: nn.Module,
    ids: Tensor,
    features: Tensor,
    lengths: Tensor,
    anchors: Tensor,
    keep: Tensor,
    cfg: ExitConfig,
    soft: tuple[Tensor, Tensor] | None = None,
    cache: DynamicCache | None = None,
) -> TrainLoss:
    """L_tok + λ·L_exit for one batch: the block loss, then one frozen target forward over every anchor's tree.

    model: the DFlashObjective, possibly wrapped in DDP (called once, so DDP sees one forward); target: the frozen
    HF causal LM; ids [B, L], features [B, L, F], lengths [B], anchors / keep [B, N] as for DFlashObjective;
    cache: the target's KV cache over ids from the features forward, if it ran one (`features_and_cache`).
    """
    if not cfg.active:
        block = model(ids, features, lengths, anchors, keep, soft)
        return TrainLoss(block.loss, block, None)
    head = (model.module if isinstance(model, DistributedDataParallel) else model).head
    block = model(ids, features, lengths, anchors, keep, soft)
    full = head.expand(block.logits.detach())  # [B, N, bs−1, V] in token space, for the builder
    trees = build_anchor_trees(full, ids.gather(1, anchors), keep, cfg.budget)  # [B*N, M]
    probs = evaluate_trees(target, ids, anchors, trees, SamplingParams(cfg.temperature), cache)  # [B*N, M, V]
    columns = head.columns(trees.tokens).clamp(min=0)  # [B*N, M]: tree tokens are all in the draft vocabulary
    exits = exit_loss(block.logits.flatten(0, 1), trees, probs, cfg.weight, cfg.exclude_horizon_leaves, columns)
    return TrainLoss(block.loss + cfg.lam * exits.loss, block, exits)
