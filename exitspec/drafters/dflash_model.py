"""The DFlash draft network: a few Qwen3-style decoder layers that denoise a whole block in one pass.

A block is [anchor, MASK × (bs−1)], embedded with the target's frozen input embeddings. Every draft layer
attends, bidirectionally inside the block, to the block itself and to the target's context: the hidden
states of the target layers `target_layer_ids` (layer i's output = HF `hidden_states[i+1]`), concatenated,
fused by `fc` (no bias) and `hidden_norm`, then projected by each layer's own k/v projections into extra
keys and values placed before the block's. The final `norm` feeds the target's frozen LM head; block slot
k = 1..bs−1 gives the logits of the token k steps after the anchor.

Checkpoints use the released z-lab layout (e.g. "z-lab/Qwen3-8B-DFlash-b16"): a Qwen3-style config.json
with `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids, mask_token_id}`, and a
model.safetensors with keys fc.weight, hidden_norm.weight, norm.weight and, per layer N,
layers.N.{input_layernorm, post_attention_layernorm}.weight, layers.N.self_attn.{q,k,v,o}_proj.weight,
layers.N.self_attn.{q,k}_norm.weight and layers.N.mlp.{gate,up,down}_proj.weight. A target without a mask
token (SmolLM2) gets a learned `mask_embedding` [D] instead: `mask_token_id: null` and
`mask_embedding: "learned"` in dflash_config, and one more tensor in the safetensors file.

A drafter trained with `context_window: W` (in dflash_config) lets each block see only the last W context
rows, at training and at inference; it attends over at most W + bs keys, whatever the context length.

Attention positions are absolute: context row j sits at its token's position, block slot k at the anchor's
position + k (the anchor at position = number of context tokens before it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from exitspec.atomic import atomic_folder
from exitspec.drafters.vocab import check_draft_vocab
from exitspec.jsonfiles import read_json
from exitspec.lean import apply_rope, rms_norm
from exitspec.models import check_safetensors

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
LEARNED_MASK = "learned"
# later reference variants (DFlash2 and others): embedding/logit scaling, conv mixers, a candidate selector
_UNSUPPORTED = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping", "conv_kernel_size",
                "selector_rank")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default context layers: the middle layer for one draft layer, else `num_draft_layers`
    ids spread evenly from layer 1 to layer L−3 (Python's round, so halves go to the even neighbour)."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need >= 1 target and draft layers, got {num_target_layers} and {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int  # D, must equal the target's hidden size
    intermediate_size: int
    num_hidden_layers: int  # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # must equal the target's
    target_layer_ids: tuple[int, ...]  # 0-based target decoder layers whose outputs form the context
    num_target_layers: int | None = None
    block_size: int = 16
    mask_token_id: int | None = None  # None: a learned mask embedding
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    context_window: int | None = None  # blocks see only the last W context rows (None: all, as released)
    draft_vocab_size: int | None = None  # Vd: logits over the checkpoint's `draft_vocab` ids only (vocab.py)

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor and a drafted slot), got {self.block_size}")
        if self.context_window is not None and self.context_window < 1:
            raise ValueError(f"context_window must be >= 1 or None, got {self.context_window}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids must be non-empty and >= 0, got {list(self.target_layer_ids)}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")

    @property
    def feature_size(self) -> int:
        """F: width of the concatenated target features fed to `fc`."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        """Parses a released-format config.json (fields in `dflash_config` win over top-level ones)."""
        dflash = d.get("dflash_config") or {}
        missing = object()

        def field(name, default=missing):
            value = dflash.get(name, d.get(name, default))
            if value is missing:
                raise ValueError(f"DFlash config.json has no `{name}`")
            return value

        scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"DFlash drafter supports default RoPE only, got {scaling}")
        if field("hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash drafter supports hidden_act 'silu' only, got {field('hidden_act')!r}")
        extras = [k for k in _UNSUPPORTED if field(k, None) not in (None, 1.0)]
        if extras:
            raise ValueError(f"DFlash config.json uses {extras}, which this drafter does not implement")
        layer_types = set(field("layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or field("is_causal", False):
            raise ValueError(f"DFlash drafter supports non-causal full-attention layers only, got {layer_types}")
        hidden, heads = int(field("hidden_size")), int(field("num_attention_heads"))
        layers = int(field("num_hidden_layers"))
        num_target_layers = field("num_target_layers", None)
        ids = field("target_layer_ids", None)
        if ids is None:
            if num_target_layers is None:
                raise ValueError("DFlash config.json needs dflash_config.target_layer_ids or num_target_layers")
            ids = build_target_layer_ids(int(num_target_layers), layers)
        mask_token_id = field("mask_token_id", None)
        if mask_token_id is None and field("mask_embedding", None) != LEARNED_MASK:
            raise ValueError("DFlash config.json names no mask_token_id and no `mask_embedding: learned`")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(field("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(field("num_key_value_heads", heads)),
            head_dim=int(field("head_dim", None) or hidden // heads),
            vocab_size=int(field("vocab_size")),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            block_size=int(field("block_size", 16)),
            mask_token_id=None if mask_token_id is None else int(mask_token_id),
            rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(d),
            max_position_embeddings=int(field("max_position_embeddings", 40960)),
            attention_bias=bool(field("attention_bias", False)),
            context_window=None if field("context_window", None) is None else int(field("context_window")),
            draft_vocab_size=None if field("draft_vocab_size", None) is None else int(field("draft_vocab_size")),
        )

    def to_dict(self) -> dict:
        """The released config.json layout, plus `mask_embedding: learned` when there is no mask token."""
        dflash = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        if self.context_window is not None:
            dflash["context_window"] = self.context_window
        if self.draft_vocab_size is not None:
            dflash["draft_vocab_size"] = self.draft_vocab_size
        if self.mask_token_id is None:
            dflash["mask_embedding"] = LEARNED_MASK
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
        }

    @classmethod
    def load(cls, folder) -> DFlashConfig:
        path = Path(folder) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}; it is not a DFlash checkpoint folder")
        return cls.from_dict(read_json(path))

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int | None = None) -> None:
        """Raises ValueError unless a target with these sizes can drive this drafter."""
        if hidden_size != self.hidden_size:
            raise ValueError(
                f"DFlash drafter hidden_size {self.hidden_size} does not match the target's hidden size "
                f"{hidden_size} (draft blocks use the target's embeddings and LM head)"
            )
        if vocab_size != self.vocab_size:
            raise ValueError(f"DFlash drafter vocab_size {self.vocab_size} does not match the target's {vocab_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(f"DFlash mask_token_id {self.mask_token_id} is outside the vocabulary [0, {vocab_size})")
        if num_layers is not None and self.num_target_layers not in (None, num_layers):
            raise ValueError(
                f"DFlash drafter was trained on a target of {self.num_target_layers} decoder layers "
                f"(num_target_layers), but this target has {num_layers}"
            )
        if num_layers is not None and max(self.target_layer_ids) >= num_layers:
            raise ValueError(
                f"DFlash drafter reads target layers {list(self.target_layer_ids)} (dflash_config.target_layer_ids) "
                f"but the target has only {num_layers} decoder layers (0..{num_layers - 1})"
            )


def rope_theta(config) -> float:
    """RoPE base of an HF config or config dict (legacy `rope_theta` or transformers-5 `rope_parameters`)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    theta = get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


# ---------------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin [..., hd] fp32 of integer positions [...] (half-split layout, as HF Llama/Qwen3), for
    lean.apply_rope."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions[..., None].float() * inv_freq  # [..., hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., hd]
    return angles.cos(), angles.sin()


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Block queries over [context keys, block keys]; q/k RMS-normed per head before RoPE, GQA."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_head, self.n_kv_head, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        if self.n_head % self.n_kv_head:
            raise ValueError(f"attention heads {self.n_head} is not a multiple of kv heads {self.n_kv_head}")
        self.q_proj = nn.Linear(d, self.n_head * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_head * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_head * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_head * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, D] -> keys (normed, rotated) and values, each [B, Hkv, T, hd]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor | None
    ) -> Tensor:
        """x [B, T, D]; ctx_k, ctx_v [B, Hkv, C, hd]; mask [B, 1, T, C+T] bool (True = may attend) or None."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_head, self.head_dim)).transpose(1, 2)  # [B, H, T, hd]
        q = apply_rope(q, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # [B, Hkv, C+T, hd]
        gqa = self.n_head > self.n_kv_head  # query heads h·g .. h·g+g−1 read KV head h
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # [B, H, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor | None
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------------------
# The model


class DFlashModel(nn.Module):
    """The draft network. It owns no embeddings or LM head: those are the target's, frozen."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(config.feature_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if config.mask_token_id is None else None
        self._rope_table: tuple[Tensor, Tensor] | None = None  # cos, sin [1, 1, P, hd] (`rope`), on first use
        size = config.draft_vocab_size
        self.register_buffer("draft_vocab", None if size is None else torch.arange(size))  # [Vd] token ids, or None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @classmethod
    def for_target(
        cls,
        target_config,
        num_layers: int = 1,
        block_size: int = 16,
        std: float = 0.02,
        target_layer_ids: tuple[int, ...] | None = None,
        context_window: int | None = None,
    ) -> DFlashModel:
        """A freshly initialised drafter sized for an HF target config, reading `target_layer_ids` (default:
        the reference's choice, `build_target_layer_ids`) over the last `context_window` rows (None: all)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = tc.num_attention_heads
        config = DFlashConfig(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=tc.vocab_size,
            target_layer_ids=tuple(target_layer_ids or build_target_layer_ids(tc.num_hidden_layers, num_layers)),
            num_target_layers=tc.num_hidden_layers,
            block_size=block_size,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=rope_theta(tc),
            max_position_embeddings=tc.max_position_embeddings,
            context_window=context_window,
        )
        model = cls(config)
        model.reset_parameters(std)
        return model

    def reset_parameters(self, std: float = 0.02) -> None:
        """Fresh init: linear weights and the mask embedding ~ N(0, std²), biases 0, norm weights 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, std=std)

    def use_draft_vocab(self, vocab: Tensor) -> None:
        """Restricts the drafter's logits to the token ids `vocab` [Vd] (ascending; see vocab.py)."""
        check_draft_vocab(vocab, self.config.vocab_size, "use_draft_vocab")
        self.config.draft_vocab_size = vocab.numel()
        self.register_buffer("draft_vocab", vocab.to(self.fc.weight.device))

    @torch.no_grad()
    def rescale_fc(self, features: Tensor) -> None:
        """Data-dependent init of a fresh drafter: divides fc's input column j by the RMS of feature dim j over
        `features` [n, F] (context rows of real text). LLM residual streams carry a few massive-activation
        dims (in SmolLM2-135M layer 27, one dim's RMS is ~30× the median), which would otherwise dominate
        the randomly fused context, making every context row look alike at the start of training."""
        rms = features.float().pow(2).mean(dim=0).sqrt().clamp(min=1e-6)  # [F]
        self.fc.weight.div_(rms.to(self.fc.weight.dtype))

    # -- inputs --------------------------------------------------------------------------------------------

    def block_embeddings(self, anchor_ids: Tensor, embed: nn.Embedding) -> Tensor:
        """anchor_ids [B, N] -> [B, N*bs, D]: N blocks [anchor, MASK × (bs−1)] in the target's embedding space."""
        b, n = anchor_ids.shape
        anchors = embed(anchor_ids)  # [B, N, D]
        if self.mask_embedding is None:
            mask = embed.weight[self.config.mask_token_id]
        else:
            mask = self.mask_embedding.to(anchors.dtype)
        masks = mask.expand(b, n, self.block_size - 1, mask.shape[-1])
        return torch.cat([anchors[:, :, None], masks], dim=2).flatten(1, 2)

    def context_kv(self, ctx_features: Tensor, ctx_positions: Tensor | range) -> tuple[Tensor, Tensor]:
        """Target features [B, C, F] at positions [B, C] (or a range of C) -> every layer's context keys and values,
        each [layers, B, Hkv, C, hd]. These are what the inference cache stores per committed token."""
        ctx = self.hidden_norm(self.fc(ctx_features))  # [B, C, D]
        cos, sin = self.rope(ctx_positions, ctx.dtype)
        kv = [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def rope(self, positions: Tensor | range, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, hd] of positions [B, T]; a range of T positions (one sequence, B = 1, the
        decode loop's) is a slice of a table made once and grown by doubling, the same numbers without the ops."""
        cfg = self.config
        if not isinstance(positions, range):
            cos, sin = rope(positions[:, None], cfg.head_dim, cfg.rope_theta)  # [B, 1, T, hd] each
        else:
            table, device = self._rope_table, self.fc.weight.device
            if table is None or table[0].device != device or table[0].shape[2] < positions.stop:
                size = max(positions.stop, 2 * (0 if table is None else table[0].shape[2]), 1024)
                table = self._rope_table = tuple(t[None, None] for t in rope(torch.arange(size, device=device),
                                                                             cfg.head_dim, cfg.rope_theta))
            cos, sin = (t[:, :, positions.start : positions.stop] for t in table)  # [1, 1, T, hd] each: views
        return cos.to(dtype), sin.to(dtype)

    # -- forward passes ------------------------------------------------------------------------------------

    def decode(
        self, block_embeds: Tensor, block_positions: Tensor | range, ctx_k: Tensor, ctx_v: Tensor,
        mask: Tensor | None = None,
    ) -> Tensor:
        """The layer stack over block tokens given projected context K/V (from `context_kv` or a cache).

        block_embeds [B, T, D], block_positions [B, T] (or a range of T), ctx_k / ctx_v [layers, B, Hkv, C, hd],
        mask [B, T, C+T] bool (True = may attend) or None = every query sees everything. Returns the
        final-normed hidden states [B, T, D]."""
        cos, sin = self.rope(block_positions, block_embeds.dtype)
        attn_mask = None if mask is None else mask[:, None]  # [B, 1, T, C+T], shared by all heads
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], attn_mask)
        return self.norm(x)

    def forward(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        ctx_features: Tensor,
        ctx_positions: Tensor,
        ctx_lens: Tensor,
    ) -> Tensor:
        """Training-style pass: N blocks per row over one shared context, blocks blind to each other.

        block_embeds [B, N*bs, D] (see `block_embeddings`), block_positions [B, N*bs], ctx_features [B, C, F],
        ctx_positions [B, C], ctx_lens [B, N]: block n sees context rows [0, ctx_lens[b, n]) (the tokens
        strictly before its anchor) and its own bs slots, bidirectionally. Returns hidden states [B, N*bs, D];
        slot k of a block predicts the token k steps after its anchor."""
        ctx_k, ctx_v = self.context_kv(ctx_features, ctx_positions)
        mask = block_attention_mask(ctx_lens, self.block_size, ctx_features.shape[1], self.config.context_window)
        return self.decode(block_embeds, block_positions, ctx_k, ctx_v, mask)

    # -- checkpoints ---------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder, device=None, dtype: torch.dtype | None = None) -> DFlashModel:
        """Loads a released-format checkpoint folder (safetensors only, no remote code); ValueError names
        every missing, unexpected or mis-shaped tensor."""
        folder = Path(folder)
        config = DFlashConfig.load(folder)
        weights = folder / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME} (DFlash checkpoints load from safetensors only)")
        check_safetensors(weights, "retrain or re-download the drafter")
        with torch.device("meta"):
            model = cls(config)
        tensors = load_file(weights)
        model.check_state_dict(tensors, source=str(weights))
        model.load_state_dict(tensors, assign=True)
        if model.draft_vocab is not None:
            check_draft_vocab(model.draft_vocab, config.vocab_size, str(weights))
        return model.to(device=device, dtype=dtype).eval()

    def check_state_dict(self, tensors: dict[str, Tensor], source: str = "checkpoint") -> None:
        expected = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        problems = []
        if missing := sorted(expected.keys() - tensors.keys()):
            problems.append(f"missing tensors {missing}")
        if unexpected := sorted(tensors.keys() - expected.keys()):
            problems.append(f"unexpected tensors {unexpected}")
        for k in sorted(expected.keys() & tensors.keys()):
            if tuple(tensors[k].shape) != expected[k]:
                problems.append(f"{k} has shape {tuple(tensors[k].shape)}, the config implies {expected[k]}")
        if problems:
            raise ValueError(f"{source} does not match its {CONFIG_NAME}: " + "; ".join(problems))

    def save_pretrained(self, folder) -> None:
        """Writes config.json + model.safetensors into a temporary sibling folder, then renames it into place.
        An existing folder is replaced only if it holds nothing but those two files."""
        folder = Path(folder)
        if folder.exists() and not {p.name for p in folder.iterdir()} <= {CONFIG_NAME, WEIGHTS_NAME}:
            raise FileExistsError(f"{folder} exists and holds other files; refusing to replace it")
        with atomic_folder(folder) as tmp:
            (tmp / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
            os.chmod(tmp / WEIGHTS_NAME, 0o644)  # readable like config.json (safetensors writes 0600)


def block_attention_mask(ctx_lens: Tensor, block_size: int, ctx_len: int, window: int | None = None) -> Tensor:
    """[B, N*bs, C+N*bs] bool: block n's queries see context rows < ctx_lens[b, n] (only the last `window` of
    them when given) and their own block."""
    b, n = ctx_lens.shape
    t = n * block_size
    device = ctx_lens.device
    seen = ctx_lens.repeat_interleave(block_size, dim=1)[..., None]  # [B, T, 1]
    rows = torch.arange(ctx_len, device=device)  # [C]
    ctx = rows < seen  # [B, T, C]
    if window is not None:
        ctx &= rows >= seen - window
    block_of = torch.arange(t, device=device) // block_size  # [T]
    own = (block_of[:, None] == block_of[None, :]).expand(b, t, t)  # [B, T, T]
    return torch.cat([ctx, own], dim=-1)
