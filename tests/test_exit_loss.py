"""The exit loss: node weights from the exit law, the row-logsumexp form against the per-node sum, the total loss."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.build import build_ddtree
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.flow import tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.train.dflash_loss import DFlashObjective, target_features
from exitspec.train.exit_loss import ExitConfig, exit_loss, node_weights, train_loss
from exitspec.train.tree_eval import build_anchor_trees
from exitspec.tree import DraftTree, TreeBatch

VOCAB, H = 32, 4


def unpad(trees: TreeBatch, t: int) -> DraftTree:
    size = int(trees.valid[t].sum())
    return DraftTree(trees.parents[t, :size], trees.tokens[t, :size], trees.depths[t, :size])


def naive_weights(tree: DraftTree, probs: torch.Tensor, weight: str, exclude_horizon_leaves: bool) -> torch.Tensor:
    """ω [N+1] of one tree, straight from the definitions (root weight 0)."""
    flow = tree_flow(tree, probs)
    counted = (tree.depths > 0) & ~((tree.depths == H) & exclude_horizon_leaves)
    exit_w, reach = flow.exit * counted, flow.reach * counted
    if weight == "exit":
        return exit_w
    if weight == "reach":
        return reach
    return reach * exit_w.sum() / reach.sum() if reach.sum() > 0 else reach


def naive_loss(draft_logits, trees, probs, weight, exclude_horizon_leaves):
    """−Σ_i Σ_{v≠root} ω_i(v) log q_{depth(v)}(x_v) / Σ_i (|T_i| − 1), one node at a time."""
    total, nodes = 0.0, 0
    for t in range(trees.parents.shape[0]):
        tree = unpad(trees, t)
        omega = naive_weights(tree, probs[t, : tree.size], weight, exclude_horizon_leaves)
        for u in range(1, tree.size):
            logq = torch.log_softmax(draft_logits[t, int(tree.depths[u]) - 1], dim=-1)
            total = total - omega[u] * logq[tree.tokens[u]]
        nodes += tree.size - 1
    return total / nodes


@pytest.fixture(scope="module")
def case():
    """6 DDTrees (one dropped anchor) over random draft logits [6, H, V] and random target probs."""
    gen = torch.Generator().manual_seed(0)
    draft_logits = 2 * torch.randn(2, 3, H, VOCAB, generator=gen)
    keep = torch.tensor([[True, True, False], [True, True, True]])
    trees = build_anchor_trees(draft_logits, torch.randint(VOCAB, (2, 3), generator=gen), keep, budget=9)
    probs = target_probs(3 * torch.randn(*trees.parents.shape, VOCAB, generator=gen), SamplingParams(1.0))
    return draft_logits.flatten(0, 1), trees, probs


@pytest.mark.parametrize("weight", ["exit", "prefix", "reach"])
@pytest.mark.parametrize("exclude_horizon_leaves", [False, True])
def test_row_logsumexp_form_equals_the_per_node_sum(case, weight, exclude_horizon_leaves):
    draft_logits, trees, probs = case
    assert (trees.depths[trees.valid] == H).any()  # the horizon option has something to drop
    fast_in = draft_logits.clone().requires_grad_(True)
    slow_in = draft_logits.clone().requires_grad_(True)
    fast = exit_loss(fast_in, trees, probs, weight, exclude_horizon_leaves)
    slow = naive_loss(slow_in, trees, probs, weight, exclude_horizon_leaves)
    torch.testing.assert_close(fast.loss, slow, atol=1e-5, rtol=1e-5)
    fast.loss.backward()
    slow.backward()
    torch.testing.assert_close(fast_in.grad, slow_in.grad, atol=1e-5, rtol=1e-5)
    assert fast_in.grad.abs().sum() > 0


def test_node_weights_follow_the_exit_law(case):
    _, trees, probs = case
    flow = tree_flow(trees, probs)
    exit_w, coverage = node_weights(trees, probs, H, "exit")
    prefix_w, _ = node_weights(trees, probs, H, "prefix")
    reach_w, _ = node_weights(trees, probs, H, "reach")
    cut_w, _ = node_weights(trees, probs, H, "exit", exclude_horizon_leaves=True)
    torch.testing.assert_close(coverage, flow.coverage)
    assert (exit_w[:, 0] == 0).all() and (exit_w[~trees.valid] == 0).all()
    torch.testing.assert_close(exit_w.sum(dim=1), 1 - flow.exit[:, 0])  # Σ_v w(v) = 1, the root omitted
    torch.testing.assert_close(prefix_w.sum(dim=1), exit_w.sum(dim=1))  # same total, spread like P
    torch.testing.assert_close(reach_w.sum(dim=1), coverage)  # Σ_{v≠root} P(v) = C_p (Eq. 5)
    ratio = prefix_w[:, 1:] / flow.reach[:, 1:]
    for t in range(trees.parents.shape[0]):
        r = ratio[t][trees.valid[t, 1:]]
        if r.numel():
            torch.testing.assert_close(r, r[:1].expand_as(r))
    horizon = trees.depths == H
    assert (cut_w[horizon] == 0).all() and torch.equal(cut_w[~horizon], exit_w[~horizon])
    assert (exit_w[horizon & trees.valid] > 0).any()
    assert (unpad(trees, 2).size, float(coverage[2])) == (1, 0.0)  # the dropped anchor: a bare root
    nodes = exit_loss(torch.zeros(6, H, VOCAB), trees, probs).nodes
    assert nodes.tolist() == [9, 9, 0, 9, 9, 9]


# ---------------------------------------------------------------------------------------------------------
# The total loss on the tiny Llama and a DFlash drafter

BLOCK = 5


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(VOCAB)
    torch.manual_seed(0)
    drafter = DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK, std=0.2)
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), 2.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (2, 14), generator=g)
    lengths = torch.tensor([14, 10])
    ids[1, 10:] = 0
    features = target_features(target, ids, lengths, drafter.config.target_layer_ids)
    anchors, keep = torch.tensor([[3, 8, 12], [2, 6, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    return target, objective, ids, features, lengths, anchors, keep


def reference_exit_loss(target, objective, ids, features, anchors, keep, budget, weight):
    """Each block alone on its own context, its DDTree, each node's causal target forward, the per-node sum."""
    drafter, rows, trees, probs = objective.drafter, [], [], []
    for b, i in itertools.product(range(anchors.shape[0]), range(anchors.shape[1])):
        a, root = int(anchors[b, i]), int(ids[b, anchors[b, i]])
        block = drafter.block_embeddings(ids[b : b + 1, a : a + 1], objective.embed)  # [1, bs, D]
        ctx = features[b : b + 1, :a]
        hidden = drafter(block, torch.arange(a, a + BLOCK)[None], ctx, torch.arange(a)[None], torch.tensor([[a]]))
        rows.append(objective.lm_head(hidden[0, 1:]))  # [bs−1, V]
        tree = build_ddtree(rows[-1].detach(), root, budget) if keep[b, i] else DraftTree.root_only(root)
        paths = [torch.cat([ids[b, :a], tree.tokens[[0, *tree.path(u)]]]) for u in range(tree.size)]
        probs.append(torch.stack([torch.softmax(target(input_ids=p[None]).logits[0, -1], dim=-1) for p in paths]))
        trees.append(tree)
    batch = TreeBatch.stack(trees)
    padded = torch.zeros(*batch.parents.shape, VOCAB)
    for t, p in enumerate(probs):
        padded[t, : p.shape[0]] = p
    return naive_loss(torch.stack(rows), batch, padded, weight, False), batch


@pytest.mark.parametrize("weight", ["exit", "prefix", "reach"])
def test_total_loss_is_block_loss_plus_lambda_exit_loss(setup, weight):
    target, objective, ids, features, lengths, anchors, keep = setup
    cfg = ExitConfig(weight=weight, lam=0.5, budget=6)
    out = train_loss(objective, target, ids, features, lengths, anchors, keep, cfg)
    block = objective(ids, features, lengths, anchors, keep)
    torch.testing.assert_close(out.block.loss, block.loss)
    torch.testing.assert_close(out.loss, block.loss + 0.5 * out.exit.loss)
    expected, trees = reference_exit_loss(target, objective, ids, features, anchors, keep, 6, weight)
    assert out.exit.weights.shape == trees.parents.shape == (6, 7)
    torch.testing.assert_close(out.exit.loss, expected, atol=1e-5, rtol=1e-5)
    assert not objective.lm_head._forward_hooks  # the capture hook is gone

    objective.zero_grad(set_to_none=True)
    out.exit.loss.backward(retain_graph=True)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in objective.drafter.parameters())
    assert objective.lm_head.weight.grad is None and all(p.grad is None for p in target.parameters())
    objective.zero_grad(set_to_none=True)


def test_exit_loss_off(setup):
    target, objective, ids, features, lengths, anchors, keep = setup
    for cfg in (ExitConfig(weight="none"), ExitConfig(weight="exit", lam=0.0)):
        out = train_loss(objective, target, ids, features, lengths, anchors, keep, cfg)
        assert out.exit is None and out.loss is out.block.loss
    with pytest.raises(ValueError, match="exit weight"):
        ExitConfig(weight="exit-mass")
