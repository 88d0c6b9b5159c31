"""Target flow through a draft tree: the canonical exit law (paper §3).

Given the target distribution p_v at every node v (one row of the tree forward's warped probabilities):

    edge(u)  = p_parent(u)(x_u)                      (Eq. 1, the probability of taking edge parent → u)
    P(root)  = 1,   P(u) = P(parent(u)) · edge(u)    (Eq. 2, reach probability)
    rho(v)   = 1 − Σ_{c ∈ children(v)} p_v(x_c)      (Eq. 3, mass that leaves the tree at v)
    w(v)     = P(v) · rho(v)                         (Eq. 4, exit law; Σ_v w(v) = 1)
    C_p(T)   = Σ_{u ≠ root} P(u)                     (Eq. 5, target coverage; E[L] ≤ 1 + C_p)

and the residual at v is p_v with v's child tokens removed, renormalised (plain p_v at a leaf).

Everything is a fixed-shape tensor op over all nodes at once: one gather for the edges, one masked product
over the ancestor matrix for P (every level in parallel), one scatter for the child mass. It works on a
single `DraftTree` (per-node tensors [N+1]) or a padded `TreeBatch` ([T, M]); padded slots get edge 0, so
they carry no mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from exitspec.sampling import WarpedRows
from exitspec.tree import DraftTree, TreeBatch


@dataclass(frozen=True)
class TreeFlow:
    edge: Tensor  # [..., M] p_parent(x_u); 1 at the root, 0 at padding
    reach: Tensor  # [..., M] P(u)
    child_mass: Tensor  # [..., M] Σ_children p_v(x_child)
    rho: Tensor  # [..., M] 1 − child_mass, clamped at 0 against rounding; 0 at padding
    exit: Tensor  # [..., M] w(v) = P(v) · rho(v)

    @property
    def coverage(self) -> Tensor:
        """[...] C_p(T) = Σ_{u ≠ root} P(u) (Eq. 5)."""
        return self.reach[..., 1:].sum(dim=-1)


def tree_flow(tree: DraftTree | TreeBatch, probs: Tensor, check: bool = True) -> TreeFlow:
    """probs [N+1, V] for a tree (or [T, M, V] for a batch) → the exit law of Eqs. 1–5.

    `check` validates probs first (check_probs); the decode loop, which made them with target_probs, skips it.
    """
    if check:
        check_probs(tree, probs)
    parent_idx = tree.parents.clamp(min=0)  # [..., M]; the root points at itself, its edge is set to 1
    edge = probs.flatten(-2).gather(-1, parent_idx * probs.shape[-1] + tree.tokens)  # [..., M] Eq. 1
    return edge_flow(tree, edge.index_fill(-1, torch.zeros(1, dtype=torch.long, device=edge.device), 1.0))


def row_flow(tree: DraftTree, rows: WarpedRows) -> TreeFlow:
    """tree_flow of one tree from its parent nodes' rows only (WarpedRows.edges): a leaf's row is never read.
    The decode loop's path; the edges' indices come from the tree's host lists, so nothing is read back."""
    edge = rows.edges(tree.parent_list[1:], tree.token_list[1:])  # [N] Eq. 1
    return edge_flow(tree, F.pad(edge, (1, 0), value=1.0))  # the root's edge is 1


def edge_flow(tree: DraftTree | TreeBatch, edge: Tensor) -> TreeFlow:
    """The exit law (Eqs. 2–5) from the edge probabilities edge [..., M] = p_parent(u)(x_u), 1 at the root."""
    parent_idx = tree.parents.clamp(min=0)  # [..., M]
    padded = isinstance(tree, TreeBatch)  # a single tree has no padding to zero
    edge = edge * tree.valid if padded else edge
    reach = torch.where(tree.ancestors, edge.unsqueeze(-2), 1.0).prod(dim=-1)  # [..., M] Eq. 2
    child_mass = torch.zeros_like(edge).scatter_add_(-1, parent_idx[..., 1:], edge[..., 1:])  # [..., M]
    rho = (1.0 - child_mass).clamp(min=0.0)  # Eq. 3
    rho = rho * tree.valid if padded else rho
    return TreeFlow(edge, reach, child_mass, rho, reach * rho)


def frontier(tree: DraftTree, kept: int) -> list[int]:
    """The nodes that a cut to the head of `kept` nodes dropped but whose parent it kept (`--budget auto`'s cut)."""
    parents = tree.parent_list
    return [u for u in range(kept, tree.size) if parents[u] < kept]


def observed_reach(tree: DraftTree, kept: int, reach: list[float], frontier_edges: list[float]) -> list[float]:
    """P(u) of a drafted tree's M+1 nodes as far as the target forward over its head of `kept` nodes shows them.

    reach [kept] is the head's realised P (Eq. 2); a `frontier` node u gets P(parent) · p_parent(x_u)
    (Eqs. 1–2), its edge read from the parent's row (frontier_edges, in frontier order); deeper cut nodes stay
    NaN (unobserved). The frontier is where `--budget auto` decides whether one more node pays, so its
    estimates learn there even from rounds that kept no node (kept = 1, reach = [1]).
    """
    parents = tree.parent_list
    out = list(reach) + [float("nan")] * (tree.size - kept)  # [M+1]
    for u, p_edge in zip(frontier(tree, kept), frontier_edges, strict=True):
        out[u] = out[parents[u]] * p_edge  # Eq. 2
    return out


def check_probs(tree: DraftTree | TreeBatch, probs: Tensor, tolerance: float = 1e-3) -> None:
    """Raises ValueError unless probs [..., M, V] fits the tree and each real node's row is a distribution.

    Shape, token range, then one pass for the row sums and one for the minimum: about 0.3 ms on
    [33, 49152] on 2 CPU cores, so it guards the public entry points and stays out of the decode loop.
    """
    if probs.shape[:-1] != tree.parents.shape or probs.dim() != tree.parents.dim() + 1:
        raise ValueError(
            f"probs must be [{', '.join(map(str, tree.parents.shape))}, V] for this tree, got {tuple(probs.shape)}"
        )
    vocab = probs.shape[-1]
    if int(tree.tokens.max()) >= vocab:
        raise ValueError(f"the tree holds token {int(tree.tokens.max())}, beyond the {vocab} columns of probs")
    if not probs.is_floating_point():
        raise ValueError(f"probs must be floating point, got {probs.dtype}")
    valid = tree.valid
    sums = probs.sum(dim=-1)  # [..., M]; NaN or inf anywhere in a row makes its sum non-finite
    bad = valid & ~((sums - 1.0).abs() <= tolerance)
    if bool(bad.any()):
        at = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(f"probs row {at} sums to {float(sums[at]):.6g}, not 1: pass probabilities, not logits")
    if bool((probs.amin(dim=-1)[valid] < 0).any()):
        raise ValueError("probs hold negative entries: pass probabilities, not logits")


def child_token_mask(tree: DraftTree | TreeBatch, vocab_size: int) -> Tensor:
    """[..., M, V] bool: mask[v, y] = some child of v carries token y."""
    is_child = tree.valid.clone()
    is_child[..., 0] = False
    flat = torch.zeros(tree.parents.shape[:-1] + (tree.parents.shape[-1] * vocab_size,), device=is_child.device)
    flat.scatter_add_(-1, tree.parents.clamp(min=0) * vocab_size + tree.tokens, is_child.float())
    return (flat > 0).unflatten(-1, (tree.parents.shape[-1], vocab_size))


def residual_probs(tree: DraftTree | TreeBatch, probs: Tensor) -> Tensor:
    """[..., M, V]: p_v with v's child tokens removed and renormalised; all-zero rows where rho(v) = 0."""
    kept = probs.masked_fill(child_token_mask(tree, probs.shape[-1]), 0.0)
    total = kept.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, kept / total.clamp(min=torch.finfo(kept.dtype).tiny), kept)


def node_residual(tree: DraftTree, probs: Tensor, node: int) -> Tensor:
    """[V] unnormalised residual of one node: p_node with its children's tokens zeroed (O(V), for samplers)."""
    kept = probs[node].clone()
    kept[tree.tokens[tree.children[node]]] = 0.0
    return kept
