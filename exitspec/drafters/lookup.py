"""Corpus lookup: what the target itself said next, after the same last few tokens, in its answers to other
prompts (retrieval drafting, as in REST).

Prompt lookup (ngram.py) copies from the current context, so it has nothing to offer where the text is new:
in 61% of the rounds of MT-Bench at T = 1, the root token had not occurred before. A table of the target's
own responses (its rollouts) knows what this model tends to write next. For a context ending in tokens
x_{t-k+1..t}, the longest k ≤ K whose n-gram the table holds gives the next-token estimate

    q(y | x_{t-k+1..t}) = c(x_{t-k+1..t}, y) / (c(x_{t-k+1..t}) + 1)       (add-one: an n-gram seen once → ½)

kept for the `width` most frequent y. The candidate tree is best-first over prefix probabilities
q(x_1..x_d) = Π_i q(x_i | context, x_<i) (build.build_best_first, DDTree's search over a count model), and
DFlashDrafter ranks its nodes against the model's and prompt lookup's on one scale of calibrated P(u)
(calibrate.py), as it does a model's prefix probabilities.

The table lives in a safetensors file (`exitspec train lookup` writes one from a rollout folder): per order
k, contexts [M_k, k] and next tokens [M_k, width] (int32, −1 pads) with their estimates q [M_k, width]
(float32), and the orders and the target's vocabulary size in its metadata, checked on load.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from exitspec.build import build_best_first
from exitspec.tree import DraftTree

LOOKUP_NAME = "lookup.safetensors"  # a table's file name, in a drafter checkpoint folder or the assets
MAX_NODES = 16  # a lookup tree's nodes at most: beyond this its estimates are too small to pay


@dataclass(frozen=True)
class LookupProposal:
    """The context's last tokens (its root last) and the deepest node a tree may hold."""

    tail: tuple[int, ...]
    max_depth: int


class NgramTable:
    """Next-token estimates q(y | last k tokens), k = 1..orders, from the target's own responses."""

    def __init__(self, entries: dict[tuple[int, ...], list[tuple[int, float]]], orders: int, vocab_size: int):
        self.entries = entries  # context (k tokens) -> [(token, q)], most frequent first
        self.orders, self.vocab_size = orders, vocab_size
        self._digest: str | None = None  # digest(): of the file for a table read by `load`

    @classmethod
    def from_sequences(
        cls, sequences: Iterable[Sequence[int]], vocab_size: int, orders: int = 3, width: int = 4, min_count: int = 1
    ) -> NgramTable:
        """Counts every n-gram of 2..orders+1 tokens in `sequences` (each a prompt's last tokens and the
        target's response to it); keeps the contexts seen at least `min_count` times (a context seen once
        says little, and such contexts are most of a large table)."""
        counts: dict[tuple[int, ...], Counter] = {}
        for seq in sequences:
            seq = list(seq)
            if seq and (min(seq) < 0 or max(seq) >= vocab_size):
                raise ValueError(f"a sequence holds token ids outside the target's vocabulary of {vocab_size}")
            for end in range(1, len(seq)):
                for k in range(1, min(orders, end) + 1):
                    counts.setdefault(tuple(seq[end - k : end]), Counter())[seq[end]] += 1
        entries = {}
        for context, after in counts.items():
            total = after.total()
            if total >= min_count:
                entries[context] = [(y, c / (total + 1)) for y, c in after.most_common(width)]
        return cls(entries, orders, vocab_size)

    def next_tokens(self, context: Sequence[int]) -> list[tuple[int, float]]:
        """[(y, q(y | context))] from the longest suffix of `context` (at most `orders` tokens) the table holds."""
        for k in range(min(self.orders, len(context)), 0, -1):
            found = self.entries.get(tuple(context[-k:]))
            if found:
                return found
        return []

    def digest(self) -> str:
        """16 hex digits of sha256 of the table: of its file for a table read by `load` (hashing the entries of
        a large table takes a second), else of its entries."""
        if self._digest is None:
            self._digest = hashlib.sha256(repr((self.orders, self.vocab_size, self.entries)).encode()).hexdigest()[:16]
        return self._digest

    def propose(self, context: Sequence[int], max_depth: int) -> LookupProposal:
        return LookupProposal(tuple(context[-self.orders :]), max_depth)

    def tree(self, proposal: LookupProposal, root_token: int, budget: int, device=None) -> DraftTree:
        """The min(budget, MAX_NODES) most probable prefixes under q, no deeper than the proposal allows; `scores`
        are their prefix probabilities."""
        tail = proposal.tail
        return build_best_first(
            root_token, lambda path: self.next_tokens(tail + path), min(budget, MAX_NODES), proposal.max_depth, device
        )

    # -- the file -----------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Writes the table as safetensors, atomically (a temporary file renamed into place)."""
        path = Path(path)
        width = max((len(v) for v in self.entries.values()), default=1)
        tensors = {}
        for k in range(1, self.orders + 1):
            rows = [(c, after) for c, after in self.entries.items() if len(c) == k]
            contexts = torch.tensor([c for c, _ in rows], dtype=torch.int32).reshape(len(rows), k)
            tokens = torch.full((len(rows), width), -1, dtype=torch.int32)
            probs = torch.zeros(len(rows), width, dtype=torch.float32)
            for i, (_, after) in enumerate(rows):
                tokens[i, : len(after)] = torch.tensor([y for y, _ in after], dtype=torch.int32)
                probs[i, : len(after)] = torch.tensor([q for _, q in after])
            tensors |= {f"contexts_{k}": contexts, f"tokens_{k}": tokens, f"probs_{k}": probs}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, tmp, metadata={"orders": str(self.orders), "vocab_size": str(self.vocab_size)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int) -> NgramTable:
        """Reads a table written by `save` for a target with `vocab_size` tokens; a wrong file is one ValueError."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no lookup table at {path}")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                names = f.keys()
                tensors = {name: f.get_tensor(name) for name in names}
            orders, table_vocab = int(meta["orders"]), int(meta["vocab_size"])
            parts = [[tensors[f"{name}_{k}"] for name in ("contexts", "tokens", "probs")] for k in range(1, orders + 1)]
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path} is not an exitspec lookup table ({type(e).__name__}: {e})") from None
        if table_vocab != vocab_size:
            raise ValueError(f"the lookup table {path} was made for a vocabulary of {table_vocab} tokens, but the "
                             f"target has {vocab_size}; make one from this target's rollouts (exitspec train lookup)")
        entries = {}
        for k, (contexts, tokens, probs) in enumerate(parts, start=1):
            rows = contexts.shape[0]
            if contexts.shape != (rows, k) or tokens.dim() != 2 or tokens.shape != probs.shape or len(tokens) != rows:
                raise ValueError(f"{path} has order-{k} tensors of inconsistent shapes")
            real = tokens >= 0
            if contexts.numel() and (int(contexts.min()) < 0 or int(contexts.max()) >= vocab_size or
                                     int(tokens.max()) >= vocab_size):
                raise ValueError(f"{path} holds token ids outside the target's vocabulary of {vocab_size}")
            if not bool(((probs > 0) & (probs <= 1))[real].all()):
                raise ValueError(f"{path} holds next-token estimates outside (0, 1]")
            for context, ys, qs in zip(contexts.tolist(), tokens.tolist(), probs.tolist()):
                entries[tuple(context)] = [(y, q) for y, q in zip(ys, qs) if y >= 0]
        table = cls(entries, orders, vocab_size)
        with path.open("rb") as f:
            table._digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        return table
