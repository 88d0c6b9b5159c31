"""Tree builders against brute force: DDTree's top-B prefixes and the weighted trie's top-B nodes."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exitspec.build import build_ddtree, build_trie
from exitspec.tree import DraftTree


def prefixes_of(tree: DraftTree) -> list[tuple[int, ...]]:
    """The token path of every non-root node, in node order."""
    tokens = tree.tokens.tolist()
    return [tuple(tokens[v] for v in tree.path(u)) for u in range(1, tree.size)]


def prefix_score(logp: list[list[float]], prefix: tuple[int, ...]) -> float:
    """Summed log-probability, added depth by depth like the builder does."""
    score = 0.0
    for depth, token in enumerate(prefix):
        score += logp[depth][token]
    return score


def brute_force_top(logp: list[list[float]], candidates: list[list[int]], budget: int) -> set[tuple[int, ...]]:
    """The `budget` best finite-scoring prefixes whose depth-d token is in candidates[d-1]."""
    prefixes = [p for d in range(1, len(logp) + 1) for p in itertools.product(*candidates[:d])]
    scored = sorted(((prefix_score(logp, p), p) for p in prefixes), reverse=True)
    return {p for s, p in scored[:budget] if s > -math.inf}


@st.composite
def marginals_and_budget(draw):
    horizon, vocab = draw(st.integers(1, 4)), draw(st.integers(2, 6))  # V = 1 ties everything at log 1 = 0
    total = sum(vocab**d for d in range(1, horizon + 1))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = 3 * torch.randn(horizon, vocab, generator=generator)  # continuous, so no score ties
    return logits, draw(st.integers(0, total))


@settings(max_examples=150, deadline=None)
@given(marginals_and_budget())
def test_ddtree_is_brute_force_top_budget(case):
    logits, budget = case
    horizon, vocab = logits.shape
    tree = build_ddtree(logits, root_token=9, budget=budget)
    tree.validate()
    logp = torch.log_softmax(logits, -1).double().tolist()
    expected = brute_force_top(logp, [list(range(vocab))] * horizon, budget)
    got = prefixes_of(tree)
    assert set(got) == expected
    assert tree.num_nodes == len(got) == budget
    assert int(tree.tokens[0]) == 9
    scores = [prefix_score(logp, p) for p in got]
    assert scores == sorted(scores, reverse=True)  # nodes in pop order


@settings(max_examples=80, deadline=None)
@given(marginals_and_budget(), st.integers(1, 6))
def test_ddtree_top_k_restricts_each_depth(case, top_k):
    logits, budget = case
    tree = build_ddtree(logits, root_token=0, budget=budget, top_k=top_k)
    logp = torch.log_softmax(logits, -1).double().tolist()
    candidates = logits.topk(min(top_k, logits.shape[1]), dim=-1).indices.tolist()
    assert set(prefixes_of(tree)) == brute_force_top(logp, candidates, budget)


def test_ddtree_normalises_its_input():
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 4 + 7
    raw = build_ddtree(logits, 1, budget=12)
    normalised = build_ddtree(torch.log_softmax(logits, -1), 1, budget=12)
    assert torch.equal(raw.parents, normalised.parents) and torch.equal(raw.tokens, normalised.tokens)


def test_ddtree_never_selects_minus_inf():
    logits = torch.tensor([[0.0, -math.inf, -1.0], [-math.inf, -math.inf, 2.0]])
    tree = build_ddtree(logits, 4, budget=10)
    assert set(prefixes_of(tree)) == {(0,), (2,), (0, 2), (2, 2)}


def test_ddtree_single_token_vocabulary_is_a_chain():
    tree = build_ddtree(torch.zeros(4, 1), 3, budget=3)
    assert prefixes_of(tree) == [(0,), (0, 0), (0, 0, 0)]


def test_ddtree_budget_zero_is_root_only():
    tree = build_ddtree(torch.randn(3, 5), 7, budget=0)
    assert tree.num_nodes == 0 and int(tree.tokens[0]) == 7


@pytest.mark.parametrize(
    "log_marginals, budget, top_k",
    [
        (torch.zeros(0, 5), 3, None),  # H = 0
        (torch.zeros(5), 3, None),  # not [H, V]
        (torch.zeros(2, 5), -1, None),
        (torch.zeros(2, 5), 3, 0),
        (torch.tensor([[0.0, math.nan], [0.0, 0.0]]), 3, None),
        (torch.tensor([[0.0, math.inf], [0.0, 0.0]]), 3, None),
        (torch.tensor([[0.0, 0.0], [-math.inf, -math.inf]]), 3, None),
    ],
)
def test_ddtree_rejects_bad_input(log_marginals, budget, top_k):
    with pytest.raises(ValueError):
        build_ddtree(log_marginals, 0, budget, top_k)


def trie_node_weights(continuations, weights) -> dict[tuple[int, ...], float]:
    """Total weight through every non-empty prefix of the continuations."""
    totals: dict[tuple[int, ...], float] = {}
    for continuation, weight in zip(continuations, weights):
        for d in range(1, len(continuation) + 1):
            totals[tuple(continuation[:d])] = totals.get(tuple(continuation[:d]), 0.0) + weight
    return totals


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=4), st.integers(1, 5)), max_size=6),
    st.integers(0, 30),
)
def test_trie_keeps_the_heaviest_nodes(weighted, budget):
    continuations, weights = [c for c, _ in weighted], [float(w) for _, w in weighted]
    tree = build_trie(5, continuations, weights, budget)
    tree.validate()
    totals = trie_node_weights(continuations, weights)
    chosen = prefixes_of(tree)
    assert len(set(chosen)) == len(chosen) == tree.num_nodes == min(budget, len(totals))
    assert int(tree.tokens[0]) == 5
    left_out = set(totals) - set(chosen)
    if chosen and left_out:
        assert min(totals[p] for p in chosen) >= max(totals[p] for p in left_out)
    scores = [totals[p] for p in chosen]
    assert scores == sorted(scores, reverse=True)


def test_trie_adds_up_duplicates():
    tree = build_trie(0, [[1, 2], [3], [1, 2]], [1.0, 1.5, 1.0], budget=1)
    assert prefixes_of(tree) == [(1,)]
    tree = build_trie(0, [[1, 2], [3], [1, 2]], [1.0, 1.5, 1.0], budget=3)
    assert prefixes_of(tree) == [(1,), (1, 2), (3,)]


def test_trie_breaks_ties_by_first_appearance():
    tree = build_trie(0, [[4, 1], [2, 3]], [1.0, 1.0], budget=2)
    assert prefixes_of(tree) == [(4,), (2,)]


def test_trie_of_nothing_is_root_only():
    assert build_trie(8, [], [], budget=5).num_nodes == 0
    assert build_trie(8, [[]], [1.0], budget=5).num_nodes == 0
    assert build_trie(8, [[1, 2]], [1.0], budget=0).num_nodes == 0


@pytest.mark.parametrize(
    "continuations, weights, budget",
    [
        ([[1]], [1.0, 2.0], 3),
        ([[1]], [0.0], 3),
        ([[1]], [-1.0], 3),
        ([[1]], [math.nan], 3),
        ([[1]], [1.0], -1),
        ([[-1]], [1.0], 3),
    ],
)
def test_trie_rejects_bad_input(continuations, weights, budget):
    with pytest.raises(ValueError):
        build_trie(0, continuations, weights, budget)
