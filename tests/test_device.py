"""The decode loop on a chosen device: the exit law, and greedy equality with the lean forward's own greedy loop.

Marked `cuda`: scripts/gpu-record.sh runs them with EXITSPEC_TEST_DEVICE=cuda on a lent GPU. In the suite
they run on the CPU (the default device), so they cannot rot.
"""

import os

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.check import g_test_pvalue
from exitspec.decode import SpeculativeDecoder, generate_autoregressive
from exitspec.drafters import DFlashDrafter, SuffixDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.target import TargetModel

pytestmark = pytest.mark.cuda
DEVICE = torch.device(os.environ.get("EXITSPEC_TEST_DEVICE", "cpu"))
VOCAB = 8
PROMPT = [2, 5, 3, 7, 2, 5]
DRAWS = 2000


def dflash_decoder(model, device: torch.device) -> SpeculativeDecoder:
    torch.manual_seed(0)
    draft = DFlashModel.for_target(model.config, num_layers=1, block_size=6, std=0.5)
    drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings(), device=device)
    return SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter, warm_start=False)


def test_the_first_two_tokens_follow_the_target_law_on_the_device():
    """TEV's decode loop on DEVICE: the joint law of the first two tokens, against the law enumerated in fp64."""
    model = tiny_llama(vocab_size=VOCAB, seed=3).to(DEVICE)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT], device=DEVICE)).logits[0, -1].double(), -1)  # [V]
        grown = torch.tensor([PROMPT + [t] for t in range(VOCAB)], device=DEVICE)
        second = torch.softmax(model(grown).logits[:, -1].double(), -1)  # [V, V]
    law = (first[:, None] * second).cpu()
    decoder = SpeculativeDecoder(TargetModel(model), SuffixDrafter(VOCAB), warm_start=False)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seed in range(DRAWS):
        out = decoder.generate(PROMPT, 2, temperature=1.0, budget=6, seed=seed, stop_tokens=(), learn=True)
        counts[tuple(out.tokens)] += 1
    assert g_test_pvalue(counts, law) > 1e-3


@pytest.mark.parametrize("budget", [8, "auto:8"])
def test_greedy_on_the_device_equals_the_lean_greedy_loop(budget):
    model = tiny_llama(vocab_size=VOCAB, seed=3).to(DEVICE)
    decoder = dflash_decoder(model, DEVICE)
    out = decoder.generate(PROMPT, 40, temperature=0.0, budget=budget, stop_tokens=())
    expected = generate_autoregressive(decoder.target, PROMPT, 40, stop_tokens=())  # under `auto`'s row plan
    assert out.tokens == expected.tokens and out.forward_config == expected.forward_config
    assert any(r.tree_size for r in out.rounds)
