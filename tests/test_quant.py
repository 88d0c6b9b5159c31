"""The quantized forward (exitspec/quant.py, csrc/quant_llama.cpp): GGUF's formats as GGUF defines them, products
as the formula says, rows that do not depend on their neighbours, and a target whose trees equal its steps bit for
bit, so that speculative decoding keeps its greedy output and its law."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decode import DRAWS, PROMPT, VOCAB, RandomTreeDrafter
from tiny_models import tiny_causal_lm, tiny_llama
from transformers import Qwen2Config, Qwen3Config

from exitspec import models
from exitspec.check import g_test_pvalue
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters import NgramDrafter
from exitspec.lean import LeanLlama
from exitspec.quant import FORMATS, Blocks, QuantLlama, gguf_weights, kernel
from exitspec.target import TargetModel
from exitspec.tree import DraftTree

QUANTIZED = ("q8_0", "q4_1")


def round_half_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def reference_blocks(x: np.ndarray, fmt: str) -> np.ndarray:
    """GGUF's reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_1_ref) in float32 numpy: the bytes."""
    out = []
    for block in x.astype(np.float32).reshape(-1, 32):
        if fmt == "q8_0":
            d = np.abs(block).max() / np.float32(127)
            q = round_half_away(block * (np.float32(1) / d if d else np.float32(0))).astype(np.int8)
            out.append(np.float16(d).tobytes() + q.tobytes())
        else:
            lo, hi = block.min(), block.max()
            d = (hi - lo) / np.float32(15)
            scale = np.float32(1) / d if d else np.float32(0)
            q = np.minimum(15, ((block - lo) * scale + np.float32(0.5)).astype(np.int8))
            nibbles = (q[:16] | (q[16:] << 4)).astype(np.uint8)
            out.append(np.float16(d).tobytes() + np.float16(lo).tobytes() + nibbles.tobytes())
    return np.frombuffer(b"".join(out), dtype=np.uint8)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantizers_write_ggufs_reference_blocks(fmt):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 96, generator=gen)
    weight[2, 32:64] = 0.0  # an all-zero block: scale 0
    weight[3, :32] = 0.25  # a constant block: Q4_1's d = 0
    blocks = Blocks.quantize(weight, fmt)
    for row in range(6):
        assert np.array_equal(blocks.data[row].numpy(), reference_blocks(weight[row].numpy(), fmt)), row


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_product_is_the_formats_formula(fmt):
    """fp32 and bf16: x · wᵀ over the stored values; Q8_0, Q4_1: Σ_b d_w d_x Σ q_w q_x (+ Σ_b m_w s_x) with the
    activation row quantized per block of 32 (d_x = max|x|/127, q_x = round(x/d_x)), to float rounding."""
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(40, 128, generator=gen), torch.randn(5, 128, generator=gen)
    blocks = Blocks.quantize(weight, fmt)
    values = blocks.dequantize().double()  # [40, 128]
    y = kernel().product(blocks.kernel_weight(), x)
    if fmt in QUANTIZED:
        xb = x.reshape(5, -1, 32)
        d = xb.abs().amax(-1, keepdim=True) / 127
        x = (torch.round(xb / torch.where(d > 0, d, 1)) * d).reshape(5, 128)  # what the integer dots multiply
    torch.testing.assert_close(y.double(), x.double() @ values.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_products_rows_do_not_depend_on_the_rows_or_threads_beside_them(fmt):
    gen = torch.Generator().manual_seed(3)
    blocks = Blocks.quantize(0.1 * torch.randn(77, 160, generator=gen), fmt)  # 77 outputs: every column tail
    weight, x = blocks.kernel_weight(), torch.randn(33, 160, generator=gen)
    threads = torch.get_num_threads()
    steps = torch.cat([kernel().product(weight, x[i : i + 1]) for i in range(33)])
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 3, 4, 5, 7, 8, 13, 33):
                assert torch.equal(kernel().product(weight, x[:rows]), steps[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_fp32_quantized_forward_is_the_models_forward(family):
    """With fp32 weights the kernel computes what the lean forward (checked against transformers in test_lean)
    computes, to float rounding: logits and feature taps of a prefill, a step and a tree, with Qwen2's biases and
    Qwen3's q/k norms."""
    config = {"llama": None, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    model = tiny_llama(vocab_size=48) if config is None else tiny_causal_lm(config, vocab_size=48, head_dim=8)
    quant, lean = QuantLlama(model, "f32", (0, 1)), LeanLlama(model, (0, 1))
    prompt = torch.arange(20) % 48
    parents = [-1, 0, 0, 1, 3, 2]
    tree = DraftTree.from_parents(parents, [5, 7, 9, 11, 13, 15], vocab_size=48)
    calls = [(prompt, torch.arange(20), None), (torch.tensor([3]), torch.tensor([20]), None),
             (tree.tokens, tree.position_ids(21), tree.visibility_mask())]
    for ids, positions, visible in calls:
        (a, taps_a), (b, taps_b) = quant.forward(ids, positions, visible), lean.forward(ids, positions, visible)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for x, y in zip(taps_a, taps_b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "bf16"])
def test_tree_logits_equal_one_token_steps_bit_for_bit(fmt):
    gen = torch.Generator().manual_seed(4)
    target = TargetModel(tiny_llama(vocab_size=64, hidden_size=64, intermediate_size=128), precision=fmt)
    prompt = torch.randint(0, 64, (45,), generator=gen)
    parents = [-1, 0, 1, 1, 0, 4, 2, 6, 3, 3, 8, 5]
    tokens = torch.randperm(64, generator=gen)[:12].tolist()
    tree = DraftTree.from_parents(parents, tokens, vocab_size=64)
    target.prefill(prompt)
    tree_logits = target.forward_tree(tree).logits
    target.discard()
    visible = tree.visibility_mask()
    for u in range(12):
        target.truncate(len(prompt))
        for v in visible[u].nonzero().flatten().tolist():
            step = target.forward_tokens(torch.tensor([tokens[v]])).logits[0]
        assert torch.equal(step, tree_logits[u]), f"node {u}"


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "bf16"])
def test_greedy_speculative_output_equals_the_quantized_targets_autoregressive_output(fmt):
    model = tiny_llama(vocab_size=VOCAB, hidden_size=64, intermediate_size=128)
    for drafter in (RandomTreeDrafter(VOCAB), NgramDrafter()):
        decoder = SpeculativeDecoder(TargetModel(model, precision=fmt), drafter, warm_start=False)
        assert decoder.target.forward_config()["dtype"] == fmt
        expected = decoder.autoregressive(PROMPT, max_new_tokens=60, stop_tokens=()).tokens
        for budget, verifier in [(4, "greedy"), (16, "tev")]:
            out = decoder.generate(PROMPT, 60, temperature=0.0, budget=budget, verifier=verifier, stop_tokens=())
            assert out.tokens == expected
            assert out.tau > 1.0


def quantized_first_tokens_law(target: TargetModel, n: int = 3) -> torch.Tensor:
    """[V]*n joint probabilities of the first n tokens, enumerated with the quantized target's own causal steps."""
    law = torch.zeros((VOCAB,) * n, dtype=torch.float64)

    def walk(prefix: list[int], p: float) -> None:
        target.reset()
        target.prefill(torch.tensor(PROMPT[:-1]))
        logits = target.forward_tokens(torch.tensor(PROMPT[-1:] + prefix)).logits[-1]
        probs = torch.softmax(logits.double(), -1)
        for token in range(VOCAB):
            if len(prefix) + 1 == n:
                law[tuple(prefix + [token])] = p * probs[token]
            else:
                walk(prefix + [token], p * float(probs[token]))

    walk([], 1.0)
    return law


@pytest.mark.parametrize("verifier", ["predraw", "tev"])
def test_the_first_three_tokens_follow_the_quantized_targets_law(verifier):
    model = tiny_llama(vocab_size=VOCAB, seed=3)
    decoder = SpeculativeDecoder(TargetModel(model, precision="q4_1"), RandomTreeDrafter(VOCAB, seed=1),
                                 warm_start=False)
    counts = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
    for seed in range(DRAWS):
        out = decoder.generate(PROMPT, 3, 1.0, budget=6, verifier=verifier, seed=seed, stop_tokens=())
        counts[tuple(out.tokens)] += 1
    law = quantized_first_tokens_law(TargetModel(model, precision="q4_1"))
    assert g_test_pvalue(counts, law) > 1e-3
    assert g_test_pvalue(counts, quantized_first_tokens_law(TargetModel(tiny_llama(vocab_size=VOCAB, seed=4),
                                                                         precision="q4_1"))) < 1e-3  # it has power


def test_bad_weights_get_one_line_errors():
    with pytest.raises(ValueError, match="multiple of 32 inputs"):
        Blocks.quantize(torch.randn(4, 40), "q8_0")
    with pytest.raises(ValueError, match="unknown weight format 'q5_k'"):
        QuantLlama(tiny_llama(), "q5_k")
    with pytest.raises(ValueError, match="reads the default model's GGUF file"):
        models.quantized_weights("gguf", torch.device("cpu"), default=False)
    with pytest.raises(ValueError, match="runs on a CPU"):
        models.quantized_weights("q4_1", torch.device("cuda"), default=True)


@pytest.mark.slow
def test_the_default_models_gguf_blocks_are_its_converted_weights():
    """The default model's own Q4_1 (and Q8_0 token table) blocks, read from its GGUF file with W_q and W_k put
    back in rotate-half order, dequantize bit for bit to the safetensors folder the model loads from."""
    model, _ = models.load_model_and_tokenizer(None, "cpu", "float32")
    blocks = gguf_weights(models._find_gguf(), model.config)
    formats = {b.format for b in blocks.values()}
    assert formats == {"q4_1", "q8_0"}
    params = dict(model.named_parameters())
    assert len(blocks) == 7 * model.config.num_hidden_layers + 1
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), params[name]), name


def test_auto_runs_the_quantized_forward_on_cpus_without_native_bf16(monkeypatch):
    """There the default model runs its GGUF file's own blocks and a model folder bf16 weights in the quantized
    forward (torch would emulate bf16); on a CPU with native bf16 the lean forward keeps bf16 (test_attention)."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(models, "native_bf16", lambda: False)
    assert models.quantized_weights("auto", cpu, default=True) == f"gguf:{models._find_gguf()}"
    assert models.quantized_weights("auto", cpu, default=False) == "bf16"
    assert models.quantized_weights("bfloat16", cpu, default=True) == "bf16"
    assert models.quantized_weights("float32", cpu, default=True) is None
    wide = tiny_llama().config
    wide.intermediate_size = 48  # not a multiple of 32: the torch forward
    assert models.quantized_weights("auto", cpu, default=False, config=wide) is None
    monkeypatch.setattr(models, "native_bf16", lambda: True)
    assert models.quantized_weights("auto", cpu, default=True) is None
    assert models.quantized_weights("bfloat16", cpu, default=False) is None
