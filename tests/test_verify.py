"""Statistical exactness of the verifiers: the joint law of (exit node, bonus token) is w(v)·p_res_v(y).

Each verifier runs ≥ 20k times on fixed random trees; a G-test compares the empirical joint law with the
exit law, and the mean output length is compared with 1 + C_p. A deliberately wrong verifier must fail.
"""

import pytest
import torch
from scipy.stats import power_divergence

from exitspec.flow import residual_probs, tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.tree import DraftTree
from exitspec.verify import DECIDERS, Verdict, _follow, check_verifier, decide_sequential, verify
from tests.random_trees import random_logits, random_tree

VOCAB = 6
DRAWS = 20_000
SAMPLED_VERIFIERS = ["predraw", "sequential", "tev"]


def exact_joint_law(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """[N+1, V] float64: probability of exiting at v with bonus y."""
    probs = probs.double()
    return tree_flow(tree, probs).exit[:, None] * residual_probs(tree, probs)


def empirical_counts(decide, tree, probs, seed: int, draws: int = DRAWS):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(tree.size, probs.shape[-1], dtype=torch.float64)
    lengths = torch.zeros(draws, dtype=torch.float64)
    for i in range(draws):
        verdict = decide(tree, probs, gen)
        counts[verdict.exit_node, verdict.bonus] += 1
        lengths[i] = len(verdict.path) + 1
    return counts, lengths


def g_test_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """G-test of counts against law; cells expected below 5 are pooled; an impossible outcome gives 0."""
    if bool((counts[law == 0] > 0).any()):
        return 0.0
    expected = law.flatten() * counts.sum()
    observed = counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big & (law.flatten() > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (law.flatten() > 0)].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(power_divergence(obs.numpy(), exp.numpy(), lambda_="log-likelihood").pvalue)


def law_cases():
    cases = []
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
        for seed in (11,):
            gen = torch.Generator().manual_seed(seed)
            tree = random_tree(gen, VOCAB, max_depth=5, max_branch=4, max_nodes=30)
            probs = target_probs(random_logits(gen, tree.size, VOCAB), params)
            cases.append(pytest.param(tree, probs, id=f"top_p={params.top_p}-seed={seed}"))
    return cases


@pytest.mark.parametrize("name", SAMPLED_VERIFIERS)
@pytest.mark.parametrize("tree,probs", law_cases())
def test_verifier_matches_exit_law(name, tree, probs):
    law = exact_joint_law(tree, probs)
    counts, lengths = empirical_counts(DECIDERS[name], tree, probs, seed=hash(name) % 1000)
    assert g_test_pvalue(counts, law) > 1e-3
    coverage = float(tree_flow(tree, probs.double()).coverage)
    std_err = float(lengths.std() / DRAWS**0.5)
    assert abs(float(lengths.mean()) - (1 + coverage)) < 3 * std_err + 1e-9


def test_sequential_law_does_not_depend_on_child_order():
    (tree, probs) = law_cases()[0].values
    reverse = lambda tree, probs, gen: decide_sequential(tree, probs, gen, child_order=lambda kids: kids[::-1])
    counts, _ = empirical_counts(reverse, tree, probs, seed=5)
    assert g_test_pvalue(counts, exact_joint_law(tree, probs)) > 1e-3


def test_wrong_verifier_is_caught():
    """Predraw-and-follow whose bonus comes from p_v instead of the residual: the test must reject it."""

    def bonus_from_full_distribution(tree, probs, gen):
        verdict = DECIDERS["predraw"](tree, probs, gen)
        return Verdict(verdict.path, int(torch.multinomial(probs[verdict.exit_node], 1, generator=gen)))

    (tree, probs) = law_cases()[0].values
    counts, _ = empirical_counts(bonus_from_full_distribution, tree, probs, seed=1)
    assert g_test_pvalue(counts, exact_joint_law(tree, probs)) < 1e-3


def test_greedy_follows_argmax_and_all_verifiers_agree_at_temperature_zero():
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(50):
        tree = random_tree(gen, VOCAB)
        logits = random_logits(gen, tree.size, VOCAB)
        expected = _follow(tree, logits.argmax(-1))
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
    (tree, probs) = law_cases()[1].values
    for name in SAMPLED_VERIFIERS:
        runs = [
            [DECIDERS[name](tree, probs, g) for _ in range(20)]
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
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[1, 3] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            verify("tev", tree, broken, SamplingParams())
    with pytest.raises(ValueError, match="tree has 3"):
        verify("tev", tree, torch.zeros(2, VOCAB), SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
