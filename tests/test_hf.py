"""exitspec from transformers: a loaded model's weights used in place (`from_model`), and
`model.generate(custom_generate=exitspec.hf.CUSTOM_GENERATE)`: greedy output equal to transformers', the
sampling law kept, and every setting it cannot honour refused in one line."""

import pytest
import torch
from test_decode import PROMPT, VOCAB, exact_first_tokens_law
from tiny_models import tiny_causal_lm, tiny_llama
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

import exitspec.hf
from exitspec.app import load_decoders
from exitspec.check import g_test_pvalue
from exitspec.decode import SpeculativeDecoder

HF = {"custom_generate": exitspec.hf.CUSTOM_GENERATE, "trust_remote_code": True, "warm_start": False}
MODELS = {"llama": (LlamaConfig, {}), "qwen2": (Qwen2Config, {}), "qwen3": (Qwen3Config, {"head_dim": 8})}


def repetitive(config_cls, **extra):
    """A tiny model whose greedy output falls into a loop, so that drafted tokens get accepted."""
    return tiny_causal_lm(config_cls, 32, 1, **extra)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("drafter,budget", [("ngram", "auto"), ("suffix", 8)])
def test_greedy_custom_generate_equals_model_generate(name, drafter, budget):
    config_cls, extra = MODELS[name]
    model = repetitive(config_cls, **extra)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5, 9]])
    expected = model.generate(ids, max_new_tokens=40, do_sample=False)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, drafter=drafter, budget=budget, **HF)
    assert out.tolist() == expected.tolist()


def test_stop_tokens_length_and_dict_output_follow_the_generation_config():
    model = repetitive(LlamaConfig)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5, 9]])
    greedy = model.generate(ids, max_new_tokens=30, do_sample=False)[0, 7:].tolist()
    stop = greedy[11]
    for kwargs in ({"max_new_tokens": 30, "eos_token_id": stop}, {"max_length": 15}):
        expected = model.generate(ids, do_sample=False, **kwargs)
        assert model.generate(ids, do_sample=False, drafter="ngram", **HF, **kwargs).tolist() == expected.tolist()
    out = model.generate(ids, max_new_tokens=30, drafter="ngram", return_dict_in_generate=True, **HF)
    assert isinstance(out, exitspec.hf.ExitspecGenerateOutput)
    assert out.sequences[0, 7:].tolist() == greedy and out.tau >= 1 and len(out.tree_sizes) == len(out.accepted_lengths)


def test_streamer_sees_the_prompt_then_every_new_token():
    model = repetitive(LlamaConfig)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5, 9]])

    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = model.generate(ids, max_new_tokens=25, do_sample=False, drafter="ngram", streamer=streamer, **HF)
    assert streamer.parts[0] == ids[0].tolist() and streamer.ended
    assert [t for part in streamer.parts[1:] for t in part] == out[0, 7:].tolist()


def test_sampling_through_custom_generate_keeps_the_target_law():
    """do_sample=True, temperature 1 (top_k 50 > V leaves the law alone): the first three tokens of 2500 seeded
    runs follow the target's law; the seeds come from torch's global generator, as in transformers."""
    model = tiny_llama(vocab_size=VOCAB, seed=3)
    torch.manual_seed(0)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    ids = torch.tensor([PROMPT])
    for _ in range(2500):
        out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=1.0, eos_token_id=None,
                             drafter="suffix", budget=6, **HF)
        counts[tuple(out[0, len(PROMPT):].tolist())] += 1
    assert g_test_pvalue(counts, exact_first_tokens_law(model, PROMPT)) > 1e-3


@pytest.mark.parametrize("kwargs,message", [
    ({"num_beams": 3}, "generation_config.num_beams=3"),
    ({"repetition_penalty": 1.2}, "generation_config.repetition_penalty=1.2"),
    ({"colour": "red"}, "does not know the argument(s) colour"),
    ({"verifier": "nope"}, "verifier"),
    ({"logits_processor": [lambda ids, scores: scores]}, "does not take logits_processor"),
])
def test_what_custom_generate_cannot_honour_is_refused_in_one_line(kwargs, message):
    model = repetitive(LlamaConfig)
    with pytest.raises(ValueError, match=None) as err:
        model.generate(torch.tensor([[2, 5, 3]]), max_new_tokens=5, drafter="ngram", **HF, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_batch_is_refused_naming_the_limit():
    model = repetitive(LlamaConfig)
    with pytest.raises(ValueError, match="one sequence at a time: input_ids must be \\[1, L\\], got \\[2, 3\\]"):
        model.generate(torch.tensor([[2, 5, 3], [2, 5, 4]]), max_new_tokens=5, drafter="ngram", **HF)


def test_from_model_uses_the_models_weights_in_place():
    """No second copy: every weight the decoder's target multiplies by lies in the model's own parameter storage,
    the row plan lays out no copies, and model.generate still gives the same output afterwards."""
    model = repetitive(LlamaConfig)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5, 9]])
    before = model.generate(ids, max_new_tokens=20, do_sample=False)
    storage_bytes = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p
                                                                for p in model.parameters()}.values())
    decoder = SpeculativeDecoder.from_model(model, drafter="ngram", warm_start=False)
    out = decoder.generate(ids[0], 20, budget="auto", stop_tokens=())
    assert all(layout == "whole" for _, layout in decoder.target.row_plan.values())
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    assert sum(p.untyped_storage().nbytes() for p in params.values()) == storage_bytes
    assert model.generate(ids, max_new_tokens=20, do_sample=False).tolist() == before.tolist()
    assert out.tokens == before[0, 7:].tolist()


def test_from_model_refuses_another_device_or_dtype():
    model = repetitive(LlamaConfig)
    with pytest.raises(ValueError, match="the model is in torch.float32, not in bfloat16"):
        load_decoders(model, ["ngram"], dtype="bfloat16", budgets=())
