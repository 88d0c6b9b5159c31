"""A lean forward for Llama-family targets (Llama, SmolLM2, Mistral, Qwen2, Qwen3): the same maths as
transformers' modelling code, written out for one sequence with a static, preallocated KV cache.

Why: on a small CPU the transformers forward spends a fixed ~20 ms per call outside the weight products
(module dispatch, cache objects, mask preparation, 4D broadcasting), about half of a one-token step of
SmolLM2-135M. Here a layer is six library calls on [n, D] rows: RMSNorm, one fused QKV product, RoPE, one
`scaled_dot_product_attention` over the cache, one fused gate/up product and the down product.

    x [n, D] ─ rms_norm ─ W_qkv ─▶ q [H, n, hd], k, v [Hkv, n, hd] ─ (q/k norm) ─ RoPE ─▶ cache[L : L+n]
    attention: the H query heads of one KV group are stacked as rows [1, Hkv, g·n, hd] against the group's
    keys [1, Hkv, L+n, hd], so grouped-query attention needs no copy of K or V; the float mask [1, 1, g·n, L+n]
    is 0 where a row may look and -inf elsewhere (the tree's ancestor mask over the new tokens, all of the
    cache). 4D inputs let CPU sdpa take its fused kernel: 30 layers of 9 rows cost 1.6 ms against 3.7 ms in
    the 3D math path. A bf16 target on a CPU attends through attention.py's batch-invariant kernel instead in
    trees and one-token steps, so that a tree's rows equal one-token steps bit for bit (a prompt's prefill,
    which both decodings share, keeps sdpa).

The fused weights are built once by concatenation, and the transformers modules' weights become views
into them, so the model is not held twice and `model.generate` keeps working on the same storage. On a CPU
the other weights then move off the checkpoint's file mapping too (`_leave_the_file`): a mapping stays
resident while any tensor of it lives, so it would keep the file pages of the fused originals beside their
fused copies (+270 MiB for SmolLM2-135M).
`TargetModel` uses this path whenever `supports(model)` says yes; tests check its logits and hidden
states against the transformers forward to fp32 rounding.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from exitspec.attention import IDENTITY, invariant_attention
from exitspec.settings import native_bf16
from exitspec.timing import fastest

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PANEL_ROWS = 32  # output rows of a weight panel (Panels)


def supports(model: nn.Module) -> str | None:
    """None when the lean forward reproduces `model`; otherwise why it does not (a short reason)."""
    return supports_config(model.config)


def supports_config(config) -> str | None:
    """`supports` from a model's config alone (before loading its weights)."""
    config = config.get_text_config(decoder=True)
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model type {config.model_type!r} (lean forward: {', '.join(LEAN_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than bias-free SwiGLU"
    if getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "tensor-parallel pretraining slices"
    return None


def _fuse(owner: nn.Module, name: str, linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight [sum out, in] (and bias) for several Linear layers; each layer's weight becomes a view of it.

    The pair is kept on `owner` as attribute `name`, so a second LeanLlama over the same model reuses it
    (unless the model has since moved to another device or dtype, which gives its layers new storage).
    """
    fused = getattr(owner, name, None)
    if fused is not None and fused[0].data_ptr() == linears[0].weight.data_ptr():
        return fused
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(lin.out_features)
                          for b, lin in zip(biases, linears)])
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight.data = weight[start:end]
        if lin.bias is not None:
            lin.bias.data = bias[start:end]
        start = end
    object.__setattr__(owner, name, (weight, bias))  # a plain attribute: not a parameter, not in state_dict
    return weight, bias


class Panels:
    """A weight [D_out, D_in] laid out for products over a few rows: its output rows cut into panels of
    PANEL_ROWS, each panel transposed and contiguous, blocks [P, D_in, PANEL_ROWS], all multiplied in one
    batched product. A copy: it holds the weight's memory once more.

    Why: a CPU BLAS is not monotone in the row count. On 2 cores MKL streams SmolLM2-135M's weights at one to
    three rows, but 4 rows cost 1.8× one row and 9 rows 2.5×; the same products over these panels cost 1.13×
    and 1.29× (32-row panels; 16 and 64 rows cost more, and so do untransposed panels: 1.31× and 1.57×).
    DFlash's draft head (16 384 rows) on 7 rows: 0.74 ms against 2.01 ms whole."""

    def __init__(self, weight: Tensor):
        out_rows, in_rows = weight.shape
        whole = out_rows // PANEL_ROWS * PANEL_ROWS  # output rows in full panels
        weight = weight.detach()
        # [P, D_in, PANEL_ROWS]
        self.blocks = weight[:whole].reshape(-1, PANEL_ROWS, in_rows).transpose(1, 2).contiguous()
        self.rest = weight[whole:]  # [D_out − whole, D_in]: the last, partial panel, multiplied as it is

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [n, D_in] → F.linear(x, weight, bias) [n, D_out] but for rounding."""
        n = x.shape[0]
        out = torch.bmm(x.expand(self.blocks.shape[0], *x.shape), self.blocks)  # [P, n, PANEL_ROWS]
        out = out.transpose(0, 1).reshape(n, -1)  # [n, whole]
        if self.rest.shape[0]:
            out = torch.cat([out, F.linear(x, self.rest)], dim=1)  # [n, D_out]
        return out if bias is None else out + bias


class Packed:
    """A weight [D_out, D_in] pre-packed for oneDNN's linear (`torch.ops.mkldnn`, the kernels torch.compile's CPU
    backend runs): blocked once for the CPU's vector width, so a product streams it without re-laying it out.
    A copy: it holds the weight's memory once more.

    Why: on a 2-core AMD EPYC with avx512_bf16, SmolLM2-135M's weight products over 5 rows cost 20.6 ms in fp32
    this way against 40.9 ms in Panels and 50.4 ms whole, and over 17 rows 32.9 ms against 59 ms; in bf16
    12.5 ms and 18.9 ms, about one bf16 step (14.8 ms). At one row fp32 Panels stay the cheapest (13.1 ms)."""

    def __init__(self, weight: Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [n, D_in] → F.linear(x, weight, bias) [n, D_out] but for rounding."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


LAYOUTS = {"panels": Panels, "packed": Packed}  # ways to lay a weight out besides "whole" (F.linear on it as is)
PLAN_GAIN = 0.05  # a tree runs another way (another layout, more rows) only if it is measured this much cheaper


def cheaper_panels(weight: Tensor, rows: int, repeats: int = 5) -> Panels | None:
    """The weight [D_out, D_in] in Panels if products over `rows` rows measure at least PLAN_GAIN cheaper that
    way than F.linear on the weight's device (the fastest of `repeats` runs each, after one warm-up); else None."""
    panels = Panels(weight)
    x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    whole, panelled = (
        fastest(product, repeats + 1, weight.device) for product in (lambda: F.linear(x, weight), lambda: panels(x))
    )
    return panels if panelled < (1 - PLAN_GAIN) * whole else None


def invariant_by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """Batch-invariant attention (attention.py) where the products are row-invariant too: bf16 on a CPU with native
    bf16, whose oneDNN products give a row the same result whatever the row count from 2 rows up (a premise
    tests/test_attention.py checks). fp32 keeps sdpa (its tree rows match one-row steps to ~1e-5; fp32 products are
    not row-invariant in every layout); a GPU keeps its fused kernels."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native_bf16()


def layouts_for(device: torch.device) -> list[str]:
    """The weight layouts worth measuring on `device`: both on a CPU (Packed where torch has oneDNN), none on
    a GPU, whose BLAS is not slow on a few rows."""
    if device.type != "cpu":
        return []
    return ["panels"] + (["packed"] if torch.backends.mkldnn.is_available() else [])


class LayoutSet(dict):
    """weight.data_ptr() -> that weight in one layout (Panels or Packed), for every weight a LeanLlama multiplies
    by. One set per model and layout, shared by every LeanLlama over it whose row plan uses that layout (the
    model holds weak references: a set is freed when no plan uses it)."""

    @classmethod
    def of(cls, owner: nn.Module, layout: str, weights: list[Tensor]) -> LayoutSet:
        refs = getattr(owner, "_lean_layouts", None)
        if refs is None:
            refs = {}
            object.__setattr__(owner, "_lean_layouts", refs)  # a plain attribute, not a submodule
        ref = refs.get(layout)
        held = ref() if ref is not None else None
        if held is None or any(w.data_ptr() not in held for w in weights):  # none yet, or the weights moved
            held = cls((w.data_ptr(), LAYOUTS[layout](w)) for w in weights)
            refs[layout] = weakref.ref(held)
        return held


class LeanLayer:
    """One decoder layer's weights, fused: W_qkv [(H + 2 Hkv)·hd, D], W_gate_up [2 I, D], the rest as is."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_weight, self.qkv_bias = _fuse(attn, "_lean_qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up_weight, _ = _fuse(mlp, "_lean_gate_up", [mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3

    def weights(self) -> list[Tensor]:
        """The four weights the layer multiplies by, in order."""
        return [self.qkv_weight, self.o_proj.weight, self.gate_up_weight, self.down_proj.weight]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: x · rsqrt(mean(x²) + eps) with fp32 statistics, then the weight in x's dtype. One
    fused op where x and the weight are fp32 (the same numbers, bit for bit)."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype) * weight


def _rms(norm: nn.Module, x: Tensor) -> Tensor:
    return rms_norm(x, norm.weight, getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., heads, n, hd] rotated by cos, sin broadcast against it (the rotate-half convention of HF Llama and
    Qwen3: x·cos + [−x2, x1]·sin). The target's layers and the DFlash drafter's both rotate here."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decoder_layer(
    layer: LeanLayer, x: Tensor, cos: Tensor, sin: Tensor, head_shape: tuple[int, int, int], attend, linear=F.linear
) -> Tensor:
    """One pre-norm decoder layer over rows x [..., n, D] (any leading dims); cos, sin broadcast against
    [..., H, n, hd]. `attend(q [..., H, n, hd], k, v [..., Hkv, n, hd])` stores k, v in its cache and returns
    the attention output [..., H, n, hd]: the caller owns the cache layout and the mask. `linear(x, weight,
    bias)` computes the weight products (F.linear, or LeanLlama.linear with its row plan)."""
    heads, kv_heads, hd = head_shape
    *lead, n, _ = x.shape
    qkv = linear(_rms(layer.input_norm, x), layer.qkv_weight, layer.qkv_bias)  # [..., n, (H+2Hkv)·hd]
    q, k, v = qkv.view(*lead, n, heads + 2 * kv_heads, hd).split((heads, kv_heads, kv_heads), dim=-2)
    if layer.q_norm is not None:
        q, k = _rms(layer.q_norm, q), _rms(layer.k_norm, k)
    q, k = apply_rope(q.transpose(-3, -2), cos, sin), apply_rope(k.transpose(-3, -2), cos, sin)
    v = v.transpose(-3, -2)
    out = attend(q, k, v)  # [..., H, n, hd]
    x = x + linear(out.transpose(-3, -2).reshape(*lead, n, heads * hd), layer.o_proj.weight, layer.o_proj.bias)
    gate, up = linear(_rms(layer.post_norm, x), layer.gate_up_weight, None).chunk(2, dim=-1)  # [..., n, I] each
    return x + linear(F.silu(gate) * up, layer.down_proj.weight, layer.down_proj.bias)


def additive_mask(visible: Tensor, past: int, dtype: torch.dtype, blocked: float = float("-inf")) -> Tensor:
    """[n, past+n] float mask for n new tokens after `past` cached ones: 0 where a query sees a key, `blocked`
    where not. Every cached token is visible; among the new ones, query i sees key j where visible [n, n] is
    True. sdpa needs it additive: a boolean mask is silently wrong under eager attention."""
    n = visible.shape[0]
    mask = torch.zeros(n, past + n, dtype=dtype, device=visible.device)
    mask[:, past:].masked_fill_(~visible, blocked)
    return mask


def _leave_the_file(model: nn.Module) -> None:
    """Copies each CPU parameter that owns its storage (every one but the views of fused weights) to memory of its
    own, once per parameter (a draft model of the target's first layers shares its modules), so that no tensor
    keeps the checkpoint's file mapping (safetensors loads by mmap) alive."""
    with torch.no_grad():
        for param in model.parameters():
            own = param.untyped_storage().nbytes() == param.numel() * param.element_size()
            if param.device.type == "cpu" and own and not getattr(param, "_lean_off_file", False):
                param.data = param.data.clone()
                param._lean_off_file = True


class LeanLlama:
    """Forward of a Llama-family causal LM for one sequence, with a KV cache of [layers, Hkv, capacity, hd]."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()):
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        config = model.config.get_text_config(decoder=True)
        base = model.model
        self.owner = model
        self.embed, self.final_norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.layers = [LeanLayer(layer) for layer in base.layers]
        _leave_the_file(model)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.head_shape = (self.heads, self.kv_heads, self.head_dim)
        self.feature_layers = tuple(feature_layers)
        self.last_layer = len(self.layers) - 1
        weight = self.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.keys = self.values = None  # [layers, Hkv, capacity, hd]; under the kernel float32, keys [.., hd, capacity]
        self.length = 0
        self.row_plan: dict[int, tuple[int, str]] = {}  # n rows -> (rows to run on, layout): `linear`
        self.layouts: dict[str, LayoutSet] = {}  # the model's weights in each layout the plan uses
        self.invariant = invariant_by_default(self.device, self.dtype)  # attention.py's, else sdpa
        self.attention = IDENTITY if self.invariant else "sdpa"  # which attention trees and steps run

    def reset(self) -> None:
        self.length = 0

    def use_row_plan(self, plan: dict[int, tuple[int, str]]) -> None:
        """Runs the weight products of n rows as plan[n] = (rows, layout) says (`linear`); holds the model's
        weights in each layout some entry uses, and lets go of the others."""
        self.row_plan = dict(plan)
        used = {layout for _, layout in self.row_plan.values()} - {"whole"}
        weights = [w for layer in self.layers for w in layer.weights()] + [self.lm_head.weight]
        self.layouts = {layout: self.layouts.get(layout) or LayoutSet.of(self.owner, layout, weights)
                        for layout in used}

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear over rows x [n, D_in] → [n, D_out], run as row_plan[n] = (rows, layout) says where it names n:
        zero rows appended up to `rows`, and the weight whole, in Panels or Packed (budget.CostModel measures
        which way is cheapest at each size). The rows are F.linear's but for rounding; under invariant attention
        every product runs on 2 rows or more, where bf16 products give a row the same result in every layout."""
        n = x.shape[0]
        rows, layout = self.row_plan.get(n, (n, "whole"))
        if self.invariant:  # oneDNN's one-row bf16 product reduces in another order than its 2+-row products
            rows = max(rows, 2)
        if rows > n:
            x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
        if layout != "whole":
            return self.layouts[layout][weight.data_ptr()](x, bias)[:n]
        return F.linear(x, weight, bias)[:n]

    def _reserve(self, end: int) -> None:
        """Grows the cache (doubling, so appends cost amortised O(1)) to hold `end` entries. Under the invariant
        kernel it is float32 with the keys transposed, the layout the kernel reads (the bf16 values exactly)."""
        capacity = 0 if self.keys is None else self.values.shape[2]
        if end <= capacity:
            return
        size = max(end, 2 * capacity, 256)
        shape = (len(self.layers), self.kv_heads, size, self.head_dim)
        key_shape = (len(self.layers), self.kv_heads, self.head_dim, size) if self.invariant else shape
        dtype = torch.float32 if self.invariant else self.dtype
        values = torch.empty(shape, dtype=dtype, device=self.device)
        keys = torch.empty(key_shape, dtype=dtype, device=self.device)  # transposed under the kernel
        if self.length:
            self._keys(keys)[:, :, : self.length] = self._keys()[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def _keys(self, keys: Tensor | None = None) -> Tensor:
        """The key cache (or `keys`) as [layers, Hkv, capacity, hd], a view."""
        keys = self.keys if keys is None else keys
        return keys.transpose(2, 3) if self.invariant else keys

    @torch.inference_mode()
    def forward(
        self, ids: Tensor, positions: Tensor, visible: Tensor | None, logits_to_keep: int = 0
    ) -> tuple[Tensor, list[Tensor]]:
        """ids, positions [n]; visible [n, n] bool among the new tokens (None: causal). Their K/V go to slots
        length..length+n. Returns logits [r, V] of the last r = logits_to_keep rows (0: all) and the feature
        taps [n, D] each (layer i's output; the last layer's after the final norm, as transformers reports it).
        """
        n, start = ids.numel(), self.length
        end = start + n
        self._reserve(end)
        groups = self.heads // self.kv_heads
        x = self.embed(ids)  # [n, D]
        cos, sin = self.rotary(x[None], positions[None])  # [1, n, hd]
        cos, sin = cos[0], sin[0]
        # trees and one-token steps attend through the batch-invariant kernel, so that a tree's rows equal the
        # steps' bit for bit; a causal run of several tokens (a prompt's prefill, which speculative and
        # autoregressive decoding share) through sdpa, the fastest
        invariant = self.invariant and (visible is not None or n == 1)
        if visible is None and n > 1:
            visible = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        elif visible is None and invariant:
            visible = torch.ones(1, 1, dtype=torch.bool, device=ids.device)
        mask = None
        if n > 1 and not invariant:
            # [1, 1, g·n, L+n], rows in the order of the stacked query heads
            mask = additive_mask(visible, start, x.dtype).repeat(groups, 1)[None, None]
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):

            def attend(q: Tensor, k: Tensor, v: Tensor, i: int = i) -> Tensor:  # [H, n, hd], [Hkv, n, hd] x 2
                self._keys()[i, :, start:end], self.values[i, :, start:end] = k, v
                if invariant:
                    q = q.reshape(self.kv_heads, groups, n, self.head_dim)
                    out = invariant_attention(q, self.keys[i], self.values[i], visible, start, self.head_dim**-0.5)
                    return out.view(self.heads, n, self.head_dim)
                keys, values = self._keys()[i, :, :end], self.values[i, :, :end]  # [Hkv, L+n, hd]
                if self.invariant:  # a prefill under the kernel: sdpa in the model's dtype
                    keys, values = (k, v) if start == 0 else (keys.to(self.dtype), values.to(self.dtype))
                q = q.reshape(1, self.kv_heads, groups * n, self.head_dim)  # heads j·g .. j·g+g-1 share KV head j
                # 4D: CPU's fused kernel
                out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask)
                return out.view(self.heads, n, self.head_dim)  # [H, n, hd]

            x = decoder_layer(layer, x, cos, sin, self.head_shape, attend, self.linear)
            if i in self.feature_layers:
                taps[i] = x
        x = _rms(self.final_norm, x)
        taps[self.last_layer] = x  # transformers reports the last layer after the final norm
        self.length = end
        rows = x[-logits_to_keep:] if logits_to_keep else x
        return self.linear(rows, self.lm_head.weight, self.lm_head.bias).float(), [taps[i] for i in self.feature_layers]

    def keep(self, start: int, slots: Tensor) -> None:
        """Moves cache entries `slots` [m] to start..start+m-1 in every layer and drops everything after."""
        m = slots.numel()
        keys = self._keys()
        keys[:, :, start : start + m] = keys[:, :, slots]
        self.values[:, :, start : start + m] = self.values[:, :, slots]
        self.length = start + m

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The cached keys and values of one layer, [Hkv, length, hd] each, in the model's dtype (views; copies of
        the float cache under the invariant kernel)."""
        keys, values = self._keys()[layer, :, : self.length], self.values[layer, :, : self.length]
        return keys.to(self.dtype), values.to(self.dtype)
