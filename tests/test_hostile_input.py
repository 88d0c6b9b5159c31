"""Property tests: random trees (valid or not) and random logits (with NaN, ±inf and masked entries) through
the library's checked entry points. Each call returns a correct result or raises InvalidTreeError /
ValueError with a message; any other exception is a bug."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exitspec.flow import tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.tree import DraftTree, InvalidTreeError
from exitspec.verify import DECIDERS, verify

VOCAB = 5
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf])
PARENT = st.one_of(st.integers(-3, 8), st.floats(-2, 8), SPECIAL)
TOKEN = st.integers(-2, VOCAB + 1)


@st.composite
def raw_trees(draw):
    """(parents, tokens): mostly valid trees, often broken ones (bad parents, tokens, lengths, dtypes)."""
    n = draw(st.integers(0, 7))
    if draw(st.booleans()):  # a valid shape: parents before children, distinct siblings (when lucky)
        parents = [-1] + [draw(st.integers(0, u - 1)) for u in range(1, n + 1)]
    else:
        parents = draw(st.lists(PARENT, min_size=n, max_size=n + 1))
    tokens = draw(st.lists(TOKEN, min_size=len(parents), max_size=len(parents) + draw(st.integers(0, 1))))
    return parents, tokens


@st.composite
def logit_rows(draw, n):
    """[n, VOCAB] logits: finite, then some entries masked to -inf, and sometimes a NaN or ±inf planted."""
    values = draw(st.lists(st.lists(st.floats(-20, 20), min_size=VOCAB, max_size=VOCAB), min_size=n, max_size=n))
    for row in values:
        for j in draw(st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB)):
            row[j] = -math.inf
    if n and draw(st.booleans()):
        values[draw(st.integers(0, n - 1))][draw(st.integers(0, VOCAB - 1))] = draw(SPECIAL)
    return values


def build(parents, tokens):
    try:
        return DraftTree.from_parents(parents, tokens, vocab_size=VOCAB)
    except InvalidTreeError:
        return None


@settings(max_examples=300, deadline=None)
@given(raw_trees())
def test_from_parents_accepts_valid_trees_and_names_the_rest(raw):
    parents, tokens = raw
    try:
        tree = DraftTree.from_parents(parents, tokens, vocab_size=VOCAB)
    except InvalidTreeError as e:
        assert str(e)
        return
    plist = tree.parents.tolist()
    assert plist[0] == -1 and all(0 <= p < u for u, p in enumerate(plist[1:], start=1))
    assert plist == list(parents) and tree.tokens.tolist() == list(tokens)
    edges = list(zip(plist[1:], tree.tokens.tolist()[1:], strict=True))
    assert len(set(edges)) == len(edges)


@settings(max_examples=200, deadline=None)
@given(raw_trees(), st.data())
def test_tree_flow_returns_the_exit_law_or_raises_value_error(raw, data):
    tree = build(*raw)
    if tree is None:
        return
    probs = torch.tensor(data.draw(logit_rows(tree.size)), dtype=torch.float64)
    if data.draw(st.booleans()):  # half the time, real probabilities (NaN where a row was all -inf)
        probs = torch.softmax(probs, dim=-1)
    try:
        flow = tree_flow(tree, probs)
    except ValueError as e:
        assert str(e)
        return
    assert abs(float(flow.exit.sum()) - 1.0) < 1e-6  # Eq. 4: the exits are a distribution
    assert bool((flow.reach >= 0).all() and (flow.reach <= 1 + 1e-9).all())


@settings(max_examples=200, deadline=None)
@given(raw_trees(), st.data(), st.sampled_from(sorted(DECIDERS)), st.sampled_from([0.0, 0.7, 1.0]))
def test_every_verifier_returns_a_valid_verdict_or_raises_value_error(raw, data, name, temperature):
    tree = build(*raw)
    if tree is None:
        return
    logits = torch.tensor(data.draw(logit_rows(data.draw(st.sampled_from([tree.size, tree.size, tree.size + 1])))))
    params = SamplingParams(temperature)
    try:
        verdict = verify(name, tree, logits, params, torch.Generator().manual_seed(0))
    except ValueError as e:  # InvalidTreeError is a ValueError
        assert str(e) and "\n" not in str(e)
        return
    probs = target_probs(logits, params)
    node = 0
    for u in verdict.path:  # a root path whose every edge the target can take
        assert tree.parent_list[u] == node and float(probs[node, tree.tokens[u]]) > 0
        node = u
    assert 0 <= verdict.bonus < VOCAB and float(probs[node, verdict.bonus]) > 0
    assert verdict.bonus not in tree.tokens[tree.children[node]].tolist()  # drawn from the residual
