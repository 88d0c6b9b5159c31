"""Training-time tree evaluation: one target forward over every anchor's tree, after the context's cache, equals
a separate causal forward at every node the exit law reads (the root and each node with children), so the exit
law of the trees is the same."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.build import build_ddtree
from exitspec.check import random_tree
from exitspec.flow import tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.train.dflash_loss import features_and_cache, target_features
from exitspec.train.tree_eval import build_anchor_trees, evaluate_trees
from exitspec.tree import DraftTree, TreeBatch

VOCAB = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB)


def rooted_random_tree(gen: torch.Generator, root: int, max_nodes: int = 12) -> DraftTree:
    tree = random_tree(gen, VOCAB, max_depth=5, max_branch=3, max_nodes=max_nodes)
    return DraftTree.from_parents(tree.parents, torch.cat([torch.tensor([root]), tree.tokens[1:]]))


def read_rows(tree: DraftTree) -> list[int]:
    """The nodes whose target row the exit law reads: the root and every parent."""
    return sorted({0, *tree.parents[1:].tolist()})


def assert_same_law(probs: torch.Tensor, expected: torch.Tensor, tree: DraftTree) -> None:
    """probs [N+1, V] equal expected at the rows the exit law reads, and give the same P, rho and w."""
    rows = read_rows(tree)
    torch.testing.assert_close(probs[rows], expected[rows], atol=1e-5, rtol=0)
    got, want = tree_flow(tree, probs, check=False), tree_flow(tree, expected, check=False)
    torch.testing.assert_close(got.exit, want.exit, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.reach, want.reach, atol=1e-5, rtol=0)


def causal_probs(model, context: torch.Tensor, tree: DraftTree, params: SamplingParams) -> torch.Tensor:
    """[N+1, V]: node u's target distribution from its own causal forward over context + root-to-u path."""
    rows = []
    for u in range(tree.size):
        seq = torch.cat([context, tree.tokens[[0, *tree.path(u)]]])
        rows.append(model(input_ids=seq[None]).logits[0, -1])
    return target_probs(torch.stack(rows), params)


def test_every_node_equals_its_own_causal_forward(model):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (1, 40), generator=gen)
    anchors = torch.tensor([[0, 5, 17, 30, 39]])  # anchor 0: a tree with no context at all
    trees = []
    for i, a in enumerate(anchors[0].tolist()):
        root = int(ids[0, a])
        if i % 2:
            trees.append(rooted_random_tree(gen, root))
        else:
            trees.append(build_ddtree(3 * torch.randn(4, VOCAB, generator=gen), root, budget=10))
    probs = evaluate_trees(model, ids, anchors, TreeBatch.stack(trees))
    assert probs.shape == (5, max(t.size for t in trees), VOCAB)
    for i, (a, tree) in enumerate(zip(anchors[0].tolist(), trees)):
        expected = causal_probs(model, ids[0, :a], tree, SamplingParams(1.0))
        assert_same_law(probs[i, : tree.size], expected, tree)


def test_padded_batch_with_dropped_anchors(model):
    """Two sequences of lengths 30 and 19 (padding garbage after 19), a dropped anchor, a warped distribution."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 30), generator=gen)
    ids[1, 19:] = 7
    anchors = torch.tensor([[4, 12, 28], [2, 17, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    draft_logits = 3 * torch.randn(2, 3, 4, VOCAB, generator=gen)
    trees = build_anchor_trees(draft_logits, ids.gather(1, anchors), keep, budget=8)
    params = SamplingParams(0.7, top_k=6)
    probs = evaluate_trees(model, ids, anchors, trees, params)
    ids2 = ids.clone()
    ids2[1, 19:] = 3  # other padding: no tree may see it
    torch.testing.assert_close(evaluate_trees(model, ids2, anchors, trees, params), probs, atol=1e-6, rtol=0)
    # after the features forward's cache of all 30 positions (padding included): the same, twice from one cache
    features, cache = features_and_cache(model, ids, torch.tensor([30, 19]), layer_ids=[0, 1])
    torch.testing.assert_close(features, target_features(model, ids, torch.tensor([30, 19]), [0, 1]))
    for _ in range(2):
        torch.testing.assert_close(evaluate_trees(model, ids, anchors, trees, params, cache), probs, atol=1e-5, rtol=0)
        assert cache.get_seq_length() == 30
    for b in range(2):
        for i in range(3):
            t = b * 3 + i
            size = int(trees.valid[t].sum())
            tree = DraftTree(trees.parents[t, :size], trees.tokens[t, :size], trees.depths[t, :size])
            if not keep[b, i]:
                assert size == 1
                continue
            expected = causal_probs(model, ids[b, : anchors[b, i]], tree, params)
            assert_same_law(probs[t, :size], expected, tree)


def test_anchor_trees_are_the_inference_ddtrees():
    gen = torch.Generator().manual_seed(2)
    draft_logits = torch.randn(2, 2, 5, VOCAB, generator=gen, requires_grad=True)
    roots, keep = torch.tensor([[3, 4], [5, 6]]), torch.tensor([[True, False], [True, True]])
    trees = build_anchor_trees(draft_logits, roots, keep, budget=7)
    assert trees.parents.shape == (4, 8)
    for t, (b, i) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        expected = build_ddtree(draft_logits[b, i].detach(), int(roots[b, i]), 7) if keep[b, i] else None
        size = expected.size if expected is not None else 1
        assert int(trees.valid[t].sum()) == size and int(trees.tokens[t, 0]) == int(roots[b, i])
        if expected is not None:
            assert torch.equal(trees.parents[t, :size], expected.parents)
            assert torch.equal(trees.tokens[t, :size], expected.tokens)


def test_cut_trees_keep_the_root_and_every_parent_in_order():
    trees = TreeBatch.stack([
        DraftTree.from_parents([-1, 0, 0, 1, 1, 3], tokens=[9, 1, 2, 3, 4, 5]),  # leaves 2, 4, 5
        DraftTree.from_parents([-1], tokens=[7]),  # a bare root
        DraftTree.from_parents([-1, 0, 1], tokens=[8, 6, 6]),  # a chain: its last node is the one leaf
    ])
    cut, slots = trees.parents_only()
    assert slots[:, :3].tolist()[0] == [0, 1, 3] and slots.shape == (3, 3)
    assert cut.valid.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert cut.parents[0].tolist() == [-1, 0, 1] and cut.tokens[0].tolist() == [9, 1, 3]
    assert cut.depths[0].tolist() == [0, 1, 2] and cut.parents[2, :2].tolist() == [-1, 0]
