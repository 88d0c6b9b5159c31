"""The target distribution that exactness refers to: logits → warped probabilities.

Speculative decoding is exact with respect to the *warped* target distribution: temperature first, then
top-k, then top-p (the order Hugging Face's `generate` applies them), renormalised. Temperature 0 is
greedy decoding, represented as the one-hot distribution on the first argmax, so every verifier reproduces
the target's greedy output token for token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def check_logits(logits: Tensor) -> None:
    """Raises ValueError naming the first row of `logits` [..., V] that no distribution can come from.

    A row may hold -inf entries (a masked vocabulary, a logit processor's ban) as long as its maximum is
    finite; NaN, +inf and all -inf rows are refused. The row maximum screens all three at once (max
    propagates NaN), so valid input costs one reduction.
    """
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    finite_max = torch.isfinite(logits.amax(dim=-1))  # [...]
    if not bool(finite_max.all()):
        row = tuple(torch.nonzero(~finite_max)[0].tolist())
        raise ValueError(
            f"logits row {row} holds NaN or +inf, or only -inf; refusing to verify against it"
        )


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits → [..., V] float32 target probabilities after temperature, top-k and top-p."""
    check_logits(logits)
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


def _nucleus(probs: Tensor, top_p: float, candidates: tuple[int, ...] = (64, 1024)) -> Tensor:
    """Keeps the smallest most-probable set whose mass reaches top_p (at least one token), renormalised.

    A token is kept when the mass of the tokens ranked above it is below top_p. Each row's nucleus is looked
    for in its top-k tokens for growing k (a language model's nucleus is usually small); rows whose nucleus
    is larger than every k are sorted in full.
    """
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)  # [R, V]
    kept = torch.zeros_like(flat)
    todo = torch.arange(flat.shape[0], device=probs.device)  # rows still without a nucleus
    for k in candidates:
        if k >= vocab or todo.numel() == 0:
            break
        top, order = torch.topk(flat[todo], k, dim=-1)  # [r, k] descending
        found = torch.cumsum(top, dim=-1)[:, -1] >= top_p  # [r] the nucleus lies inside the top k
        kept[todo[found]] = _keep_nucleus(top[found], order[found], top_p, vocab)
        todo = todo[~found]
    if todo.numel():
        full, full_order = torch.sort(flat[todo], dim=-1, descending=True)  # [r, V]
        kept[todo] = _keep_nucleus(full, full_order, top_p)
    kept = kept.reshape(probs.shape)
    return kept / kept.sum(dim=-1, keepdim=True)


def _keep_nucleus(sorted_probs: Tensor, order: Tensor, top_p: float, vocab: int | None = None) -> Tensor:
    """sorted_probs/order [r, k] (descending) → [r, V] probabilities with the tokens outside the nucleus zeroed."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [r, k]
    kept = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    out = torch.zeros(order.shape[0], vocab or order.shape[-1], dtype=kept.dtype, device=kept.device)
    return out.scatter_(-1, order, kept)


def sample_rows(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of probs [..., V] (unnormalised is fine) by inverse CDF → [...] int64.

    A cumulative sum and a binary search per row; several times faster than torch.multinomial on CPU.
    The draw is clamped to the last token with positive mass so that rounding can never pick a zero.
    """
    return sample_cdf(torch.cumsum(probs, dim=-1), generator)


def sample_list(weights: list[float], generator: torch.Generator | None = None) -> int:
    """sample_rows for one row of a few dozen weights held in a Python list (a tree's exit masses), where the
    loop costs less than a tensor's cumulative sum and search; never an index of zero weight."""
    device = generator.device if generator is not None else None
    u = float(torch.rand(1, generator=generator, device=device)) * sum(weights)
    last = 0
    for i, w in enumerate(weights):
        if w > 0:
            last, u = i, u - w
            if u < 0:
                return i
    return last


def sample_cdf(cdf: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """sample_rows from the cumulative sums cdf [..., V] of unnormalised weights → [...] int64."""
    total = cdf[..., -1:].contiguous()  # [..., 1]
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype) * total
    drawn = torch.searchsorted(cdf, u, right=True)
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(drawn, last_positive).squeeze(-1)


class WarpedRows:
    """The target distribution of a tree's nodes (target_probs of logits [N+1, V]), warped row by row when a
    verifier first reads a row, and kept. TEV reads only the rows of nodes with children (for the edge
    probabilities) and the exit node's row (for its residual): on a 32-node tree that is about half the rows,
    so half the warp, which is most of the verify stage."""

    def __init__(self, logits: Tensor, params: SamplingParams):
        self.logits, self.params = logits, params  # [N+1, V]
        self.plain = not (params.greedy or params.top_k or params.top_p < 1.0)  # temperature alone: p = softmax(l/T)
        self._rows: dict[int, Tensor] = {}
        self._log_norm: dict[int, float] = {}  # plain rows whose logsumexp(l/T) `edges` computed
        self._all: Tensor | None = None

    def rows(self, nodes: Sequence[int]) -> Tensor:
        """[len(nodes), V] float32: the warped rows of `nodes`, each warped once."""
        missing = [v for v in dict.fromkeys(nodes) if v not in self._rows]
        if missing:
            self._rows.update(zip(missing, target_probs(self.logits[missing], self.params), strict=True))
        return torch.stack([self._rows[v] for v in nodes])

    def edges(self, rows: Tensor, tokens: Tensor) -> Tensor:
        """p_row(token) for row indices rows [n] and tokens [n]: the edge probabilities of Eq. 1.

        Without top-k or top-p, p_v(x) = exp(l_v(x)/T − logsumexp(l_v/T)): one reduction per row, once per row
        however often its edges are read, and nothing of width V written, instead of the warped rows; those are
        read only where a filter needs them."""
        if not self.plain:
            unique, inverse = torch.unique(rows, return_inverse=True)  # [P], [n]
            return self.rows(unique.tolist())[inverse, tokens]
        row_list, t = rows.tolist(), self.params.temperature
        missing = [v for v in dict.fromkeys(row_list) if v not in self._log_norm]
        if missing:
            scaled = self.logits[missing].float()  # [P, V], a fresh copy (advanced indexing)
            if t != 1.0:
                scaled.div_(t)
            values = torch.logsumexp(scaled, dim=-1).tolist()  # [P]
            if not all(map(math.isfinite, values)):  # NaN, +inf and all −inf rows, with no pass of their own
                check_logits(scaled)
            self._log_norm.update(zip(missing, values))
        log_norm = torch.tensor([self._log_norm[v] for v in row_list], device=self.logits.device)  # [n]
        scaled_edges = self.logits[rows, tokens].float()  # [n]
        if t != 1.0:
            scaled_edges.div_(t)
        return torch.exp(scaled_edges - log_norm)

    def draw_residual(self, node: int, removed: Tensor, generator: torch.Generator | None = None) -> int | None:
        """One draw from p_node with the tokens `removed` [k] taken out: the bonus of an exit at `node` (its
        residual, Eq. 3's rho(node) as its mass); None when no mass is left.

        Under temperature alone the draw reads p_node ∝ exp(l/T − c) straight from the logits, with c the row's
        logsumexp when `edges` already has it (the node has children) and its maximum otherwise: two or three
        passes over the row and one cumulative sum, where warping the row first took six."""
        if self.plain and node not in self._rows:
            row, t = self.logits[node].float(), self.params.temperature  # [V]
            shift = self._log_norm.get(node)  # logsumexp(l/T)
            if shift is None:  # a leaf: shift by the row maximum, which also screens NaN, +inf and all −inf rows
                top = float(row.amax())
                if not math.isfinite(top):
                    check_logits(row)
                shift = top / t
            weights = row - shift * t  # [V], a fresh tensor
            if t != 1.0:
                weights.div_(t)
            weights.exp_()
        else:
            weights = self.rows([node])[0]  # [V], a fresh copy: rows() stacks
        if removed.numel():
            weights[removed] = 0.0
        cdf = torch.cumsum(weights, dim=-1)  # [V]
        return int(sample_cdf(cdf, generator)) if bool(cdf[-1] > 0) else None

    def draw(self, node: int, generator: torch.Generator | None = None) -> int:
        """One draw from p_node: an autoregressive step's token, or the bonus of a round whose tree is its root.
        A greedy row is one-hot at its first argmax, so that is the draw."""
        if self.params.greedy:
            row = self.logits[node]  # [V]
            check_logits(row)
            return int(row.argmax())
        return self.draw_residual(node, self.logits.new_empty(0, dtype=torch.long), generator)

    def all(self) -> Tensor:
        """[N+1, V]: every row (what predraw, sequential and greedy read), in one warp when none was read yet."""
        if self._all is None:
            n = self.logits.shape[0]
            self._all = self.rows(range(n)) if self._rows else target_probs(self.logits, self.params)
        return self._all
