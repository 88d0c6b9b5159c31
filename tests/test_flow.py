"""Lemma 1 of the exit law on random trees (hypothesis), batching, and the residuals."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exitspec.check import random_logits, random_tree
from exitspec.flow import frontier, observed_reach, residual_probs, row_flow, tree_flow
from exitspec.sampling import SamplingParams, WarpedRows, target_probs
from exitspec.tree import TreeBatch

seeds = st.integers(min_value=0, max_value=2**31 - 1)


def _case(seed: int, vocab: int = 7, params: SamplingParams = SamplingParams()):  # noqa: B008 (frozen)
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, vocab)
    probs = target_probs(random_logits(gen, tree.size, vocab), params).double()
    return tree, probs


@settings(max_examples=200, deadline=None)
@given(seeds, st.sampled_from([SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(0.7, top_k=3)]))
def test_lemma1_identities(seed, params):
    tree, probs = _case(seed, params=params)
    flow = tree_flow(tree, probs)
    assert torch.isclose(flow.exit.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(tree.ancestors.T.double() @ flow.exit, flow.reach, atol=1e-12)
    assert torch.isclose(flow.coverage, (flow.exit * tree.depths).sum(), atol=1e-12)
    assert flow.reach[0] == 1.0 and bool((flow.exit >= 0).all())


@settings(max_examples=50, deadline=None)
@given(seeds)
def test_reach_is_product_of_edges_along_the_path(seed):
    tree, probs = _case(seed)
    flow = tree_flow(tree, probs)
    for node in range(1, tree.size):
        path = [0] + tree.path(node)
        expected = torch.prod(torch.stack([probs[a, tree.tokens[b]] for a, b in itertools.pairwise(path)]))
        assert torch.isclose(flow.reach[node], expected, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(seeds, min_size=1, max_size=4))
def test_batched_flow_matches_each_tree(seed_list):
    cases = [_case(s) for s in seed_list]
    batch = TreeBatch.stack([t for t, _ in cases])
    m = batch.parents.shape[1]
    padded = torch.zeros(len(cases), m, 7, dtype=torch.float64)
    for i, (tree, probs) in enumerate(cases):
        padded[i, : tree.size] = probs
    batched = tree_flow(batch, padded)
    for i, (tree, probs) in enumerate(cases):
        single = tree_flow(tree, probs)
        n = tree.size
        assert torch.allclose(batched.exit[i, :n], single.exit) and torch.allclose(batched.reach[i, :n], single.reach)
        assert torch.isclose(batched.coverage[i], single.coverage)
        assert bool((batched.exit[i, n:] == 0).all())


@settings(max_examples=100, deadline=None)
@given(seeds, st.integers(min_value=1, max_value=40), st.sampled_from([SamplingParams(), SamplingParams(0.0)]))
def test_a_head_reveals_its_own_reach_and_its_frontier(seed, kept, params):
    """A forward over the first `kept` nodes of a tree gives the exact P(u) of those and of their cut children
    (the same as a forward over the whole tree); deeper cut nodes are NaN, unobserved."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, 7)
    logits = random_logits(gen, tree.size, 7)  # [M+1, V]
    kept = min(kept, tree.size)
    head = tree.head(kept)
    rows = WarpedRows(logits[:kept], params)  # the head's forward sees only its own rows
    reach = row_flow(head, rows).reach.tolist()  # a root alone: P = 1
    parents, tokens = tree.parent_list, tree.token_list
    cut = frontier(tree, kept)
    edges = rows.edges([parents[u] for u in cut], [tokens[u] for u in cut]).tolist()
    got = torch.tensor(observed_reach(tree, kept, reach, edges))  # [M+1]
    full = tree_flow(tree, target_probs(logits, params)).reach  # [M+1]
    seen = torch.arange(tree.size) < kept
    seen[kept:] = tree.parents[kept:] < kept
    assert torch.allclose(got[seen], full[seen], atol=1e-6)
    assert bool(got[~seen].isnan().all())


def test_residual_removes_children_and_renormalises():
    tree, probs = _case(3)
    res = residual_probs(tree, probs)
    flow = tree_flow(tree, probs)
    for v in range(tree.size):
        kids = tree.tokens[tree.parents == v]
        assert bool((res[v, kids] == 0).all())
        if flow.rho[v] > 1e-9:
            assert torch.isclose(res[v].sum(), torch.tensor(1.0, dtype=torch.float64))
            keep = torch.ones(7, dtype=torch.bool)
            keep[kids] = False
            assert torch.allclose(res[v, keep], probs[v, keep] / flow.rho[v])
