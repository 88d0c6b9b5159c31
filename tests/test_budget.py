"""`--budget auto`: parsing, the cost model, the tree-size rule, the estimates of P(u) and the merge of sources."""

from __future__ import annotations

import itertools
import json
import math

import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama

from exitspec.budget import EXPLORE_EVERY, AutoBudget, CostModel, best_size, other_load
from exitspec.build import build_trie, merge_best_first
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters import NgramDrafter
from exitspec.estimates import ReachEstimator, model_bins, model_estimator
from exitspec.sampling import SamplingParams
from exitspec.settings import budget_cap, parse_budget
from exitspec.target import TargetModel
from exitspec.tree import DraftTree


def test_parse_budget():
    assert parse_budget("auto") == "auto:32" and parse_budget("AUTO:8") == "auto:8"
    assert parse_budget("16") == 16 and parse_budget(0) == 0
    assert budget_cap("auto:8") == 8 and budget_cap(16) == 16
    for bad in ("auto:", "auto:-1", "-3", "lots", "1.5"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_cost_model_interpolates_and_follows_measurements():
    cost = CostModel([0, 4, 16], [1.0, 1.2, 2.4])
    assert cost(0) == 1.0 and cost(2) == pytest.approx(1.1) and cost(10) == pytest.approx(1.8)
    assert cost(28) == pytest.approx(3.6)  # the last segment's slope, extended
    for _ in range(200):
        cost.update(4, 2.4)  # the machine is twice as slow as measured
    assert cost.ratio == pytest.approx(2.0) and cost(16) == pytest.approx(4.8)


def test_a_tree_runs_on_the_rows_of_a_cheaper_bigger_size():
    # 2 draft tokens measured dearer than 3 (a BLAS slow at that row count), 1 barely dearer than 3: only 2 pads
    cost = CostModel([0, 1, 2, 3, 4], [1.0, 1.5, 2.0, 1.52, 2.5])
    assert cost.padded == [0, 1, 3, 3, 4] and cost.row_plan() == {3: (4, "whole")}  # rows = N + 1
    panels = CostModel([0, 1, 2], [1.0, 2.0, 1.8], layouts=["whole", "whole", "panels"])
    assert panels.row_plan() == {2: (3, "panels"), 3: (3, "panels")}  # 1 draft token runs as 2, in panels
    assert cost(2) == cost(3) == pytest.approx(1.52) and cost(1) == 1.5


def test_best_size_maximises_expected_tokens_per_second():
    cost = CostModel([0, 10], [1.0, 2.0])  # each node costs a tenth of a step
    scores = (1.0, 0.9, 0.8, 0.3, 0.05, 0.01)
    rates = [(1 + sum(scores[1 : n + 1])) / (cost(n) + 0.1) for n in range(6)]
    assert best_size(scores, cost, 0.1, cap=5) == max(range(6), key=rates.__getitem__) == 3
    assert best_size(scores, cost, 0.1, cap=2) == 2
    assert best_size((1.0, 0.01, 0.001), cost, 0.0, cap=8) == 0  # not worth a node: a plain step
    assert best_size(scores, CostModel([0, 10], [1.0, 1.0]), 0.1, cap=5) == 5  # free nodes: take them all


def test_cost_model_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(CostModel, "agrees_with", lambda self, target: True)  # the spot check has its own test
    monkeypatch.setattr(CostModel, "trustworthy", lambda self: None)  # and so has the load check
    target = TargetModel(tiny_llama(32))
    first = CostModel.cached(target, 8)
    assert first.sizes == list(range(9)) and all(s > 0 for s in first.seconds)
    assert target.cache_len == 0 and target.row_plan == {}  # the measurement leaves the target as it was
    assert len(first.layouts) == len(first.sizes) and set(first.layouts) <= {"whole", "panels", "packed"}
    assert {"measured_at", "other_load", "spread"} <= first.info.keys()  # when, and under what load
    (path,) = (tmp_path / "costs").iterdir()
    path.write_text(json.dumps({"sizes": [0, 8], "seconds": [1.0, 2.0], "layouts": ["whole", "packed"]}))
    again = CostModel.cached(target, 8)  # read back, not re-measured
    assert again.seconds == [1.0, 2.0] and again.row_plan() == {9: (9, "packed")}
    assert CostModel.cached(target, 4).sizes == [0, 1, 2, 3, 4]  # another cap is another entry
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="damaged cost grid"):
        assert CostModel.cached(target, 8).sizes == list(range(9))  # measured again and replaced
    assert json.loads(path.read_text())["sizes"] == list(range(9))


def test_a_grid_measured_under_load_or_with_disagreeing_repeats_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    target = TargetModel(tiny_llama(32))
    busy = CostModel([0, 1], [1.0, 1.1], info={"other_load": 0.6, "spread": 0.01})
    noisy = CostModel([0, 1], [1.0, 1.1], info={"other_load": 0.0, "spread": 0.5})
    assert "60%" in busy.trustworthy() and "disagreed" in noisy.trustworthy()
    assert CostModel([0, 1], [1.0, 1.1], info={"other_load": 0.02, "spread": 0.03}).trustworthy() is None
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, target, max_size: busy))
    with pytest.warns(UserWarning, match="not cached"):
        assert CostModel.cached(target, 8) is busy  # used for this run ...
    assert not (tmp_path / "costs").exists()  # ... never cached


def test_other_load_sees_another_process(monkeypatch):
    with other_load() as quiet:
        sum(range(200_000))
    assert 0.0 <= quiet["other"] <= 1.0
    fake = iter([psutil.cpu_times(), psutil.cpu_times()._replace(user=psutil.cpu_times().user + 10.0)])
    monkeypatch.setattr(psutil, "cpu_times", lambda: next(fake))  # 10 CPU-seconds of someone else's work
    with other_load() as busy:
        pass
    assert busy["other"] == 1.0


def test_a_poisoned_cost_cache_is_caught_and_measured_again(tmp_path, monkeypatch):
    """A cost file with 3x inflated costs for N >= 2 (what a busy first run once cached) fails the spot check
    and is replaced, so `auto` trees grow as with a clean cache: the mean N over 128 tokens reaches at least
    80% of a clean-cache run's."""
    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(CostModel, "trustworthy", lambda self: None)  # cached even while other tests run
    model = tiny_llama(48, max_position_embeddings=512)
    text = [5, 6, 7, 8, 9, 10, 11, 12] * 12  # a prompt that repeats: prompt lookup drafts long chains

    def mean_n() -> float:
        decoder = SpeculativeDecoder(TargetModel(model), NgramDrafter())
        result = decoder.generate(text, max_new_tokens=128, budget="auto:16", stop_tokens=())
        return sum(result.summary()["tree_sizes"]) / len(result.rounds)

    clean = mean_n()
    (path,) = (tmp_path / "costs").iterdir()
    grid = json.loads(path.read_text())
    grid["seconds"] = [s * (3.0 if n >= 2 else 1.0) for n, s in zip(grid["sizes"], grid["seconds"])]
    path.write_text(json.dumps(grid))
    with pytest.warns(UserWarning, match="disagrees"):
        poisoned = mean_n()
    assert poisoned >= 0.8 * clean and clean > 2
    assert json.loads(path.read_text())["seconds"] != grid["seconds"]  # replaced by a fresh measurement


def test_auto_budget_tries_both_kinds_then_prefers_the_faster_and_keeps_exploring():
    auto = AutoBudget(CostModel([0, 8], [1.0, 2.0]), cap=8)
    assert auto.cheap_round() is False
    auto.record(False, 4, 0.5, 1.5, coverage=0.2)  # full drafting: 1.2 tokens in 2 s
    assert auto.cheap_round() is True
    auto.record(True, 2, 0.0, 1.2, coverage=0.6)  # cheap: 1.6 tokens in 1.2 s

    def play(rounds, full_outcome) -> list[int]:
        """Plays rounds (cheap ones realise 1.6 tokens in 1.2 s); returns those that drafted in full."""
        full = []
        for round_no in rounds:
            cheap = auto.cheap_round()
            full += [] if cheap else [round_no]
            auto.record(cheap, 2, 0.0, 1.2, 0.6) if cheap else auto.record(False, 4, *full_outcome)
        return full

    # the slower kind is retried after 8 rounds, then 16, 32, 64: the wait doubles while it stays slower
    assert play(range(2, 200), (0.5, 1.5, 0.2)) == [7, 23, 55, 119]
    # once full drafting pays (6.7 tokens/s), its next try wins: it drafts from then on, cheap is retried after 8
    assert play(range(200, 260), (0.1, 0.5, 3.0)) == [*range(247, 255), *range(256, 260)]
    assert auto.explore_every == 2 * EXPLORE_EVERY


def test_estimator_learns_realised_reach_and_stays_monotone():
    estimator = model_estimator()
    assert estimator.estimate(model_bins([1.0, 0.5]))[0] == pytest.approx(0.5 * math.exp(-0.25))  # prior: q / 2
    bins = model_bins([0.9, 0.3])
    for _ in range(300):
        estimator.observe(bins, [0.2, 0.6])  # overconfident at the top, underconfident below
    high, low = estimator.estimate(bins)
    assert high == pytest.approx(0.2, abs=0.02) and low == pytest.approx(0.2, abs=0.02)  # capped by its better bin
    table = estimator.table()
    assert all(a >= b for a, b in itertools.pairwise(table))


def test_estimator_shrinks_to_its_prior():
    estimator = ReachEstimator(torch.tensor([[0.5]]), prior_weight=4.0, decay=0.5)
    estimator.observe([0, 0, 0], [1.0, 1.0, 1.0])
    seen = 1.0 + 0.5 + 0.25  # decayed count (and mass) of the three nodes
    assert estimator.estimate([0]) == [pytest.approx((seen + 4.0 * 0.5) / (seen + 4.0))]


def test_estimates_are_learned_per_sampling_setting():
    """What the target accepts at T = 0 says little about T = 1: each setting learns its own estimates, and
    returning to a setting finds what it learned, unchanged by the other's rounds; unobserved (NaN) nodes teach
    nothing."""
    drafter = NgramDrafter()
    context = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3])  # repeats itself: the trie proposes 4, 1, 2, ...
    greedy, sampled = SamplingParams(0.0), SamplingParams(1.0)

    def first_estimate(setting) -> float:
        drafter.estimate_for(setting)
        return drafter.build(drafter.propose(context.tolist(), 4), 3, 4).scores[1]

    prior = first_estimate(greedy)
    assert first_estimate(sampled) == prior
    for reach in (1.0, 1.0, 1.0, float("nan")):
        tree = drafter.build(drafter.propose(context.tolist(), 4), 3, 4)
        drafter.observe(tree, [1.0] + [reach] * tree.num_nodes)  # sampled: every node accepted
    learned = first_estimate(sampled)
    assert learned > prior and first_estimate(greedy) == prior and first_estimate(sampled) == learned


trees = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(a=trees, b=trees, wa=st.lists(st.floats(0.01, 10), min_size=8, max_size=8),
       wb=st.lists(st.floats(0.01, 10), min_size=8, max_size=8), budget=st.integers(0, 12))
def test_merged_trees_are_best_first_prefix_closed_and_take_the_larger_estimate(a, b, wa, wb, budget):
    sources = []
    for continuations, weights in ((a, wa), (b, wb)):
        tree = build_trie(9, continuations, weights[: len(continuations)], 64)
        sources.append((tree, list(tree.scores)))
    merged, origins = merge_best_first(9, sources, budget)
    merged.validate()
    assert merged.num_nodes <= budget and list(merged.scores) == sorted(merged.scores, reverse=True)
    for u in range(1, merged.size):
        path = tuple(int(merged.tokens[v]) for v in merged.path(u))
        proposed = [s for s, (tree, est) in enumerate(sources) for v in range(1, tree.size)
                    if tuple(int(tree.tokens[w]) for w in tree.path(v)) == path]
        assert sorted(s for s, _ in origins[u]) == sorted(proposed)
        parent = merged.scores[int(merged.parents[u])]
        best = max(sources[s][1][v] for s, v in origins[u])
        assert merged.scores[u] == pytest.approx(min(best, parent))
    union = {tuple(int(t.tokens[w]) for w in t.path(v)) for t, _ in sources for v in range(1, t.size)}
    assert merged.num_nodes == min(budget, len(union))


def test_head_keeps_a_tree():
    tree = DraftTree.from_parents([-1, 0, 0, 1, 2], [5, 1, 2, 3, 4])
    head = tree.head(3)
    assert head.parents.tolist() == [-1, 0, 0] and head.tokens.tolist() == [5, 1, 2]
    assert tree.head(10) is tree
    with pytest.raises(ValueError, match="at least its root"):
        tree.head(0)
