"""The warped target distribution (temperature, top-k, top-p) and the row sampler."""

import pytest
import torch
from scipy.stats import power_divergence
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from exitspec.sampling import SamplingParams, _nucleus, sample_rows, target_probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0),
        SamplingParams(0.6),
        SamplingParams(1.0, top_p=0.9),
        SamplingParams(0.7, top_k=20, top_p=0.8),
    ],
)
def test_matches_transformers_warpers(params):
    logits = 3 * torch.randn(8, 500, generator=torch.Generator().manual_seed(0))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    expected = torch.softmax(warpers(None, logits.clone()), dim=-1)
    assert torch.allclose(target_probs(logits, params), expected, atol=1e-6)


def test_greedy_is_one_hot_on_first_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert target_probs(logits, SamplingParams(temperature=0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_topk_shortcut_for_nucleus_equals_full_sort():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(64, 300, generator=gen) * torch.rand(64, 1, generator=gen) * 6, dim=-1)
    for top_p in (0.3, 0.9, 0.99):
        assert torch.allclose(_nucleus(probs, top_p, candidates=(4, 16)), _nucleus(probs, top_p, candidates=()))


def test_sample_rows_follows_the_distribution_and_never_draws_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    draws = sample_rows(probs.expand(50_000, -1) * 3.0, torch.Generator().manual_seed(0))  # unnormalised rows
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    expected = (probs[support].double() * 50_000).numpy()
    assert power_divergence(counts[support].numpy(), expected, lambda_="log-likelihood").pvalue > 1e-3


def test_non_finite_logits_are_rejected_and_masked_ones_kept():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"logits row \(1,\) holds NaN or \+inf"):
            target_probs(torch.tensor([[0.0, 1.0], [bad, 0.0]]), SamplingParams())
    with pytest.raises(ValueError, match=r"row \(0,\) .* only -inf"):
        target_probs(torch.full((1, 3), float("-inf")), SamplingParams())
    masked = target_probs(torch.tensor([[0.0, float("-inf"), 0.0]]), SamplingParams())
    torch.testing.assert_close(masked, torch.tensor([[0.5, 0.0, 0.5]]))
