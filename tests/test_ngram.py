"""The prompt-lookup drafter: its search against a plain full-scan loop, and the trees it builds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exitspec.drafters.base import Drafter
from exitspec.drafters.ngram import NgramDrafter


def loop_lookup(context: list[int], max_depth: int, max_ngram: int, min_ngram: int, max_candidates: int):
    """Reference search: every continuation start e, its match length, longest then most recent first."""
    length = len(context)
    matches = []
    for e in range(1, length):
        m = 0
        while m < min(max_ngram, e, length - 1) and context[e - 1 - m] == context[length - 1 - m]:
            m += 1
        if m >= min_ngram:
            matches.append((m, e))
    matches.sort(reverse=True)
    return [(context[e : e + max_depth], m + e / length) for m, e in matches[:max_candidates]]


def test_is_a_drafter_without_features():
    drafter = NgramDrafter()
    assert isinstance(drafter, Drafter) and drafter.feature_layers == ()


def test_proposes_the_repeated_continuation_first():
    context = torch.tensor([9, 5, 6, 7, 8, 1, 2, 3, 4, 7, 2, 5, 6, 7])  # "5 6 7" was followed by "8 1 2"
    drafter = NgramDrafter()
    proposal = drafter.propose(context.tolist(), max_depth=3)
    assert proposal.continuations[0] == [8, 1, 2]
    tree = drafter.build(proposal, int(context[-1]), budget=3)
    assert tree.tokens.tolist() == [7, 8, 1, 2] and tree.parents.tolist() == [-1, 0, 1, 2]


def test_longer_match_beats_recency_and_counts_add_up():
    context = torch.tensor([1, 2, 3, 4, 3, 5, 3, 5, 2, 3])  # "2 3" → 4 once; "3" → 5 twice more recently
    drafter = NgramDrafter()
    proposal = drafter.propose(context.tolist(), max_depth=1)
    assert proposal.continuations == [[4], [5], [5]]
    tree = drafter.build(proposal, 3, budget=1)
    assert tree.tokens.tolist() == [3, 5]  # two short matches outweigh one long one in the trie


@pytest.mark.parametrize("context", [[1, 2, 3, 4, 5], [3], []])
def test_no_match_gives_a_root_only_tree(context):
    drafter = NgramDrafter()
    proposal = drafter.propose(context, max_depth=4)
    assert proposal.continuations == []
    assert drafter.build(proposal, 3, budget=8).num_nodes == 0


def test_min_ngram_ignores_short_matches():
    context = torch.tensor([4, 1, 2, 3, 1])  # only a 1-gram match
    assert NgramDrafter(min_ngram=2).propose(context.tolist(), max_depth=3).continuations == []
    assert NgramDrafter(min_ngram=1).propose(context.tolist(), max_depth=3).continuations == [[2, 3, 1]]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.integers(1, 5),
    st.integers(0, 20),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 6),
)
def test_matches_loop_and_builds_bounded_trees(context, max_depth, budget, max_ngram, min_ngram, max_candidates):
    min_ngram = min(min_ngram, max_ngram)
    drafter = NgramDrafter(max_ngram, min_ngram, max_candidates)
    proposal = drafter.propose(context, max_depth)
    expected = loop_lookup(context, max_depth, max_ngram, min_ngram, max_candidates)
    assert proposal.continuations == [c for c, _ in expected]
    assert proposal.weights == pytest.approx([w for _, w in expected])

    root = context[-1] if context else 0
    tree = drafter.build(proposal, root, budget)
    tree.validate()
    assert int(tree.tokens[0]) == root
    assert tree.num_nodes <= budget and tree.depth <= max_depth


@pytest.mark.parametrize("kwargs", [{"min_ngram": 0}, {"max_ngram": 2, "min_ngram": 3}, {"max_candidates": 0}])
def test_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        NgramDrafter(**kwargs)
