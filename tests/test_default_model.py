"""The embedded default model (SmolLM2-135M-Instruct): greedy speculative decoding equals
`model.generate(do_sample=False)` token for token, for every verifier and budgets 1, 8 and 32 with the
n-gram drafter, and with the shipped DFlash drafter (the default) for the greedy and TEV verifiers."""

import pytest
import torch

from exitspec.decode import SpeculativeDecoder, encode_prompt
from exitspec.drafters import load_drafter
from exitspec.target import TargetModel

PROMPTS = [
    "What is 17 times 23? Think step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for sleeping better.",
    "Summarise the water cycle in one paragraph.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]
NEW_TOKENS = 64
# τ (tokens per round) below which the shipped DFlash drafter would be no better than no drafter at all
# (τ = 1); on these prompts the first DFlash drafter (no longer shipped) reached 1.38 at B = 8 and 1.60 at B = 32
TRAINED_DFLASH_MIN_TAU = 1.3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder.from_pretrained(None, "ngram", dtype="float32")  # transformers' generate matches fp32


@pytest.fixture(scope="module")
def dflash_decoder(decoder):
    """The shipped DFlash drafter on the same weights (its own target cache, tapping the drafter's layers)."""
    hf_model = decoder.target.model
    drafter = load_drafter("dflash", hf_model)
    return SpeculativeDecoder(TargetModel(hf_model, decoder.target.tokenizer, drafter.feature_layers), drafter)


@pytest.fixture(scope="module")
def references(decoder):
    """prompt → the target's own greedy continuation from transformers' generate."""
    refs = {}
    for prompt in PROMPTS:
        ids = torch.tensor([encode_prompt(decoder.target.tokenizer, prompt)])
        out = decoder.target.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        refs[prompt] = out[0, ids.shape[1] :].tolist()
    return refs


@pytest.mark.parametrize("budget", [1, 8, 32])
@pytest.mark.parametrize("verifier", ["greedy", "predraw", "sequential", "tev"])
def test_greedy_speculative_equals_generate(decoder, references, verifier, budget):
    for prompt in PROMPTS:
        out = decoder.generate(prompt, NEW_TOKENS, temperature=0.0, budget=budget, verifier=verifier)
        assert out.tokens == references[prompt], (prompt, verifier, budget)


@pytest.mark.parametrize("budget", [8, 32])
@pytest.mark.parametrize("verifier", ["greedy", "tev"])
def test_greedy_dflash_equals_generate(dflash_decoder, references, verifier, budget):
    accepted = rounds = 0
    for prompt in PROMPTS:
        out = dflash_decoder.generate(prompt, NEW_TOKENS, temperature=0.0, budget=budget, verifier=verifier)
        assert out.tokens == references[prompt], (prompt, verifier, budget)
        accepted, rounds = accepted + len(out.tokens), rounds + len(out.rounds)
    assert accepted / rounds > TRAINED_DFLASH_MIN_TAU, "the shipped drafter should get draft tokens accepted"


def test_custom_generate_equals_generate(decoder, references):
    """transformers' entry point on a model the user loaded: `model.generate(custom_generate=...)` picks the
    shipped DFlash drafter for the default model and gives transformers' greedy output, token for token."""
    from exitspec.hf import CUSTOM_GENERATE
    from exitspec.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(None)
    tokens = rounds = 0
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=CUSTOM_GENERATE,
                             trust_remote_code=True, return_dict_in_generate=True, budget=32, warm_start=False)
        assert out.sequences[0, ids.shape[1]:].tolist() == references[prompt], prompt
        tokens, rounds = tokens + sum(a + 1 for a in out.accepted_lengths), rounds + len(out.accepted_lengths)
    assert tokens / rounds > TRAINED_DFLASH_MIN_TAU, "the shipped drafter should get draft tokens accepted"


@pytest.mark.parametrize("dtype", ["bfloat16", "gguf"])
def test_greedy_equals_autoregressive_output_in_bf16_and_in_the_ggufs_own_blocks(dtype):
    """The default model in bf16 (the lean forward's batch-invariant attention on CPUs with native bf16, the
    quantized forward's bf16 weights elsewhere) and in its GGUF file's own Q4_1 blocks, with its shipped drafter:
    greedy speculative output equals the same target's own autoregressive output."""
    decoder = SpeculativeDecoder.from_pretrained(None, dtype=dtype)
    for prompt in PROMPTS[:3]:
        expected = decoder.autoregressive(prompt, max_new_tokens=NEW_TOKENS).tokens
        for budget in (8, 32, "auto"):
            out = decoder.generate(prompt, NEW_TOKENS, temperature=0.0, budget=budget, verifier="tev")
            assert out.tokens == expected, (prompt, budget)
