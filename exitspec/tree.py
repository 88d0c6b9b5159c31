"""Draft trees: the flat, prefix-closed token trees that one target forward verifies.

A tree with N non-root nodes is three int64 tensors of length N+1. Index 0 is the root. The root carries
the last committed token, which is not yet in the target's KV cache; every other node u carries a draft
token x_u. A parent always comes before its children (parents[u] < u), so one sweep over depths visits
ancestors first and cycles cannot be written down.

Several trees of different sizes are padded into a `TreeBatch` of one shape. Padded slots hang off the
root, are marked invalid, and carry no probability mass in `flow`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


class InvalidTreeError(ValueError):
    """A draft tree that breaks an invariant: its message names the node and the rule."""


@dataclass(frozen=True)
class DraftTree:
    parents: Tensor  # [N+1] int64, parents[0] = -1
    tokens: Tensor  # [N+1] int64, tokens[0] = root (last committed) token
    depths: Tensor  # [N+1] int64, depths[0] = 0
    # The builder's estimate of each node's reach probability P(u) (1.0 at the root), when it has one. Builders
    # list nodes best first, so scores never increase along the list and every prefix of it is a tree (`head`).
    scores: tuple[float, ...] | None = None

    @classmethod
    def from_parents(cls, parents, tokens, vocab_size: int | None = None) -> DraftTree:
        """Builds and validates a tree from parent indices (parents[0] = -1) and tokens."""
        parents = torch.as_tensor(parents, dtype=torch.long)
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=parents.device)
        if parents.dim() != 1 or tokens.shape != parents.shape or parents.numel() == 0:
            raise InvalidTreeError(
                f"parents and tokens must be 1-D of equal, non-zero length; got {tuple(parents.shape)} "
                f"and {tuple(tokens.shape)}"
            )
        _check_parent_order(parents)
        depths = torch.zeros_like(parents)
        for u, p in enumerate(parents.tolist()[1:], start=1):  # O(N) once per tree, not in the verifier
            depths[u] = depths[p] + 1
        tree = cls(parents, tokens, depths)
        tree.validate(vocab_size)
        return tree

    @classmethod
    def root_only(cls, root_token: int, device=None) -> DraftTree:
        z = torch.zeros(1, dtype=torch.long, device=device)
        return cls(z - 1, z + int(root_token), z)

    @classmethod
    def chain(cls, root_token: int, tokens, device=None) -> DraftTree:
        """A single path root → x_1 → … → x_n (plain, non-tree speculative decoding)."""
        n = len(tokens)
        idx = torch.arange(n + 1, device=device)
        toks = torch.tensor([int(root_token), *map(int, tokens)], dtype=torch.long, device=device)
        return cls(idx - 1, toks, idx)

    @property
    def size(self) -> int:
        """N+1: nodes including the root."""
        return self.parents.numel()

    @property
    def num_nodes(self) -> int:
        """N: draft tokens in the tree (the root excluded); this is what a budget B bounds."""
        return self.parents.numel() - 1

    @cached_property
    def depth(self) -> int:
        """The deepest node's depth (0 for a root-only tree)."""
        return int(self.depths.max())

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def children(self) -> list[list[int]]:
        """children[v]: v's child indices in tree order."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for u, p in enumerate(self.parent_list[1:], start=1):
            kids[p].append(u)
        return kids

    @property
    def device(self) -> torch.device:
        return self.parents.device

    @cached_property
    def valid(self) -> Tensor:  # [N+1] bool; a single tree has no padding
        return torch.ones_like(self.parents, dtype=torch.bool)

    def to(self, device) -> DraftTree:
        """The tree on `device`; the same object (with its cached masks) when it is already there."""
        if device is None or self.parents.device == torch.device(device):
            return self
        return DraftTree(self.parents.to(device), self.tokens.to(device), self.depths.to(device), self.scores)

    def head(self, size: int) -> DraftTree:
        """The first `size` nodes (root included): a tree, since every parent comes before its children."""
        if size >= self.size:
            return self
        if size < 1:
            raise ValueError(f"a tree keeps at least its root, got size {size}")
        scores = None if self.scores is None else self.scores[:size]
        return DraftTree(self.parents[:size], self.tokens[:size], self.depths[:size], scores)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidTreeError unless the tree is rooted, ordered, prefix-closed and has distinct siblings."""
        if not (self.parents.shape == self.tokens.shape == self.depths.shape) or self.parents.dim() != 1:
            raise InvalidTreeError("parents, tokens and depths must be 1-D tensors of one length")
        if self.parents.numel() == 0:
            raise InvalidTreeError("a tree needs a root")
        if self.scores is not None and len(self.scores) != self.parents.numel():
            raise InvalidTreeError(f"{len(self.scores)} scores for a tree of {self.parents.numel()} nodes")
        _check_parent_order(self.parents)
        parents, tokens, depths = (t.cpu() for t in (self.parents, self.tokens, self.depths))
        if int(depths[0]) != 0:
            raise InvalidTreeError(f"the root must have depth 0, got {int(depths[0])}")
        bad = torch.nonzero(depths[1:] != depths[parents[1:]] + 1).flatten()
        if bad.numel():
            u = int(bad[0]) + 1
            raise InvalidTreeError(
                f"node {u} has depth {int(depths[u])} but its parent {int(parents[u])} has depth "
                f"{int(depths[parents[u]])}"
            )
        if bool((tokens < 0).any()) or (vocab_size is not None and bool((tokens >= vocab_size).any())):
            u = int(torch.nonzero((tokens < 0) | (tokens >= (vocab_size or 2**62))).flatten()[0])
            raise InvalidTreeError(f"node {u} has token {int(tokens[u])} outside the vocabulary [0, {vocab_size})")
        edge_keys = parents[1:] * (int(tokens.max()) + 1) + tokens[1:]
        if torch.unique(edge_keys).numel() != edge_keys.numel():
            seen: dict[int, int] = {}
            for u, key in enumerate(edge_keys.tolist(), start=1):
                if key in seen:
                    raise InvalidTreeError(
                        f"nodes {seen[key]} and {u} are siblings (parent {int(parents[u])}) with the same "
                        f"token {int(tokens[u])}; sibling tokens must be distinct"
                    )
                seen[key] = u

    def path(self, node: int) -> list[int]:
        """Node indices from the root (excluded) down to `node` (included)."""
        parents = self.parent_list
        out = []
        while node > 0:
            out.append(node)
            node = parents[node]
        return out[::-1]

    @cached_property
    def ancestors(self) -> Tensor:
        """[N+1, N+1] bool: ancestors[i, j] = node j is node i itself or one of its ancestors."""
        return ancestor_matrix(self.parents[None], self.depths[None], self.valid[None])[0]

    def visibility_mask(self) -> Tensor:
        """[N+1, N+1] bool tree-attention mask: a node sees itself and its ancestors."""
        return self.ancestors

    def position_ids(self, prefix_len: int) -> Tensor:
        """[N+1]: a node at depth d sits at absolute position prefix_len + d."""
        return self.depths + prefix_len


@dataclass(frozen=True)
class TreeBatch:
    """T trees padded to M = max(N_t)+1 slots; padded slots have parent 0, depth 1, token 0 and valid=False."""

    parents: Tensor  # [T, M]
    tokens: Tensor  # [T, M]
    depths: Tensor  # [T, M]
    valid: Tensor  # [T, M] bool

    @classmethod
    def stack(cls, trees: list[DraftTree]) -> TreeBatch:
        if not trees:
            raise InvalidTreeError("cannot batch an empty list of trees")
        m = max(t.size for t in trees)
        device = trees[0].device

        def pad(values: list[Tensor], fill: int) -> Tensor:
            out = torch.full((len(trees), m), fill, dtype=torch.long, device=device)
            for i, v in enumerate(values):
                out[i, : v.numel()] = v
            return out

        parents = pad([t.parents for t in trees], 0)
        depths = pad([t.depths for t in trees], 1)
        valid = pad([t.valid.long() for t in trees], 0).bool()
        return cls(parents, pad([t.tokens for t in trees], 0), depths, valid)

    @cached_property
    def ancestors(self) -> Tensor:
        """[T, M, M] bool ancestor-or-self matrix; a padded slot sees only itself."""
        return ancestor_matrix(self.parents, self.depths, self.valid)

    def visibility_mask(self) -> Tensor:
        return self.ancestors


def ancestor_matrix(parents: Tensor, depths: Tensor, valid: Tensor) -> Tensor:
    """[T, M, M] bool, A[t, u, j] = j is u or an ancestor of u. One level per step, nodes in parallel."""
    t, m = parents.shape
    eye = torch.eye(m, dtype=torch.bool, device=parents.device).expand(t, m, m)
    anc = eye.clone()
    parent_rows = parents.clamp(min=0)[..., None].expand(t, m, m)  # [T, M, M]
    for d in range(1, int(depths.max()) + 1 if m > 1 else 1):
        at_depth = (depths == d)[..., None]  # [T, M, 1]
        anc = torch.where(at_depth, anc.gather(1, parent_rows) | eye, anc)
    return anc & (valid[:, :, None] | eye)


def _check_parent_order(parents: Tensor) -> None:
    p = parents.cpu()
    if int(p[0]) != -1:
        raise InvalidTreeError(f"node 0 is the root and must have parent -1, got {int(p[0])}")
    idx = torch.arange(p.numel())
    bad = torch.nonzero((p[1:] < 0) | (p[1:] >= idx[1:])).flatten()
    if bad.numel():
        u = int(bad[0]) + 1
        raise InvalidTreeError(
            f"node {u} has parent {int(p[u])}; every non-root node needs a parent index in [0, {u}) "
            "(the tree must be rooted, prefix-closed and listed parents-first, which also rules out cycles)"
        )
