"""The DFlash training objective: random anchors in the response, one masked block per anchor, decayed CE.

For a sequence x_0..x_{L-1} whose response starts at s, an anchor a satisfies s <= a and a+1 < L (the anchor
and its first target are both response tokens). Its block [x_a, MASK × (bs−1)] sits at positions a..a+bs−1
and sees the target's features of x_0..x_{a−1} (ctx_lens = a) and itself, never another block: exactly what
the drafter sees at inference, where the anchor is the last committed token. Slot k = 1..bs−1 predicts
x_{a+k}; slots past the sequence end are masked out. The loss is the cross-entropy averaged over valid slots
with weight exp(−(k−1)/γ): early slots matter most, since a draft is accepted only up to its first miss.
γ = 7 is DFlash's choice for block size 16 (the reference recipe uses 5 for 10 and 4 for 8).

`loss="kl"` (Draft-OPD's position-wise distillation) replaces the sampled token x_{a+k} by the target's whole
next-token distribution p at position a+k−1: slot k minimises the cross-entropy H(p, q) = KL(p ‖ q) + H(p)
of its draft distribution q. p comes from the feature cache as its top-k probabilities plus the remaining
mass r, so the loss is exact on the (k+1)-way partition {top-k tokens, the rest}:
    −Σ_{i ≤ k} p_i log q_i − r · log(1 − Σ_{i ≤ k} q_i).
`ce+kl` adds both.

A drafter with a draft vocabulary (drafters/vocab.py) has logits over its Vd tokens only: a slot whose
token lies outside gets no loss (the drafter cannot propose it, so it only counts as a miss), and in kl the
target's mass on such tokens joins the rest r.

Features come from the frozen target (one causal forward per batch), logits from its frozen LM head, block
embeddings from its frozen input embeddings; only the drafter trains.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from exitspec.drafters.dflash_model import DFlashModel
from exitspec.drafters.vocab import DraftHead
from exitspec.target import cache_argument


def position_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """[bs−1]: the loss weight exp(−(k−1)/γ) of block slot k = 1..bs−1."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def sample_anchors(starts: Tensor, lengths: Tensor, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to n distinct anchors per sequence, uniformly among starts[b] <= a < lengths[b] − 1, ascending.

    starts, lengths [B] (CPU). Returns anchors [B, N] and keep [B, N] bool, N = min(n, most valid anchors of
    any row); a row with fewer valid anchors pads with anchor 0 and keep False.
    """
    width = int(lengths.max()) - 1
    pos = torch.arange(max(width, 0))  # [W]
    valid = (pos >= starts[:, None]) & (pos < lengths[:, None] - 1)  # [B, W]
    counts = valid.sum(dim=1)  # [B]
    n = min(n, int(counts.max()) if counts.numel() else 0)
    if n == 0:
        raise ValueError("no sequence in the batch has a response of at least two tokens")
    noise = torch.rand(valid.shape, generator=generator).masked_fill(~valid, 2.0)
    picked = noise.argsort(dim=1)[:, :n]  # [B, N]: valid positions first, in random order
    keep = torch.arange(n) < counts[:, None]  # [B, N]
    anchors = torch.where(keep, picked, width).sort(dim=1).values  # invalid ones sort last
    keep = anchors < width
    return anchors.masked_fill(~keep, 0), keep


def real_tokens(ids: Tensor, lengths: Tensor) -> Tensor:
    """[B, L] bool: the positions of ids [B, L] before each row's length (right padding after)."""
    return torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]


class _StopForward(Exception):
    """Raised by a forward hook once the deepest feature layer has run: later layers are not needed."""


@torch.no_grad()
def target_features(model: PreTrainedModel, ids: Tensor, lengths: Tensor, layer_ids) -> Tensor:
    """ids [B, L] right-padded to lengths [B] -> features [B, L, F]: outputs of the target decoder layers
    `layer_ids` (HF hidden_states[i+1]), concatenated. Rows past a sequence's end are padding garbage.

    The forward stops after the deepest layer in `layer_ids` (hooks on the decoder layers), so a drafter that
    reads the middle layer pays for half the target. A tap of the last layer runs the whole model instead,
    since HF's hidden_states[L] is the final-normed state, not the last layer's raw output."""
    decoder, deepest = model.get_decoder(), max(layer_ids)
    if deepest >= len(decoder.layers) - 1:
        return features_and_logits(model, ids, lengths, layer_ids, logits_to_keep=1)[0]
    mask = real_tokens(ids, lengths).long()  # [B, L]: HF's padding mask
    taps: dict[int, Tensor] = {}

    def tap(i: int):
        def hook(_module, _args, output):
            taps[i] = output[0] if isinstance(output, tuple) else output  # [B, L, D]
            if i == deepest:
                raise _StopForward

        return hook

    handles = [decoder.layers[i].register_forward_hook(tap(i)) for i in set(layer_ids)]
    try:
        decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat([taps[i] for i in layer_ids], dim=-1)


@torch.no_grad()
def features_and_logits(
    model: PreTrainedModel, ids: Tensor, lengths: Tensor, layer_ids, logits_to_keep: int = 0
) -> tuple[Tensor, Tensor]:
    """One whole target forward: the features [B, L, F] of `target_features` and the logits [B, r, V] of the last
    r = logits_to_keep positions (0: all L)."""
    mask = real_tokens(ids, lengths).long()  # [B, L]: HF's padding mask
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False,
                logits_to_keep=logits_to_keep)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out.logits


@torch.no_grad()
def features_and_cache(model: PreTrainedModel, ids: Tensor, lengths: Tensor, layer_ids) -> tuple[Tensor, DynamicCache]:
    """One whole decoder forward (no LM head): the features [B, L, F] of `target_features` and the KV cache of
    all L positions, from which `tree_eval.tree_logits` scores the anchors' trees without running the context
    again. The last layers past the deepest tap cost L rows; the context they spare the tree forward costs
    up to L rows through every layer."""
    mask = real_tokens(ids, lengths).long()  # [B, L]: HF's padding mask
    cache, decoder = DynamicCache(config=model.config), model.get_decoder()
    out = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=True,
                  **{cache_argument(decoder): cache})
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), cache


class BlockLoss(NamedTuple):
    loss: Tensor  # scalar: the weighted mean over valid slots of the chosen loss (ce, kl or both)
    ce: Tensor  # [B, N, bs−1] per-slot cross-entropy (also at invalid slots, where it means nothing)
    weights: Tensor  # [B, N, bs−1] loss weights, 0 at invalid slots
    correct: Tensor  # [B, N, bs−1] bool: a valid slot whose argmax is the true token
    logits: Tensor  # [B, N, bs−1, Vd] the drafted slots' logits over the draft vocabulary (with grad)


class DFlashObjective(nn.Module):
    """The drafter plus the target's frozen embeddings and LM head: the module that DDP wraps."""

    def __init__(
        self, drafter: DFlashModel, embed: nn.Embedding, lm_head: nn.Module, gamma: float = 7.0, loss: str = "ce"
    ):
        super().__init__()
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.head = DraftHead(lm_head, drafter.draft_vocab)  # logits over the drafter's vocabulary [.., Vd]
        self.gamma, self.loss = gamma, loss

    def draft_logits(self, ids: Tensor, features: Tensor, anchors: Tensor) -> Tensor:
        """The drafted slots' logits [B, N, bs−1, Vd] of the blocks at anchors [B, N] of ids [B, L], whose
        context rows are features [B, L, F] (row j: the target's features of ids[:, j])."""
        drafter, bs = self.drafter, self.drafter.block_size
        b, n = anchors.shape
        dtype = drafter.fc.weight.dtype
        offsets = torch.arange(bs, device=ids.device)  # [bs]
        blocks = drafter.block_embeddings(ids.gather(1, anchors), self.embed).to(dtype)  # [B, N*bs, D]
        positions = (anchors[..., None] + offsets).flatten(1)  # [B, N*bs]
        ctx_positions = torch.arange(ids.shape[1], device=ids.device).expand(b, -1)  # [B, L]
        hidden = drafter(blocks, positions, features.to(dtype), ctx_positions, anchors)  # [B, N*bs, D]
        hidden = hidden.view(b, n, bs, -1)[:, :, 1:].reshape(b * n * (bs - 1), -1)  # [B·N·(bs−1), D]: drafted slots
        # a contiguous 2D input makes the LM head one matmul; the strided 4D view fell back to a bmm ~10x slower
        return self.head(hidden).float().view(b, n, bs - 1, -1)  # [B, N, bs−1, Vd]

    def slot_targets(self, ids: Tensor, lengths: Tensor, anchors: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Each drafted slot's token [B, N, bs−1] (x_{a+k} for slot k) and whether the slot counts (kept anchor,
        inside its sequence)."""
        target_pos = anchors[..., None] + torch.arange(1, self.drafter.block_size, device=ids.device)  # [B, N, bs−1]
        valid = keep[..., None] & (target_pos < lengths[:, None, None])
        return ids.gather(1, target_pos.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(target_pos), valid

    def forward(
        self, ids: Tensor, features: Tensor, lengths: Tensor, anchors: Tensor, keep: Tensor,
        soft: tuple[Tensor, Tensor] | None = None,
    ) -> BlockLoss:
        """ids [B, L], features [B, L, F], lengths [B], anchors / keep [B, N] (see `sample_anchors`); soft: the
        target's top-k probabilities and token ids at every position, [B, L, k] each (needed by kl)."""
        bs = self.drafter.block_size
        logits = self.draft_logits(ids, features, anchors)  # [B, N, bs−1, Vd]
        targets, valid = self.slot_targets(ids, lengths, anchors, keep)  # [B, N, bs−1] each
        columns = self.head.columns(targets)  # [B, N, bs−1]: −1 where the token is outside the draft vocabulary
        inside = columns >= 0  # a token the drafter cannot propose gets no loss: its slot only counts as wrong
        log_q = logits.log_softmax(dim=-1)  # [B, N, bs−1, Vd], once for ce and kl alike
        ce = -log_q.gather(-1, columns.clamp(min=0)[..., None]).squeeze(-1) * inside  # [B, N, bs−1]
        weights = valid * inside * position_weights(bs, self.gamma, ids.device)  # [B, N, bs−1]
        per_slot = ce
        if self.loss != "ce":
            if soft is None:
                raise ValueError(f"the {self.loss} loss needs the target's top-k probabilities "
                                 "(a --topk feature cache)")
            top_probs, top_ids = soft
            where = (anchors[..., None] + torch.arange(bs - 1, device=ids.device)).clamp(max=ids.shape[1] - 1)
            # [B, N, bs−1]: slot k reads the target's p at position a + k − 1, the one that predicts x_{a+k}
            kl = soft_cross_entropy(log_q, top_probs, self.head.columns(top_ids.long()), where)  # [B, N, bs−1]
            per_slot = kl if self.loss == "kl" else ce + kl
        loss = (per_slot * weights).sum() / weights.sum().clamp(min=1e-12)
        correct = (logits.argmax(dim=-1) == columns) & valid
        return BlockLoss(loss, ce, weights, correct, logits)


def soft_cross_entropy(log_q: Tensor, top_probs: Tensor, top_columns: Tensor, positions: Tensor) -> Tensor:
    """H(p, q) on the partition {top-k tokens, the rest}: log_q [B, N, S, Vd], the draft's log-probabilities;
    top_probs / top_columns [B, L, k] of the target's p at every position (a token's column in the draft logits, −1 for
    one outside the draft vocabulary: its mass joins the rest); positions [B, N, S]: where each slot's p is read.
    Returns [B, N, S]."""
    b, n, s, _ = log_q.shape
    k = top_probs.shape[-1]
    where = positions.flatten(1)[..., None].expand(-1, -1, k)  # [B, N·S, k]
    idx = top_columns.gather(1, where).view(b, n, s, k)  # [B, N, S, k]
    inside = idx >= 0
    p = top_probs.gather(1, where).view(b, n, s, k).float() * inside  # [B, N, S, k]
    log_q_top = log_q.gather(-1, idx.clamp(min=0))  # [B, N, S, k]; read where inside
    rest_p = (1.0 - p.sum(dim=-1)).clamp(min=0.0)  # [B, N, S]
    rest_log_q = torch.log1p(-(log_q_top.exp() * inside).sum(dim=-1).clamp(max=1.0 - 1e-6))  # log(1 − Σ_top q)
    return -(p * log_q_top).sum(dim=-1) - rest_p * rest_log_q
