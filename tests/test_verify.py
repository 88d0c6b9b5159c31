"""Statistical exactness of the verifiers: the joint law of (exit node, bonus token) is w(v)·p_res_v(y).

Each verifier runs 20k times on fixed random trees (depth ≤ 5, branching ≤ 4, vocabulary 6) at temperature 1
and with top-p 0.9; a G-test compares the empirical joint law with the exit law and the mean output length
is compared with 1 + C_p. A deliberately wrong verifier must fail the same check.
"""

import pytest
import torch

from exitspec.check import (
    check_law,
    exact_joint_law,
    g_test_pvalue,
    law_case,
    random_logits,
    random_tree,
    sample_verdicts,
)
from exitspec.flow import row_flow, tree_flow
from exitspec.sampling import SamplingParams, WarpedRows, target_probs
from exitspec.tree import DraftTree, InvalidTreeError
from exitspec.verify import (
    DECIDERS,
    Decision,
    _follow,
    check_verifier,
    decide_predraw,
    decide_sequential,
    decide_tev,
    verify,
)

VOCAB = 6
DRAWS = 20_000
LAW_PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)]


@pytest.mark.parametrize("name", ["predraw", "sequential", "tev"])
@pytest.mark.parametrize("params", LAW_PARAMS, ids=["t1", "top_p0.9"])
def test_verifier_matches_exit_law(name, params):
    tree, probs = law_case(12, params)
    assert tree.depth == 5 and max(len(kids) for kids in tree.children) == 4
    result = check_law(name, DECIDERS[name], tree, probs, params, DRAWS, seed=3)
    assert result.p_value > 1e-3, result
    assert abs(result.mean_length - result.expected_length) < 3 * result.std_err, result


@pytest.mark.parametrize("params", LAW_PARAMS, ids=["t1", "top_p0.9"])
@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "filter-path"])
def test_tev_on_lazily_warped_rows_matches_exit_law(params, filtered):
    """TEV on rows warped from logits, as the decode loop has them, keeps the law: probs enter as log-probs, which
    the plain warp turns back into the same distribution (zeros become masked -inf entries). top_k = V filters
    nothing but takes the path of a filtered warp (whole rows warped, then read)."""
    tree, probs = law_case(12, params)
    warp = SamplingParams(1.0, top_k=probs.shape[-1] if filtered else 0)

    def lean(tree, warped, gen):
        rows = WarpedRows(warped.logits, warp, check=False)
        assert rows.plain != filtered
        return decide_tev(tree, rows, gen)

    result = check_law("tev-rows", lean, tree, probs, params, DRAWS, seed=4)
    assert result.p_value > 1e-3 and abs(result.mean_length - result.expected_length) < 3 * result.std_err, result


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
                                    SamplingParams(0.0)], ids=["t1", "topk", "topp", "greedy"])
def test_parent_rows_give_the_full_flow(params):
    """row_flow reads only the parents' rows and gets tree_flow's exit law on all of them: NaN in every leaf's
    row changes nothing."""
    g = torch.Generator().manual_seed(1)
    for seed in range(5):
        tree, _ = law_case(seed, params, vocab=40)
        logits = torch.randn(tree.size, 40, generator=g) * 3
        full = tree_flow(tree, target_probs(logits, params))
        leaves = [u for u, kids in enumerate(tree.children) if not kids]
        logits[leaves] = float("nan")
        lean = row_flow(tree, WarpedRows(logits, params, check=False))
        for name in ("edge", "reach", "rho", "exit", "coverage"):
            torch.testing.assert_close(getattr(lean, name), getattr(full, name))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_parent_rows_refuse_a_bad_parent_row(bad):
    """Checked rows refuse NaN or +inf in a parent's row before any edge is read."""
    tree, _ = law_case(3, SamplingParams(1.0), vocab=40)
    logits = torch.randn(tree.size, 40)
    logits[int(tree.parents[1]), 7] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        row_flow(tree, WarpedRows(logits, SamplingParams(1.0)))


def test_sequential_law_does_not_depend_on_child_order():
    tree, probs = law_case(12, LAW_PARAMS[0])

    def reverse(tree, rows, gen):
        return decide_sequential(tree, rows, gen, child_order=lambda kids: kids[::-1])

    assert check_law("sequential-reversed", reverse, tree, probs, LAW_PARAMS[0], DRAWS, seed=5).passed


def test_wrong_verifier_is_caught():
    """Predraw-and-follow whose bonus comes from p_v instead of the residual must fail the G-test."""

    def bonus_from_full_distribution(tree, rows, gen):
        decision = decide_predraw(tree, rows, gen)
        bonus = torch.multinomial(rows.all()[decision.exit_node], 1, generator=gen)[0]
        return Decision(decision.exit_node, bonus, decision.drawable, decision.flow)

    tree, probs = law_case(12, LAW_PARAMS[0])
    counts, _ = sample_verdicts(bonus_from_full_distribution, tree, probs, seed=1, draws=DRAWS)
    assert g_test_pvalue(counts, exact_joint_law(tree, probs)) < 1e-3


def test_g_test_agrees_with_scipy():
    from scipy.stats import power_divergence

    law = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    counts = torch.tensor([480.0, 330.0, 190.0], dtype=torch.float64)
    expected = power_divergence(counts.numpy(), (law * 1000).numpy(), lambda_="log-likelihood").pvalue
    assert abs(g_test_pvalue(counts, law) - expected) < 1e-9


def test_greedy_follows_argmax_and_all_verifiers_agree_at_temperature_zero():
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(50):
        tree = random_tree(gen, VOCAB)
        logits = random_logits(gen, tree.size, VOCAB)
        expected = _follow(tree, logits.argmax(-1)).read(tree, None, None)
        for name in DECIDERS:
            assert verify(name, tree, logits, greedy, gen) == expected


def test_greedy_accepts_a_matching_chain_fully():
    logits = torch.full((4, VOCAB), -5.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 5] = 5.0
    tree = DraftTree.chain(0, [2, 3, 1])
    verdict = verify("greedy", tree, logits, SamplingParams(temperature=0.0))
    assert verdict.path == [1, 2, 3] and verdict.bonus == 5
    assert verdict.output_tokens(tree) == [2, 3, 1, 5]


def test_seeded_verifiers_are_reproducible():
    tree, probs = law_case(12, LAW_PARAMS[1])
    rows = WarpedRows.of_probs(probs)
    for name in ["predraw", "sequential", "tev"]:
        runs = [
            [DECIDERS[name](tree, rows, g).read(tree, rows, g) for _ in range(20)]
            for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
        ]
        assert runs[0] == runs[1]


def test_bad_inputs_raise_clear_errors():
    tree = DraftTree.chain(0, [1, 2])
    logits = torch.zeros(3, VOCAB)
    with pytest.raises(ValueError, match="unknown verifier 'magic'"):
        verify("magic", tree, logits, SamplingParams())
    with pytest.raises(ValueError, match="temperature 0"):
        check_verifier("greedy", SamplingParams(temperature=1.0))
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[1, 3] = bad
        with pytest.raises(ValueError, match=r"row \(1,\) holds NaN or \+inf"):
            verify("tev", tree, broken, SamplingParams())
    with pytest.raises(ValueError, match="only -inf"):
        verify("tev", tree, logits.index_fill(0, torch.tensor([2]), float("-inf")), SamplingParams())
    with pytest.raises(ValueError, match=r"\[N\+1, V\] = \[3, V\]"):
        verify("tev", tree, torch.zeros(2, VOCAB), SamplingParams())
    with pytest.raises(ValueError, match=r"got shape \(6,\)"):
        verify("tev", tree, torch.zeros(VOCAB), SamplingParams())
    with pytest.raises(InvalidTreeError, match="token 2 outside the vocabulary \\[0, 2\\)"):
        verify("tev", tree, torch.zeros(3, 2), SamplingParams())


def test_masked_logits_are_verified_exactly():
    """-inf entries (a banned token, a masked vocabulary) are legitimate: the banned token is never emitted."""
    tree = DraftTree.chain(0, [1, 2])
    logits = torch.zeros(3, VOCAB)
    logits[:, 1] = float("-inf")  # the drafted token 1 is banned everywhere
    gen = torch.Generator().manual_seed(0)
    for name in ("predraw", "sequential", "tev"):
        for _ in range(200):
            verdict = verify(name, tree, logits, SamplingParams(), gen)
            assert verdict.path == [] and verdict.bonus != 1
    greedy = verify("greedy", tree, logits, SamplingParams(temperature=0.0))
    assert greedy.path == [] and greedy.bonus == 0
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
