"""The lean Llama-family forward equals transformers' forward (logits, feature taps, cache) to fp32 rounding."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from test_target import ATOL, V, assert_tree_logits, random_tree
from tiny_models import tiny_causal_lm, tiny_llama
from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config, Qwen3Config

from exitspec import lean
from exitspec.lean import LeanLlama, supports
from exitspec.target import TargetModel, TransformersForward


def models():
    yield "llama", tiny_llama(V)
    yield "llama-head-dim", tiny_llama(V, head_dim=16, rope_theta=500.0)  # head_dim != hidden / heads
    yield "qwen2 (qkv bias)", tiny_causal_lm(Qwen2Config, V)
    yield "qwen3 (q/k norm)", tiny_causal_lm(Qwen3Config, V, head_dim=8)


@pytest.mark.parametrize("name,model", list(models()), ids=lambda x: x if isinstance(x, str) else "")
def test_lean_matches_transformers(name, model):
    if name.startswith("qwen2"):  # random biases, so that a dropped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    assert supports(model) is None
    rng = random.Random(0)
    layers = (1, 0)
    prefix = [rng.randrange(V) for _ in range(9)]
    lean = TargetModel(model, feature_layers=layers, backend="lean")
    reference = TargetModel(model, feature_layers=layers, backend="transformers")
    assert isinstance(lean.backend, LeanLlama) and isinstance(reference.backend, TransformersForward)
    for target in (lean, reference):
        target.prefill(torch.tensor(prefix))
    for k in range(3):
        tree = random_tree(rng, root=rng.randrange(V))
        out, ref = lean.forward_tree(tree), reference.forward_tree(tree)
        assert_tree_logits(model, out, prefix, tree)
        torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(out.features, ref.features, atol=ATOL, rtol=ATOL)
        path = tree.path(rng.randrange(tree.size))
        for target in (lean, reference):
            target.commit(tree, path)
        prefix += [int(tree.tokens[0])] + [int(tree.tokens[u]) for u in path]
        for i in range(model.config.num_hidden_layers):
            for mine, theirs in zip(lean.kv(i), reference.kv(i)):
                torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("layout", ["whole", "panels", "packed"])
def test_a_row_plan_changes_nothing_but_rounding(layout, monkeypatch):
    """Weight products run on more rows (zeros appended), whole, in panels of a few output rows or packed for
    oneDNN, give the same logits, features and cache."""
    monkeypatch.setattr(lean, "PANEL_ROWS", 5)
    model = tiny_llama(V)
    rng = random.Random(1)
    prefix = torch.tensor([rng.randrange(V) for _ in range(5)])
    plain, planned = (TargetModel(model, feature_layers=(0,), backend="lean") for _ in range(2))
    assert planned.use_row_plan({n: (n + 3 * (n % 2), layout) for n in range(1, 40)})
    for target in (plain, planned):
        target.prefill(prefix)
    for _ in range(3):
        tree = random_tree(rng, root=rng.randrange(V))
        out, ref = planned.forward_tree(tree), plain.forward_tree(tree)
        torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(out.features, ref.features, atol=ATOL, rtol=ATOL)
        path = tree.path(rng.randrange(tree.size))
        for target in (plain, planned):
            target.commit(tree, path)
    torch.testing.assert_close(planned.kv(1)[0], plain.kv(1)[0], atol=ATOL, rtol=ATOL)
    assert set(planned.backend.layouts) == ({layout} - {"whole"})  # a layout's copy exists while the plan uses it
    other = TargetModel(model, backend="lean")  # a second target over the same weights, with the same plan ...
    assert other.use_row_plan(planned.row_plan) and other.row_plan == planned.row_plan
    assert other.backend.layouts == planned.backend.layouts  # ... shares the one copy of the weights in that layout
    assert all(a is b for a, b in zip(other.backend.layouts.values(), planned.backend.layouts.values()))
    planned.use_row_plan({})
    assert planned.backend.layouts == {}


def test_packed_weights_multiply_like_f_linear():
    weight, bias = torch.randn(10, 6), torch.randn(10)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(lean.Packed(weight)(x), F.linear(x, weight))
        torch.testing.assert_close(lean.Packed(weight)(x, bias), F.linear(x, weight, bias))


def test_panels_multiply_like_f_linear(monkeypatch):
    """Full panels and a last partial one (10 output rows in panels of 4), with and without a bias."""
    monkeypatch.setattr(lean, "PANEL_ROWS", 4)
    weight, bias = torch.randn(10, 6), torch.randn(10)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(lean.Panels(weight)(x), F.linear(x, weight))
        torch.testing.assert_close(lean.Panels(weight)(x, bias), F.linear(x, weight, bias))


def test_fused_weights_are_shared_not_copied():
    model = tiny_llama(V)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    before = model.generate(ids, max_new_tokens=6, do_sample=False)
    first, second = LeanLlama(model), LeanLlama(model)
    attn = model.model.layers[0].self_attn
    fused = first.layers[0].qkv_weight
    assert second.layers[0].qkv_weight is fused  # one fused copy per model, however many targets
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()  # the module's weight is a view into it
    assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.out_features :].data_ptr()
    torch.testing.assert_close(model.generate(ids, max_new_tokens=6, do_sample=False), before, rtol=0, atol=0)


def test_unsupported_models_use_transformers():
    config = GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    config._attn_implementation = "sdpa"
    gpt2 = AutoModelForCausalLM.from_config(config).eval()
    assert "gpt2" in supports(gpt2)
    assert isinstance(TargetModel(gpt2).backend, TransformersForward)
    with pytest.raises(ValueError, match="lean forward does not support this model: model type 'gpt2'"):
        TargetModel(gpt2, backend="lean")
    with pytest.raises(ValueError, match="unknown target backend"):
        TargetModel(tiny_llama(V), backend="fast")
