"""Draft trees: the flat, prefix-closed token trees that one target forward verifies.

A tree with N non-root nodes is three int64 tensors of length N+1. Index 0 is the root. The root carries
the last committed token, which is not yet in the target's KV cache; every other node u carries a draft
token x_u. A parent always comes before its children (parents[u] < u), so one sweep over depths visits
ancestors first and cycles cannot be written down.

Several trees of different sizes are padded into a `TreeBatch` of one shape. Padded slots hang off the
root, are marked invalid, and carry no probability mass in `flow`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # The same three fields as Python lists, where the tree was made on the host (`from_lists`): the decode loop
    # reads its structure from them, so a tree on a GPU is never read back (`lists`).
    host: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.validate()  # a tree that exists is a valid tree, however it was made

    @classmethod
    def from_lists(cls, parents: list[int], tokens: list[int], depths: list[int], scores=None,
                   device=None) -> DraftTree:
        """A tree made on the host: validated on the lists, then copied to `device` in one copy (no sync back)."""
        lists = (list(parents), [int(t) for t in tokens], list(depths))
        fields = torch.tensor(lists, dtype=torch.long, device=device).unbind()  # one copy: [3, N+1]
        return cls(*fields, None if scores is None else tuple(scores), lists)

    @classmethod
    def from_parents(cls, parents, tokens, vocab_size: int | None = None) -> DraftTree:
        """Builds and validates a tree from integer parent indices (parents[0] = -1) and tokens."""
        parents, tokens = _index_tensor(parents, "parents"), _index_tensor(tokens, "tokens")
        if parents.dim() != 1 or tokens.shape != parents.shape or parents.numel() == 0:
            raise InvalidTreeError(
                f"parents and tokens must be 1-D of equal, non-zero length; got {tuple(parents.shape)} "
                f"and {tuple(tokens.shape)}"
            )
        parent_list = parents.tolist()
        depths = [0] * len(parent_list)
        for u, p in enumerate(parent_list[1:], start=1):
            if not 0 <= p < u:
                _check_parent(parent_list, u)
            depths[u] = depths[p] + 1
        tree = cls.from_lists(parent_list, tokens.tolist(), depths, device=parents.device)
        if vocab_size is not None:
            tree.validate(vocab_size)
        return tree

    @classmethod
    def root_only(cls, root_token: int, device=None) -> DraftTree:
        return cls.from_lists([-1], [int(root_token)], [0], device=device)

    @classmethod
    def chain(cls, root_token: int, tokens, device=None, scores=None) -> DraftTree:
        """A single path root → x_1 → … → x_n (plain, non-tree speculative decoding)."""
        n = len(tokens)
        return cls.from_lists(list(range(-1, n)), [int(root_token), *map(int, tokens)], list(range(n + 1)), scores,
                              device)

    @cached_property
    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """(parents, tokens, depths) as Python lists: the host copy, or read back once from the tensors."""
        return self.host or tuple(t.tolist() for t in (self.parents, self.tokens, self.depths))

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
        return max(self.lists[2])

    @property
    def parent_list(self) -> list[int]:
        return self.lists[0]

    @property
    def token_list(self) -> list[int]:
        return self.lists[1]

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
        return DraftTree(self.parents.to(device), self.tokens.to(device), self.depths.to(device), self.scores,
                         self.host)

    def head(self, size: int) -> DraftTree:
        """The first `size` nodes (root included): a tree, since every parent comes before its children."""
        if size >= self.size:
            return self
        if size < 1:
            raise ValueError(f"a tree keeps at least its root, got size {size}")
        scores = None if self.scores is None else self.scores[:size]
        host = None if self.host is None else tuple(x[:size] for x in self.host)
        return DraftTree(self.parents[:size], self.tokens[:size], self.depths[:size], scores, host)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidTreeError unless the tree is rooted, ordered, prefix-closed and has distinct siblings.

        One pass over Python lists (the host copy where there is one): about 10 µs for a 32-node tree, so
        every constructed tree is checked.
        """
        fields = (self.parents, self.tokens, self.depths)
        if any(not isinstance(t, Tensor) or t.dtype != torch.long for t in fields):
            raise InvalidTreeError("parents, tokens and depths must be int64 tensors")
        if not (self.parents.shape == self.tokens.shape == self.depths.shape) or self.parents.dim() != 1:
            raise InvalidTreeError("parents, tokens and depths must be 1-D tensors of one length")
        if self.parents.numel() == 0:
            raise InvalidTreeError("a tree needs a root")
        if self.scores is not None and len(self.scores) != self.parents.numel():
            raise InvalidTreeError(f"{len(self.scores)} scores for a tree of {self.parents.numel()} nodes")
        parents, tokens, depths = self.lists
        if depths[0] != 0:
            raise InvalidTreeError(f"the root must have depth 0, got {depths[0]}")
        limit = vocab_size if vocab_size is not None else 1 << 62
        siblings: dict[tuple[int, int], int] = {}
        for u in range(len(parents)):
            if not 0 <= tokens[u] < limit:
                raise InvalidTreeError(f"node {u} has token {tokens[u]} outside the vocabulary [0, {vocab_size})")
            if u == 0:
                _check_parent(parents, 0)
                continue
            p = parents[u]
            if not 0 <= p < u:
                _check_parent(parents, u)
            if depths[u] != depths[p] + 1:
                raise InvalidTreeError(f"node {u} has depth {depths[u]} but its parent {p} has depth {depths[p]}")
            if (p, tokens[u]) in siblings:
                raise InvalidTreeError(
                    f"nodes {siblings[p, tokens[u]]} and {u} are siblings (parent {p}) with the same token "
                    f"{tokens[u]}; sibling tokens must be distinct"
                )
            siblings[p, tokens[u]] = u

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
        """[N+1, N+1] bool: ancestors[i, j] = node j is node i itself or one of its ancestors. Made from the
        parent list on the host and copied over once: no sync, and no op per level."""
        rows: list[list[bool]] = []
        for u, p in enumerate(self.parent_list):
            row = rows[p].copy() if p >= 0 else [False] * self.size
            row[u] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=self.device)

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

    def parents_only(self) -> tuple[TreeBatch, Tensor]:
        """(the trees cut to their root and the nodes with children, slots [T, M'] of those nodes here).

        The exit law reads a target row only at a parent (flow.tree_flow takes each edge p_parent(u)(x_u) from the
        parent's row; a leaf's rho is 1 without it), and a leaf is nobody's ancestor, so the cut trees need the
        same target rows in fewer slots. Kept nodes stay in their order (parents first); a tree with fewer of
        them than M' is padded as `stack` pads."""
        child = self.valid.long()
        child[:, 0] = 0  # the root is no node's child
        children = torch.zeros_like(child).scatter_add_(1, self.parents.clamp(min=0), child)  # [T, M]
        keep = (children > 0) & self.valid
        keep[:, 0] = True
        slots = torch.argsort((~keep).long(), dim=1, stable=True)[:, : int(keep.sum(dim=1).max())]  # [T, M']
        valid = keep.gather(1, slots)
        position = torch.empty_like(self.parents).scatter_(1, slots, torch.arange(slots.shape[1], device=slots.device)
                                                           .expand_as(slots))  # [T, M]: old slot -> new
        old_parents = self.parents.gather(1, slots)
        parents = torch.where(old_parents < 0, old_parents, position.gather(1, old_parents.clamp(min=0)))
        parents = torch.where(valid, parents, 0)
        depths = torch.where(valid, self.depths.gather(1, slots), 1)
        tokens = torch.where(valid, self.tokens.gather(1, slots), 0)
        return TreeBatch(parents, tokens, depths, valid), slots


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


def _check_parent(parents: list[int], u: int) -> None:
    """Raises InvalidTreeError if node u's parent index is not in [0, u) (-1 for the root)."""
    if u == 0 and parents[0] != -1:
        raise InvalidTreeError(f"node 0 is the root and must have parent -1, got {parents[0]}")
    if u > 0 and not 0 <= parents[u] < u:
        raise InvalidTreeError(
            f"node {u} has parent {parents[u]}; every non-root node needs a parent index in [0, {u}) "
            "(the tree must be rooted, prefix-closed and listed parents-first, which also rules out cycles)"
        )


def _index_tensor(values, name: str) -> Tensor:
    """An int64 tensor of `values`; floats (even whole ones), booleans and the like are refused, not cast."""
    try:
        t = values if isinstance(values, Tensor) else torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise InvalidTreeError(f"{name} must be a sequence of integers: {e}") from None
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidTreeError(f"{name} must be integers, got {t.dtype} values")
    return t.long()
