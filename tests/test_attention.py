"""Batch-invariant attention (exitspec/attention.py): a tree's rows equal one-token steps bit for bit, and with it a
bf16 target's greedy speculative output equals its own autoregressive output token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_decode import PROMPT, RandomTreeDrafter
from tiny_models import save_tiny_llama, tiny_llama
from transformers import AutoModelForCausalLM, GPT2Config

from exitspec import lean, models
from exitspec.attention import invariant_attention
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters import NgramDrafter, SuffixDrafter
from exitspec.lean import Packed, Panels
from exitspec.settings import native_bf16
from exitspec.target import TargetModel
from exitspec.tree import DraftTree

needs_native_bf16 = pytest.mark.skipif(not native_bf16(),
                                       reason="the CPU has no native bf16: the lean forward keeps sdpa")


def float_cache(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[Hkv, T, hd] keys and values in the kernel's layout: float32, keys transposed to [Hkv, hd, T]."""
    return keys.float().transpose(1, 2).contiguous(), values.float()


def random_tree(n: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Parents (parents before children) and the [n, n] ancestors-or-self mask of a random tree."""
    parents = [-1] + [int(torch.randint(0, u, (1,), generator=gen)) for u in range(1, n)]
    visible = torch.zeros(n, n, dtype=torch.bool)
    for u in range(n):
        v = u
        while v >= 0:
            visible[u, v], v = True, parents[v]
    return parents, visible


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("cached", [0, 5, 37, 300])
def test_a_tree_row_equals_a_one_row_step_over_its_path(dtype, head_dim, cached):
    gen = torch.Generator().manual_seed(cached + head_dim)
    kv_heads, groups, n = 2, 3, 19
    _, visible = random_tree(n, gen)
    capacity = cached + n + 7  # room past the keys, as in the cache
    keys = torch.randn(kv_heads, capacity, head_dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, capacity, head_dim, generator=gen).to(dtype)
    q = torch.randn(kv_heads, groups, n, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    tree = invariant_attention(q, *float_cache(keys, values), visible, cached, scale)
    one = torch.ones(1, 1, dtype=torch.bool)
    for u in range(n):
        path = visible[u].nonzero().flatten().tolist()  # ancestors-or-self in depth order
        slots = list(range(cached)) + [cached + v for v in path]
        step = invariant_attention(q[:, :, u : u + 1], *float_cache(keys[:, slots], values[:, slots]), one,
                                   len(slots) - 1, scale)
        assert torch.equal(step[:, :, 0], tree[:, :, u]), f"row {u} (depth {len(path) - 1})"
    # and it is attention: sdpa in fp32 over the same keys and mask
    hidden = torch.cat([torch.zeros(n, cached, dtype=torch.bool), ~visible], 1)
    mask = torch.zeros(n, cached + n).masked_fill_(hidden, -torch.inf)
    expand = lambda x: x[:, None, : cached + n].float().expand(kv_heads, groups, cached + n, head_dim)
    reference = F.scaled_dot_product_attention(q.float(), expand(keys), expand(values), attn_mask=mask)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(tree.float(), reference, atol=tolerance, rtol=tolerance)


@needs_native_bf16
def test_bf16_products_are_row_invariant_from_two_rows():
    """The premise the lean forward relies on (it runs bf16 products on 2 rows or more): a row's product does not
    depend on how many rows share the call, nor on the weights' layout. The shapes are SmolLM2-135M's."""
    gen = torch.Generator().manual_seed(0)
    for d_in, d_out in [(576, 960), (576, 3072), (1536, 576)]:
        weight = (0.05 * torch.randn(d_out, d_in, generator=gen)).bfloat16()
        x = torch.randn(24, d_in, generator=gen).bfloat16()
        layouts = [lambda a, w=weight: F.linear(a, w), Panels(weight), Packed(weight)]
        pairs = [torch.cat([x[i : i + 1], torch.zeros_like(x[:1])]) for i in range(len(x))]  # a row and a zero row
        reference = torch.stack([F.linear(pair, weight)[0] for pair in pairs])
        for f in layouts:
            for rows in (2, 3, 9, 17, 24):
                assert torch.equal(f(x[:rows]), reference[:rows]), (d_in, d_out, rows)


@needs_native_bf16
@pytest.mark.parametrize("verifier", ["greedy", "tev"])
@pytest.mark.parametrize("hidden", [32, 128])  # head dims 8 and 64: the kernel's generic and 64-wide paths
def test_bf16_greedy_speculative_output_equals_bf16_autoregressive_output(verifier, hidden):
    model = tiny_llama(vocab_size=8, hidden_size=hidden, num_attention_heads=hidden // 64 * 2 or 4).bfloat16()
    for drafter in (RandomTreeDrafter(8), NgramDrafter(), SuffixDrafter(8)):
        decoder = SpeculativeDecoder(TargetModel(model), drafter)
        assert decoder.target.backend.invariant
        expected = decoder.autoregressive(PROMPT, max_new_tokens=60, stop_tokens=()).tokens
        for budget in (4, 16):
            out = decoder.generate(PROMPT, 60, temperature=0.0, budget=budget, verifier=verifier, stop_tokens=())
            assert out.tokens == expected
            assert out.tau > 1.0  # trees were accepted, so rows of bigger forwards became tokens


@needs_native_bf16
@pytest.mark.parametrize("hidden", [32, 128])
def test_bf16_tree_logits_equal_one_token_steps_bit_for_bit(hidden):
    """The target's own forwards: every node's logits from one tree forward equal those of one-token steps along
    its path (sdpa fails this in bf16)."""
    gen = torch.Generator().manual_seed(hidden)
    model = tiny_llama(vocab_size=32, hidden_size=hidden, num_attention_heads=hidden // 64 * 2 or 4).bfloat16()
    target = TargetModel(model)
    prompt = torch.randint(0, 32, (45,), generator=gen)
    parents, visible = random_tree(12, gen)
    tokens = torch.randperm(32, generator=gen)[:12].tolist()  # distinct, so siblings differ
    target.prefill(prompt)
    tree_logits = target.forward_tree(DraftTree.from_parents(parents, tokens, vocab_size=32)).logits
    target.discard()
    for u in range(12):
        target.truncate(len(prompt))
        for v in visible[u].nonzero().flatten().tolist():
            step = target.forward_tokens(torch.tensor([tokens[v]])).logits[0]
        assert torch.equal(step, tree_logits[u]), f"node {u}"


@needs_native_bf16
def test_a_prompts_prefill_takes_sdpa_and_trees_and_steps_the_kernel(monkeypatch):
    """The prefill, which speculative and autoregressive decoding share, needs no invariance: it runs sdpa, the
    faster for many rows; a tree forward and a one-token step run the kernel in every layer."""
    calls = []
    monkeypatch.setattr(lean, "invariant_attention", lambda *a: calls.append(a[0].shape[2]) or invariant_attention(*a))
    model = tiny_llama(vocab_size=32, hidden_size=32, num_attention_heads=4).bfloat16()
    target = TargetModel(model)
    target.prefill(torch.arange(20) % 32)
    assert calls == []
    target.forward_tokens(torch.tensor([3]))
    target.forward_tree(DraftTree.from_parents([-1, 0, 0], [1, 2, 5], vocab_size=32))
    layers = model.config.num_hidden_layers
    assert calls == [1] * layers + [3] * layers


def test_auto_dtype_is_bf16_on_cuda_and_on_cpus_with_native_bf16(monkeypatch):
    for native, on_cpu in [(True, torch.bfloat16), (False, torch.float32)]:
        monkeypatch.setattr(models, "native_bf16", lambda native=native: native)
        assert models.resolve_dtype("auto", torch.device("cpu")) == on_cpu
        assert models.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
        assert models.resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_auto_dtype_loads_bf16_only_where_the_lean_forward_runs(tmp_path, monkeypatch):
    """bf16 is exact on a CPU only through the lean forward's batch-invariant attention, so `auto` loads another
    architecture (here GPT-2, which transformers' forward runs) in fp32 even on a CPU with native bf16."""
    monkeypatch.setattr(models, "native_bf16", lambda: True)
    save_tiny_llama(tmp_path / "llama")
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert models.load_model_and_tokenizer(tmp_path / "llama", "cpu", "auto")[0].dtype == torch.bfloat16
    assert models.load_model_and_tokenizer(tmp_path / "gpt2", "cpu", "auto")[0].dtype == torch.float32
