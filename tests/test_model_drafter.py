"""A small causal LM as a tree drafter (drafters/model.py): dynamic trees from a draft model's own KV cache,
verified exactly; `layers:K` shares the target's weights; a draft model of another tokenizer is refused."""

import pytest
import torch
from test_decode import PROMPT, VOCAB, exact_first_tokens_law
from tiny_models import save_tiny_llama, save_word_tokenizer, tiny_llama

from exitspec.app import load_decoders
from exitspec.check import g_test_pvalue
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters import load_drafter
from exitspec.drafters.model import ModelDrafter, first_layers
from exitspec.target import TargetModel

IDS = [2, 5, 3, 7, 2, 5, 9]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target and a smaller draft model of the same vocabulary, both with the word tokenizer."""
    root = tmp_path_factory.mktemp("models")
    save_tiny_llama(root / "target", vocab_size=32, seed=1)
    save_tiny_llama(root / "draft", vocab_size=32, seed=2, num_hidden_layers=1)
    for name in ("target", "draft"):
        save_word_tokenizer(root / name)
    return root


@pytest.mark.parametrize("spec", ["model:{root}/draft", "model:{root}/target", "layers:1"])
@pytest.mark.parametrize("budget", [6, 24, "auto"])
def test_greedy_output_equals_the_targets(folders, spec, budget):
    spec = spec.format(root=folders)
    decoder = load_decoders(folders / "target", [spec], warm_start=False)[spec]
    expected = decoder.target.model.generate(torch.tensor([IDS]), max_new_tokens=40, do_sample=False)[0, 7:].tolist()
    out = decoder.generate(IDS, 40, budget=budget, stop_tokens=())
    assert out.tokens == expected


def test_the_target_drafting_for_itself_reaches_the_ceiling():
    """Its own draft model at T = 0: the greedy path is in every tree, so nearly every block is depth + 1 long.
    (A model with peaked next-token distributions, as trained models have: with a tiny random model's flat ones the
    greedy path can rank below the frontier's best `children` nodes.)"""
    model = tiny_llama(seed=1, initializer_range=1.0)
    decoder = SpeculativeDecoder(TargetModel(model), ModelDrafter(model, "self"), warm_start=False)
    out = decoder.generate(IDS, 100, budget=48, stop_tokens=())
    full = [r.accepted for r in out.rounds[:-1]]  # the last round is cut at 100 tokens
    assert sum(full) / len(full) >= 5.5  # depth 6: blocks of up to 7


def test_sampling_keeps_the_target_law():
    model = tiny_llama(vocab_size=VOCAB, seed=3)
    drafter = ModelDrafter(first_layers(model, 1), "layers:1", children=3, depth=3)
    decoder = SpeculativeDecoder(TargetModel(model), drafter, warm_start=False)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    for seed in range(2500):
        out = decoder.generate(PROMPT, 3, 1.0, budget=6, seed=seed, stop_tokens=())
        counts[tuple(out.tokens)] += 1
    assert g_test_pvalue(counts, exact_first_tokens_law(model, PROMPT)) > 1e-3


def test_first_layers_share_the_targets_weights():
    model = tiny_llama(seed=1, num_hidden_layers=3)
    draft = first_layers(model, 2)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    shared = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in shared for p in draft.parameters())
    ids = torch.tensor([IDS])
    assert draft.generate(ids, max_new_tokens=5, do_sample=False).shape == (1, 12)  # a transformers model too


@pytest.mark.parametrize("spec,message", [
    ("layers:2", "the target has 2 decoder layers; take 1 to 1"),
    ("layers:x", "layers:K takes a number"),
    ("model:/no/such/folder", "is not a folder"),
])
def test_bad_draft_model_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        load_drafter(spec, tiny_llama())


def test_a_draft_model_of_another_tokenizer_is_refused(folders, tmp_path):
    save_tiny_llama(tmp_path / "wide", vocab_size=40, seed=2, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary of 40 tokens, the target 32"):
        load_decoders(folders / "target", [f"model:{tmp_path / 'wide'}"], budgets=())
    save_tiny_llama(tmp_path / "other", vocab_size=32, seed=2, num_hidden_layers=1)
    save_word_tokenizer(tmp_path / "other")
    tokenizer = tmp_path / "other" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"w0"', '"zz"'))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        load_decoders(folders / "target", [f"model:{tmp_path / 'other'}"], budgets=())
