"""The target distribution that exactness refers to: logits → warped probabilities.

Speculative decoding is exact with respect to the *warped* target distribution: temperature first, then
top-k, then top-p (the order Hugging Face's `generate` applies them), renormalised. Temperature 0 is
greedy decoding, represented as the one-hot distribution on the first argmax, so every verifier reproduces
the target's greedy output token for token.
"""

from __future__ import annotations

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


def finite_rows(logits: Tensor) -> Tensor:
    """[...] bool on the logits' device: which rows of `logits` [..., V] a distribution can come from. The one
    finite-logits screen, for checked entry points, the target's forwards and the decode loop's host read.

    A row may hold -inf entries (a masked vocabulary, a logit processor's ban) as long as its maximum is
    finite; NaN, +inf and all -inf rows are refused. The row maximum screens all three at once (max
    propagates NaN), so valid input costs one reduction.
    """
    return torch.isfinite(logits.amax(dim=-1))


def check_logits(logits: Tensor) -> None:
    """Raises ValueError naming the first row of `logits` [..., V] that no distribution can come from
    (finite_rows)."""
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    finite = finite_rows(logits)  # [...]
    if not bool(finite.all()):
        row = tuple(torch.nonzero(~finite)[0].tolist())
        raise ValueError(
            f"logits row {row} holds NaN or +inf, or only -inf; refusing to verify against it"
        )


def target_probs(logits: Tensor, params: SamplingParams, check: bool = True) -> Tensor:
    """[..., V] logits → [..., V] float32 target probabilities after temperature, top-k and top-p. `check`
    screens the logits first (check_logits: a host read), for callers that have not."""
    if check:
        check_logits(logits)
    logits = logits.float()
    if params.greedy:
        # one_hot reads on the host
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
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


def sample_cdf(cdf: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """sample_rows from the cumulative sums cdf [..., V] of unnormalised weights → [...] int64."""
    total = cdf[..., -1:].contiguous()  # [..., 1]
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype) * total
    drawn = torch.searchsorted(cdf, u, right=True)
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(drawn, last_positive).squeeze(-1)


class WarpedRows:
    """The target distribution at a tree's nodes (target_probs of logits [N+1, V]), warped only where a verifier
    reads it, on the logits' device, with no host read. TEV reads the rows of nodes with children (for the edge
    probabilities, Eq. 1) and the exit node's row (for its residual): on a 32-node tree about half the rows.

    `check` screens the logits first (check_logits, one host read); the decode loop skips it and folds the same
    screen into its round's one transfer (decode.py)."""

    def __init__(self, logits: Tensor, params: SamplingParams, check: bool = True):
        if check:
            check_logits(logits)
        self.logits, self.params = logits, params  # [N+1, V]
        self.plain = not (params.greedy or params.top_k or params.top_p < 1.0)  # temperature alone: p = softmax(l/T)
        self._all: Tensor | None = None
        self._extra: tuple[list[int], list[int]] = ([], [])  # edges a later reader wants too (`also_read`)
        self._extra_edges: Tensor | None = None

    @classmethod
    def of_probs(cls, probs: Tensor) -> WarpedRows:
        """Rows already warped: probs [N+1, V] are read as they are (their logs stand in for the logits)."""
        rows = cls(probs.log(), SamplingParams(1.0), check=False)
        rows._all = probs
        return rows

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[-1]

    def warp(self, logits: Tensor) -> Tensor:
        return target_probs(logits, self.params, check=False)

    def also_read(self, rows: list[int], tokens: list[int]) -> None:
        """Edges that a later reader wants too (the decode loop's frontier, flow.frontier): the next `edges` call
        reads them in the same pass, and `extra_edges` hands them over."""
        self._extra, self._extra_edges = (rows, tokens), None

    def extra_edges(self) -> Tensor:
        """[F] the edges named by `also_read`."""
        if self._extra_edges is None:
            self._extra_edges = self._edges(*self._extra)
        return self._extra_edges

    def edges(self, rows: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """p_row(token) [n] for host lists of row indices and tokens: the edge probabilities of Eq. 1 (and, in
        the same pass, those of `also_read`)."""
        if self._extra_edges is not None or not self._extra[0]:
            return self._edges(rows, tokens)
        n = len(rows)
        both = self._edges([*rows, *self._extra[0]], [*tokens, *self._extra[1]])
        self._extra_edges = both[n:]
        return both[:n]

    def _edges(self, rows: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """The indices go over in one copy. Each distinct row is read once. Without top-k or top-p,
        p_v(x) = exp(l_v(x)/T − logsumexp(l_v/T)): one reduction per row and nothing of width V written;
        otherwise the distinct rows are warped."""
        if not rows:
            return self.logits.new_empty(0)
        unique = list(dict.fromkeys(rows))
        where = {v: i for i, v in enumerate(unique)}
        p, n = len(unique), len(rows)
        index = torch.tensor([*unique, *(where[v] for v in rows), *tokens], device=self.logits.device)
        unique_rows, inverse, token_ids = index.split([p, n, n])
        if self._all is not None:
            return self._all[unique_rows[inverse], token_ids]
        selected = self.logits.index_select(0, unique_rows).float()  # [P, V]
        if not self.plain:
            return self.warp(selected)[inverse, token_ids]
        if self.params.temperature != 1.0:
            selected = selected / self.params.temperature
        log_norm = torch.logsumexp(selected, dim=-1)  # [P]
        return torch.exp(selected[inverse, token_ids] - log_norm[inverse])

    def row(self, node: Tensor) -> Tensor:
        """[V] the warped row of `node`, an index on the device ([] int64)."""
        if self._all is not None:
            return self._all.index_select(0, node.view(1))[0]
        return self.warp(self.logits.index_select(0, node.view(1)))[0]

    def draw(self, node: int, generator: torch.Generator | None = None) -> Tensor:
        """One draw from p_node, [] int64 on the logits' device (no host read): an autoregressive step's token. A
        greedy row is one-hot at its first argmax, so that is the draw."""
        if self.params.greedy:
            return self.logits[node].argmax()
        return sample_rows(self.warp(self.logits[node : node + 1]), generator)[0]

    def all(self) -> Tensor:
        """[N+1, V]: every row (what predraw and sequential read), warped once."""
        if self._all is None:
            self._all = self.warp(self.logits)
        return self._all
