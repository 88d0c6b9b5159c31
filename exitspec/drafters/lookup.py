"""Corpus lookup: what the target itself said next, after the same last few tokens, in its answers to other
prompts (retrieval drafting, as in REST).

Prompt lookup (ngram.py) copies from the current context, so it has nothing to offer where the text is new:
in 61% of the rounds of MT-Bench at T = 1, the root token had not occurred before. A table of the target's
own responses (its rollouts) knows what this model tends to write next. For a context ending in tokens
x_{t-k+1..t}, the longest k ≤ K whose n-gram the table holds gives the next-token estimate

    q(y | x_{t-k+1..t}) = c(x_{t-k+1..t}, y) / (c(x_{t-k+1..t}) + 1)       (add-one: an n-gram seen once → ½)

kept for the `width` most frequent y. The candidate tree is best-first over prefix probabilities
q(x_1..x_d) = Π_i q(x_i | context, x_<i) (build.build_best_first, DDTree's search over a count model), and
DFlashDrafter ranks its nodes against the model's and prompt lookup's on one scale of estimated P(u)
(estimates.py), as it does a model's prefix probabilities.

The table lives in a safetensors file (`exitspec train lookup` writes one from a rollout folder): per order
k, contexts [M_k, k] and next tokens [M_k, width] (int32, −1 pads) with their estimates q [M_k, width]
(float32), and the orders and the target's vocabulary size in its metadata, checked on load.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from exitspec.atomic import atomic_file
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
    """Next-token estimates q(y | last k tokens), k = 1..orders, from the target's own responses.

    Held as the file holds them, per order k: next tokens [M_k, width] (−1 pads) and estimates [M_k, width] in
    numpy arrays, found by a dict from the context's packed id (Σ_i x_i·V^i) to its row. A table of 250k
    contexts takes ~30 MiB this way, against ~230 MiB as Python tuples and lists."""

    def __init__(self, contexts: list, tokens: list, probs: list, vocab_size: int):
        """Per order k = 1..orders (list index k − 1): contexts [M_k, k], tokens [M_k, width], probs [M_k, width]
        (arrays or tensors; the rows of a context's next tokens most frequent first)."""
        self.orders, self.vocab_size = len(contexts), vocab_size
        self.tokens = [np.asarray(t, dtype=np.int32) for t in tokens]
        self.probs = [np.asarray(q, dtype=np.float32) for q in probs]
        self.rows = [{self._key(c): i for i, c in enumerate(np.asarray(ctx).tolist())} for ctx in contexts]
        self._digest: str | None = None  # digest(): of the file for a table read by `load`

    def _key(self, context: Sequence[int]) -> int:
        key = 0
        for token in context:
            key = key * self.vocab_size + int(token)
        return key

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
        kept = [[] for _ in range(orders)]  # per order: (context, [(y, q)])
        for context, after in counts.items():
            total = after.total()
            if total >= min_count:
                kept[len(context) - 1].append((context, [(y, c / (total + 1)) for y, c in after.most_common(width)]))
        width = max((len(after) for rows in kept for _, after in rows), default=1)
        contexts, tokens, probs = [], [], []
        for k, rows in enumerate(kept, start=1):
            contexts.append(np.array([c for c, _ in rows], dtype=np.int32).reshape(len(rows), k))
            tokens.append(np.full((len(rows), width), -1, dtype=np.int32))
            probs.append(np.zeros((len(rows), width), dtype=np.float32))
            for i, (_, after) in enumerate(rows):
                tokens[-1][i, : len(after)] = [y for y, _ in after]
                probs[-1][i, : len(after)] = [q for _, q in after]
        return cls(contexts, tokens, probs, vocab_size)

    def __len__(self) -> int:
        """Contexts in the table, all orders."""
        return sum(len(rows) for rows in self.rows)

    def items(self) -> Iterator[tuple[tuple[int, ...], list[tuple[int, float]]]]:
        """(context, [(y, q)]) for every context, order by order."""
        for k, rows in enumerate(self.rows, start=1):
            for key, i in rows.items():
                yield self._context(key, k), self._row(k, i)

    def _context(self, key: int, k: int) -> tuple[int, ...]:
        """The k tokens a packed id stands for (`_key` undone)."""
        tokens = []
        for _ in range(k):
            key, token = divmod(key, self.vocab_size)
            tokens.append(token)
        return tuple(reversed(tokens))

    def _row(self, k: int, i: int) -> list[tuple[int, float]]:
        return [(y, q) for y, q in zip(self.tokens[k - 1][i].tolist(), self.probs[k - 1][i].tolist()) if y >= 0]

    def next_tokens(self, context: Sequence[int]) -> list[tuple[int, float]]:
        """[(y, q(y | context))] from the longest suffix of `context` (at most `orders` tokens) the table holds."""
        for k in range(min(self.orders, len(context)), 0, -1):
            i = self.rows[k - 1].get(self._key(context[-k:]))
            found = self._row(k, i) if i is not None else []
            if found:  # a row of pads alone backs off like an unknown context
                return found
        return []

    def digest(self) -> str:
        """16 hex digits of sha256 of the table: of its file for a table read by `load`, else of its arrays."""
        if self._digest is None:
            h = hashlib.sha256(repr((self.orders, self.vocab_size, sorted(self.items()))).encode())
            self._digest = h.hexdigest()[:16]
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
        tensors = {}
        for k, rows in enumerate(self.rows, start=1):
            keys = sorted(rows)  # one file for one table, whatever order it was built in
            index = [rows[key] for key in keys]
            tensors |= {
                f"contexts_{k}": torch.tensor([self._context(key, k) for key in keys],
                                              dtype=torch.int32).reshape(-1, k),
                f"tokens_{k}": torch.from_numpy(self.tokens[k - 1][index]),
                f"probs_{k}": torch.from_numpy(self.probs[k - 1][index]),
            }
        with atomic_file(path) as tmp:
            save_file(tensors, tmp, metadata={"orders": str(self.orders), "vocab_size": str(self.vocab_size)})

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
        table = cls(*(list(part) for part in zip(*parts)), vocab_size)
        with path.open("rb") as f:
            table._digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        return table
