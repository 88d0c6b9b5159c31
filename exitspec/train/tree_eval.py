"""Exact target evaluation of training-time draft trees: every node of every anchor's tree in one forward.

For a training sequence x_0..x_{L-1} and anchors a_1..a_n, the drafter's block at a_i gives per-depth logits
[H, V]; DDTree (`build_ddtree`, exactly as at inference) turns them into a tree T_i whose root carries x_{a_i}.
At inference the target scores T_i against the committed context x_0..x_{a_i−1}; here all n trees are scored
at once by the frozen target, after the KV cache of the context x_0..x_{C−1} (C >= max_i a_i: the features
forward's cache when the step ran one, else a forward up to the last anchor), on the input

    tokens:    T_1 (M slots) | T_2 (M slots) | … | T_n (M slots)
    positions: a_1 + depth   | a_2 + depth   | … | a_n + depth

with an additive float 4D mask over the C cached and N·M new positions: slot u of T_i sees context rows < a_i
and the slots of T_i that are u or its ancestors, nothing of another tree. Node u's logits are then the
target's next-token logits after x_0..x_{a_i−1} + the root-to-u path, the same as a separate causal forward
(and as `TargetModel.forward_tree` at inference). Trees are padded to M slots (`TreeBatch`); a padded slot
sees only the context and itself and carries no mass in `flow.tree_flow`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from exitspec.build import build_ddtree
from exitspec.sampling import SamplingParams, target_probs
from exitspec.target import cache_argument, crop_cache
from exitspec.tree import DraftTree, TreeBatch

PLAIN = SamplingParams(1.0)  # temperature 1, no top-k / top-p: the target's own distribution


@torch.no_grad()
def build_anchor_trees(draft_logits: Tensor, roots: Tensor, keep: Tensor, budget: int) -> TreeBatch:
    """draft_logits [B, N, H, V] (row d−1: depth d), roots [B, N] = x_{a_i}, keep [B, N] -> TreeBatch [B*N, M].

    Tree (b, i) is the drafter's inference-time DDTree of `budget` nodes over the DETACHED logits; an anchor
    that is not kept gets a root-only tree (no nodes, no loss, no cost in the target forward beyond one slot).
    """
    logits = draft_logits.detach().flatten(0, 1)  # [B*N, H, V]
    trees = [
        build_ddtree(rows, root, budget) if kept else DraftTree.root_only(root, device=rows.device)
        for rows, root, kept in zip(logits, roots.flatten().tolist(), keep.flatten().tolist())
    ]
    return TreeBatch.stack(trees)


def tree_attention_inputs(
    anchors: Tensor, trees: TreeBatch, context: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The trees' input after a cached context of `context` positions (module docstring): input ids [B, N*M],
    position ids [B, N*M] and the additive mask [B, 1, N*M, context + N*M].

    anchors [B, N] (each 0 <= a_i <= context, x_{a_i} the root of tree (b, i)), trees [B*N, M]."""
    b, n = anchors.shape
    m = trees.parents.shape[1]
    device = anchors.device
    tree_tokens = trees.tokens.view(b, n * m)  # [B, N*M]
    positions = (anchors[..., None] + trees.depths.view(b, n, m)).view(b, n * m)  # [B, N*M]: a_i + depth
    before_anchor = torch.arange(context, device=device) < anchors.repeat_interleave(m, dim=1)[..., None]  # [B, N*M, C]
    same_tree = torch.eye(n, dtype=torch.bool, device=device)[None, :, None, :, None]  # [1, N, 1, N, 1]
    ancestors = trees.ancestors.view(b, n, m, 1, m)  # [B, N, M, 1, M]: slot u of tree i sees slot v of tree i
    tree_cols = (same_tree & ancestors).view(b, n * m, n * m)  # [B, N*M, N*M], block diagonal
    visible = torch.cat([before_anchor, tree_cols], dim=2)  # [B, N*M, C + N*M]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return tree_tokens, positions, mask[:, None]


@torch.no_grad()
def context_cache(model: PreTrainedModel, ids: Tensor) -> DynamicCache:
    """The KV cache of the target's causal forward over ids [B, C] (decoder only: no LM head)."""
    cache, decoder = DynamicCache(config=model.config), model.get_decoder()
    decoder(input_ids=ids, use_cache=True, **{cache_argument(decoder): cache})
    return cache


@torch.no_grad()
def tree_logits(
    model: PreTrainedModel, ids: Tensor, anchors: Tensor, trees: TreeBatch, cache: DynamicCache | None = None
) -> Tensor:
    """Target logits [B*N, M, V] at every slot of every anchor's tree that the exit law reads: the root and each
    node with children (`TreeBatch.parents_only`); a leaf's row is 0, since nothing reads it.

    ids [B, L], anchors [B, N], trees [B*N, M] from `build_anchor_trees` (tree (b, i) rooted at ids[b, a_bi]).
    cache: the KV cache of a causal forward over ids (or over a prefix of them reaching every anchor), such as
    the features forward's (`dflash_loss.features_and_cache`); without one, the context up to the last anchor
    runs first. One forward of the frozen HF causal LM (sdpa or eager attention) then scores the cut trees after
    the cache, which it leaves as it found it. A DDTree of B = 32 is about half leaves, so the cut halves the
    tree rows the target runs.
    """
    b, n = anchors.shape
    cut, slots = trees.parents_only()  # [B*N, M'] each
    m = slots.shape[1]
    if cache is None:
        cache = context_cache(model, ids[:, : max(int(anchors.max()), 1)])
    context = cache.get_seq_length()
    input_ids, positions, mask = tree_attention_inputs(anchors, cut, context, model.dtype)
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                **{cache_argument(model): cache})
    crop_cache(cache, context)
    logits = out.logits.view(b * n, m, -1)  # [B*N, M', V]
    full = logits.new_zeros(b * n, trees.parents.shape[1], logits.shape[-1])  # [B*N, M, V]
    return full.scatter_(1, slots[..., None].expand_as(logits), logits)


def evaluate_trees(
    model: PreTrainedModel, ids: Tensor, anchors: Tensor, trees: TreeBatch, params: SamplingParams = PLAIN,
    cache: DynamicCache | None = None,
) -> Tensor:
    """Target probabilities [B*N, M, V] (float32, after `params`' warp) at the slots the exit law reads:
    `tree_logits`, warped (a leaf's row is uniform: its logits are 0)."""
    return target_probs(tree_logits(model, ids, anchors, trees, cache), params)
