"""The quantized forward: a Llama-family target whose weights stay as the user's file holds them (4-bit Q4_1,
8-bit Q8_0, bf16, fp32), run by one C++ call per forward (csrc/quant_llama.cpp).

Why: on a small CPU the cost of a one-token step is the weight bytes streamed plus the ops dispatched. The torch
forward (lean.py) streams bf16 or fp32 weights and dispatches ~700 ops a step; llama.cpp streams the GGUF file's
4- and 8-bit blocks in one C loop and is 2–2.7× faster a step. This forward does what llama.cpp does for a step
and keeps what exitspec's trees need: a product's weight blocks are decoded once for all the rows of a tree.

The formats (GGUF's blocks of 32 values along a weight row's inputs):

    Q4_1:  value_i = d·q_i + m,  q_i ∈ [0, 15],  d, m fp16      (20 bytes a block, 5 bits a value)
    Q8_0:  value_i = d·q_i,      q_i ∈ [−127, 127], d fp16     (34 bytes a block, 8.5 bits a value)
    BF16, F32: the values; products in fp32.

A quantized product quantizes each activation row per block as GGUF's Q8_1 does, d_x = max|x|/127,
q_x = round(x/d_x), s_x = d_x·Σq_x, and sums exact integer dots:

    y_j = Σ_b d_w,b d_x,b (Σ_i q_w,i q_x,i) + Σ_b m_w,b s_x,b        (Q4_1; Q8_0 has no second sum)

the numerics llama.cpp runs these files with (up to the order of float sums). Everything else (RMSNorm, RoPE,
grouped-query attention over the tree mask, SwiGLU) is fp32, one row at a time.

Exactness: every output number of a row is computed by one fixed sequence of float operations whatever the
row count or thread count (the kernel's header says how), so a tree's rows equal one-token steps bit for bit
and greedy speculative output equals this target's own autoregressive output (tests/test_quant.py). The target
is the quantized model: its outputs differ from the fp32 model's as the file's rounding makes them.

A prompt's prefill (a causal run of 8 rows or more, which speculative and autoregressive decoding share) runs
the same weights' values in fp32 through the BLAS instead (decoded once at load, 4 bytes a weight): a row-block
kernel without 8-bit dot instructions wider than AVX2's does a prompt's rows at about 0.6 of the BLAS's speed
(7.4 against 4.3 ms a token at 335 tokens, docs/results.md). Prefilled keys and values are then the fp32 products', as
in the lean forward, whose prefill takes sdpa.

Weights come from a GGUF file's own blocks (`gguf_weights`: the default model's Q4_1 file as it is) or from a
loaded model's float weights quantized here with GGUF's reference quantizers (`QuantLlama(model, "q8_0")`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from exitspec.extensions import build, digest
from exitspec.lean import supports_config as lean_supports

FORMATS = ("f32", "bf16", "q8_0", "q4_1")  # weight formats the kernel multiplies by
GGUF = "gguf"  # a weights spec: the model's GGUF file's own blocks (`gguf_weights`)
GGUF_TYPES = {0: "f32", 30: "bf16", 8: "q8_0", 3: "q4_1"}  # GGMLQuantizationType values the kernel reads
IDENTITY = f"quant:{digest('quant_llama.cpp')}"  # the kernel's version, in forward configs and cost caches


def kernel():
    """The compiled extension (extensions.build)."""
    return build("quant_llama.cpp", "the quantized forward")


def supports_config(config) -> str | None:
    """None when the quantized forward runs a model of this config; otherwise why not (a short reason): a Llama-family
    model (lean.supports_config) whose every product has a multiple of 32 inputs."""
    reason = lean_supports(config)
    if reason is not None:
        return reason
    config = config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = (config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim)
    if any(w % 32 for w in widths):
        return f"product widths {widths}, not all multiples of 32"
    return None


def format_code(name: str) -> int:
    """The kernel's number for a weight format name (FORMATS)."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}: use one of {', '.join(FORMATS)}")
    return getattr(kernel(), name.upper())


class Blocks:
    """A weight [rows, cols] in a kernel format: `data` uint8 [rows, bytes a row], GGUF's block layout."""

    def __init__(self, data: Tensor, fmt: str, rows: int, cols: int):
        self.data, self.format, self.rows, self.cols = data, fmt, rows, cols

    @classmethod
    def quantize(cls, weight: Tensor, fmt: str) -> Blocks:
        """A float weight [rows, cols] in `fmt` (GGUF's reference quantizers for Q8_0 and Q4_1)."""
        rows, cols = weight.shape
        if cols % 32:
            raise ValueError(f"the quantized forward needs weights of a multiple of 32 inputs, got {cols}")
        return cls(kernel().quantize(weight.detach().float().cpu(), format_code(fmt)), fmt, rows, cols)

    def kernel_weight(self, bias: Tensor | None = None):
        """The kernel's Weight over these bytes (it holds a reference to them)."""
        bias = None if bias is None else bias.detach().float().cpu()
        return kernel().Weight(self.data, format_code(self.format), self.rows, self.cols, bias)

    def dequantize(self) -> Tensor:
        """The values [rows, cols] in fp32."""
        return kernel().dequantize(self.kernel_weight())


def concat(blocks: list[Blocks]) -> Blocks:
    """Weights of one format and width stacked along their outputs (W_qkv, W_gate_up): rows of blocks concatenate."""
    formats = {b.format for b in blocks}
    if len(formats) > 1:
        raise ValueError(f"cannot fuse weights of formats {sorted(formats)} into one product")
    return Blocks(torch.cat([b.data for b in blocks]), blocks[0].format, sum(b.rows for b in blocks), blocks[0].cols)


def gguf_weights(path: Path, config) -> dict[str, Blocks]:
    """The weights of a llama-architecture GGUF file as its blocks, under transformers' parameter names.

    llama.cpp's converter permutes the rows of W_q and W_k so that RoPE rotates adjacent pairs; the rows are put
    back in transformers' rotate-half order (whole rows of blocks move, no value changes), as transformers' own
    GGUF loader does to the dequantized values.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"{path}: the quantized forward reads llama-architecture GGUF files, this one is {arch!r}")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    out = {}
    for tensor in reader.tensors:
        part = tensor.name.removesuffix(".weight").split(".")
        if part[0] == "blk" and part[2] in names:
            name = f"model.layers.{part[1]}.{names[part[2]]}.weight"
        elif part[0] in ("token_embd", "output"):
            name = "model.embed_tokens.weight" if part[0] == "token_embd" else "lm_head.weight"
        else:
            continue  # norms: fp32 vectors, read from the model
        kind = int(tensor.tensor_type)
        if kind not in GGUF_TYPES:
            raise ValueError(f"{path}: tensor {tensor.name} is of GGUF type {tensor.tensor_type.name}; the quantized "
                             f"forward reads {', '.join(t.upper() for t in GGUF_TYPES.values())}")
        cols, rows = (int(d) for d in tensor.shape[:2])
        data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)
        if part[0] == "blk" and part[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if part[2] == "attn_q" else config.num_key_value_heads
            data = data.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
        # a writable copy, not a view of the file's mapping
        out[name] = Blocks(torch.from_numpy(np.array(data)), GGUF_TYPES[kind], rows, cols)
    return out


class QuantLlama:
    """Forward of a Llama-family causal LM for one sequence through the C++ kernel, with a KV cache of [layers, Hkv,
    capacity, hd] fp32 keys and values: the interface of lean.LeanLlama (reset, forward, keep, crop, kv).

    `weights`: a format of FORMATS (the model's float weights quantized to it) or "gguf:PATH" (that GGUF file's
    own blocks; norms from the model). The embedding table and the output head keep their own format (a GGUF
    file's Q8_0 token table stays Q8_0; from float weights they take the format asked for).
    """

    def __init__(self, model: nn.Module, weights: str, feature_layers: tuple[int, ...] = ()):
        reason = supports_config(model.config)
        if reason is not None:
            raise ValueError(f"the quantized forward does not support this model: {reason}")
        if model.device.type != "cpu":
            raise ValueError(f"the quantized forward runs on a CPU; the model is on {model.device}")
        config = model.config.get_text_config(decoder=True)
        self.weights = weights
        self.feature_layers = tuple(feature_layers)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = config.num_hidden_layers
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.attention = IDENTITY
        self.row_plan: dict[int, tuple[int, str]] = {}  # the kernel lays its own products out
        self.keys = self.values = None  # [layers, Hkv, capacity, hd] fp32
        self.length = 0
        self.engine = self._build(model, config)

    def _build(self, model: nn.Module, config):
        blocks = self._blocks(model, config)
        base = model.model
        layer_weights, norms, qk_norms = [], [], []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prefix = f"model.layers.{i}."
            qkv = concat([blocks[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
            qkv_bias = None
            if attn.q_proj.bias is not None:
                qkv_bias = torch.cat([getattr(attn, f"{p}_proj").bias for p in "qkv"])
            gate_up = concat([blocks[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
            layer_weights += [qkv.kernel_weight(qkv_bias),
                              blocks[f"{prefix}self_attn.o_proj.weight"].kernel_weight(attn.o_proj.bias),
                              gate_up.kernel_weight(),
                              blocks[f"{prefix}mlp.down_proj.weight"].kernel_weight(mlp.down_proj.bias)]
            norms += [_vector(layer.input_layernorm.weight), _vector(layer.post_attention_layernorm.weight)]
            if getattr(attn, "q_norm", None) is not None:  # Qwen3
                qk_norms += [_vector(attn.q_norm.weight), _vector(attn.k_norm.weight)]
        norms.append(_vector(base.norm.weight))
        embed = blocks["model.embed_tokens.weight"]
        head = blocks.get("lm_head.weight", embed)
        positions = torch.arange(config.max_position_embeddings)
        cos, sin = base.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, P, hd] each
        eps = getattr(config, "rms_norm_eps", 1e-6)
        return kernel().Engine(layer_weights, norms, qk_norms, embed.kernel_weight(),
                               head.kernel_weight(_bias(model.get_output_embeddings())), cos[0].float().contiguous(),
                               sin[0].float().contiguous(), self.heads, self.kv_heads, self.head_dim, eps, True)

    def _blocks(self, model: nn.Module, config) -> dict[str, Blocks]:
        if self.weights.startswith(f"{GGUF}:"):
            return gguf_weights(Path(self.weights.split(":", 1)[1]), config)
        fmt = self.weights
        format_code(fmt)
        names = [n for n, _ in model.named_parameters() if n.endswith("_proj.weight") and ".layers." in n]
        out = {n: Blocks.quantize(model.get_parameter(n), fmt) for n in names}
        out["model.embed_tokens.weight"] = Blocks.quantize(model.get_input_embeddings().weight, fmt)
        head = model.get_output_embeddings().weight
        if head.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            out["lm_head.weight"] = Blocks.quantize(head, fmt)
        return out

    @property
    def precision(self) -> str:
        """The weights spec, as forward configs report it (a GGUF file by its name)."""
        return f"{GGUF}:{Path(self.weights.split(':', 1)[1]).name}" if self.weights.startswith(GGUF) else self.weights

    def reset(self) -> None:
        self.length = 0

    def use_row_plan(self, plan: dict[int, tuple[int, str]]) -> None:
        """The kernel has one way to run a product at every row count: no plan to follow."""

    def _reserve(self, end: int) -> None:
        """Grows the cache (doubling, so appends cost amortised O(1)) to hold `end` entries."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if end <= capacity:
            return
        shape = (self.layers, self.kv_heads, max(end, 2 * capacity, 256), self.head_dim)
        keys, values = torch.empty(shape), torch.empty(shape)
        if self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    @torch.inference_mode()
    def forward(
        self, ids: Tensor, positions: Tensor, visible: Tensor | None, logits_to_keep: int = 0
    ) -> tuple[Tensor, list[Tensor]]:
        """As LeanLlama.forward: ids, positions [n]; visible [n, n] bool among the new tokens (None: causal).
        Returns logits [r, V] fp32 of the last r = logits_to_keep rows (0: all) and the feature taps [n, D]."""
        n, start = ids.numel(), self.length
        self._reserve(start + n)
        logits, taps = self.engine.forward(ids.long().contiguous(), positions.long().contiguous(), visible,
                                           self.keys, self.values, start, logits_to_keep, list(self.feature_layers))
        self.length = start + n
        return logits, taps

    def keep(self, start: int, slots: Tensor) -> None:
        """Moves cache entries `slots` [m] to start..start+m-1 in every layer and drops everything after."""
        m = slots.numel()
        self.keys[:, :, start : start + m] = self.keys[:, :, slots]
        self.values[:, :, start : start + m] = self.values[:, :, slots]
        self.length = start + m

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The cached keys and values of one layer, [Hkv, length, hd] each (views)."""
        return self.keys[layer, :, : self.length], self.values[layer, :, : self.length]


def _vector(weight: Tensor) -> Tensor:
    return weight.detach().float().cpu().contiguous()


def _bias(linear: nn.Module) -> Tensor | None:
    return getattr(linear, "bias", None)
