"""The target distribution that exactness refers to: logits → warped probabilities.

Speculative decoding is exact with respect to the *warped* target distribution: temperature first, then
top-k, then top-p (the order Hugging Face's `generate` applies them), renormalised. Temperature 0 is
greedy decoding, represented as the one-hot distribution on the first argmax, so every verifier reproduces
the target's greedy output token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1.0 keeps every token

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_finite(logits: Tensor) -> None:
    """Raises ValueError naming the first row of `logits` [..., V] with a NaN or inf entry."""
    finite = torch.isfinite(logits).all(dim=-1)  # [...]
    if not bool(finite.all()):
        row = tuple(torch.nonzero(~finite)[0].tolist())
        raise ValueError(f"logits contain NaN or inf (first bad row {row}); refusing to verify against them")


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits → [..., V] float32 target probabilities after temperature, top-k and top-p."""
    check_finite(logits)
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Keeps the smallest most-probable set whose mass reaches top_p (at least one token), renormalised."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V]
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
