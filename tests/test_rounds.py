"""The round profiler (bench/rounds.py) and the counts it pins: host syncs and torch ops per decoding round.

A tiny Llama target with an untrained DFlash drafter (one layer, a draft vocabulary, corpus lookup off, suffix
trees on) runs the shipped default's round: dflash trees, TEV or greedy, B = 32 or `auto`. On CUDA each sync
drains the queue and each op is a launch, so a change that adds either to the round fails here.
"""

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.bench.rounds import ROUND_STAGES, count_rounds
from exitspec.budget import CostModel
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.target import TargetModel

VOCAB = 48
PROMPT = [3, 9, 4, 1, 7, 2, 6, 9, 4, 1, 7, 2, 6, 5]
MAX_SYNCS = 3  # a round's host reads with TEV and greedy (issue 36's goal)
MAX_OPS = 150  # torch ops a round outside the target's forward


def make_decoder() -> SpeculativeDecoder:
    model = tiny_llama(vocab_size=VOCAB, seed=3)
    torch.manual_seed(0)
    draft = DFlashModel.for_target(model.config, num_layers=1, block_size=8, std=0.5)
    draft.use_draft_vocab(torch.arange(0, VOCAB, 2))
    drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings())
    decoder = SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter, warm_start=False)
    decoder.costs[32] = CostModel([0, 32], [1.0, 1.0 + 0.02 * 32])  # tiny timings are flat in N: keep `auto` varied
    return decoder


@pytest.fixture(scope="module")
def decoder():
    return make_decoder()


@pytest.mark.parametrize("budget", [32, "auto"])
@pytest.mark.parametrize("verifier,temperature", [("tev", 0.0), ("tev", 1.0), ("greedy", 0.0)])
def test_a_round_reads_the_device_at_most_three_times(decoder, budget, verifier, temperature):
    counts, result = count_rounds(decoder, PROMPT, max_new_tokens=40, budget=budget, temperature=temperature,
                                  verifier=verifier, stop_tokens=(), learn=False)
    per_round = counts.per_round()
    assert result.rounds and counts.rounds == len(result.rounds)
    assert any(r.tree_size > 0 for r in result.rounds)
    assert per_round["syncs_total"] <= MAX_SYNCS, per_round["sites"]
    assert per_round["ops_outside_target"] <= MAX_OPS, per_round["ops"]
    assert per_round["ops"]["target"] > 0 and set(per_round["ops"]) == set(ROUND_STAGES)


def test_syncs_are_found_with_their_call_sites(decoder):
    """Predraw and sequential may read the device more often; the profiler names where."""
    counts, _ = count_rounds(decoder, PROMPT, max_new_tokens=24, budget=32, temperature=1.0, verifier="sequential",
                             stop_tokens=(), learn=False)
    sites = counts.per_round()["sites"]
    assert counts.per_round()["syncs_total"] > MAX_SYNCS
    assert any(s["site"].startswith("exitspec/verify.py:") and s["stage"] == "verify" for s in sites), sites
    assert all(s["stage"] in ROUND_STAGES for s in sites)


def test_counting_leaves_decoding_unchanged():
    """Two fresh decoders (calibration and `auto` learn as they go), the same seed: the same sample."""
    plain = make_decoder().generate(PROMPT, 30, temperature=1.0, budget=32, seed=4, stop_tokens=(), learn=False)
    _, counted = count_rounds(make_decoder(), PROMPT, max_new_tokens=30, temperature=1.0, budget=32, seed=4,
                              stop_tokens=(), learn=False)
    assert counted.tokens == plain.tokens
