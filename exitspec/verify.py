"""Exact tree verifiers: (tree, per-node target probabilities, generator) → accepted path + bonus token.

Every verifier here is *saturated*: it leaves the tree at node v with probability w(v) = P(v)·rho(v) and
draws the bonus token from the residual at v (flow.py, Eqs. 1–5), so the output block
[x_path..., bonus] has exactly the target's distribution. They differ in how they get there:

    greedy      follow the child that carries argmax p_v (temperature 0 only);
    predraw     DDTree's predraw-and-follow: draw y_v ~ p_v at every node, follow matching children;
    sequential  EAGLE-style sequential residual: test children in order, accept child c with probability
                p(x_c) / (mass not yet rejected), remove a rejected child's mass and renormalise;
    tev         Tree Exit Verification: compute w level-parallel, draw one exit node v ~ w, then one bonus
                y ~ residual(v). Two small draws instead of one draw per node.

`verify(name, tree, logits, params, generator)` is the checked entry point: it validates the tree against
the logits, warps them into the target distribution (sampling.py) and decides. The `decide_*` functions
are the decode loop's unchecked path: they trust probabilities made by `target_probs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from exitspec.flow import TreeFlow, node_residual, tree_flow
from exitspec.sampling import SamplingParams, WarpedRows, sample_list, sample_rows, target_probs
from exitspec.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted non-root node indices, from the root's child down to the exit node
    bonus: int  # the token drawn at the exit node

    @property
    def exit_node(self) -> int:
        return self.path[-1] if self.path else 0

    def output_tokens(self, tree: DraftTree) -> list[int]:
        """The round's output block: the accepted draft tokens, then the bonus token."""
        return tree.tokens[self.path].tolist() + [self.bonus] if self.path else [self.bonus]


def decide_greedy(tree: DraftTree, probs: Tensor, generator: torch.Generator | None = None, flow=None) -> Verdict:
    """Temperature 0: the target token at each node is argmax p_v; follow it while the tree has it."""
    return _follow(tree, probs.argmax(dim=-1))


def decide_predraw(tree: DraftTree, probs: Tensor, generator: torch.Generator | None = None, flow=None) -> Verdict:
    """Predraw-and-follow (DDTree): one target draw per node [N+1], then follow matching children."""
    draws = sample_rows(probs, generator)  # [N+1]
    return _follow(tree, draws)


def decide_sequential(
    tree: DraftTree,
    probs: Tensor,
    generator: torch.Generator | None = None,
    flow: TreeFlow | None = None,
    child_order: Callable[[list[int]], Sequence[int]] | None = None,
) -> Verdict:
    """Sequential residual (EAGLE-style), children tested in `child_order` (default: tree order).

    After rejecting children c_1..c_{i-1} of v, the residual has mass q_i + Σ_{j>i} q_j + rho(v), with
    q_j = p_v(x_{c_j}); child c_i is accepted with probability q_i over that mass. Children that are never
    tested are not sampled, so the decision costs one uniform per tested child and one residual draw.
    """
    node, path = 0, []
    while True:
        kids = list(child_order(tree.children[node])) if child_order else tree.children[node]
        residual = node_residual(tree, probs, node)  # [V] p_v without the child tokens
        if kids:
            kid_probs = probs[node, tree.tokens[kids]]  # [k]
            later = kid_probs.flip(0).cumsum(0).flip(0) - kid_probs  # [k] Σ_{j>i} q_j
            remaining = kid_probs + later + residual.sum()  # [k]
            accept_prob = torch.where(remaining > 0, kid_probs / remaining, torch.zeros_like(remaining))
            uniforms = torch.rand(len(kids), generator=generator, device=probs.device)
            accepted = torch.nonzero(uniforms < accept_prob).flatten()
            if accepted.numel():
                node = kids[int(accepted[0])]
                path.append(node)
                continue
        return Verdict(path, int(sample_rows(residual, generator)))


def decide_tev(
    tree: DraftTree, probs: Tensor, generator: torch.Generator | None = None, flow: TreeFlow | None = None
) -> Verdict:
    """Tree Exit Verification: v ~ w (level-parallel exit law), then bonus ~ residual(v).

    rho(v) = 1 − Σ children's edge probabilities is computed from O(N) gathered entries; only the exit node's
    residual row [V] is ever formed. `flow`, when given, is this tree's tree_flow, already computed by the
    caller. If rounding made w(v) > 0 at a node whose residual is empty (rho(v) is truly 0), that node is
    removed and the exit redrawn, which is the exact law.
    """
    exit_mass = (flow or tree_flow(tree, probs, check=False)).exit.clone()  # [N+1]
    while True:
        node = int(sample_rows(exit_mass, generator))
        residual = node_residual(tree, probs, node)  # [V]
        if bool(residual.sum() > 0):
            return Verdict(tree.path(node), int(sample_rows(residual, generator)))
        exit_mass[node] = 0.0


def decide_tev_rows(tree: DraftTree, rows: WarpedRows, generator: torch.Generator | None, flow: TreeFlow) -> Verdict:
    """decide_tev on lazily warped rows: flow = parent_row_flow(tree, rows); beyond the parents' rows only the
    exit node's row is read, for its residual draw (WarpedRows.draw_residual). The decode loop's TEV path: the
    same law without a warp of all N+1 rows, and the tree's few dozen exit masses drawn from as a Python list."""
    exit_mass = flow.exit.tolist()  # [N+1]
    while True:
        node = sample_list(exit_mass, generator)
        bonus = rows.draw_residual(node, tree.tokens[tree.children[node]], generator)
        if bonus is not None:
            return Verdict(tree.path(node), bonus)
        exit_mass[node] = 0.0


def _follow(tree: DraftTree, target_tokens: Tensor) -> Verdict:
    """Accept every node whose ancestors-or-self all carry their parent's target token; exit at the deepest.

    target_tokens [N+1] holds the target's token at every node. Sibling tokens are distinct, so the accepted
    nodes form one root path; its deepest node is the exit and its target token the bonus.
    """
    mismatch = target_tokens[tree.parents.clamp(min=0)] != tree.tokens  # [N+1]
    mismatch[0] = False
    on_path = ~(tree.ancestors & mismatch).any(dim=-1)  # [N+1] every ancestor-or-self matches
    exit_node = int(torch.argmax(torch.where(on_path, tree.depths, -1)))
    return Verdict(tree.path(exit_node), int(target_tokens[exit_node]))


DECIDERS: dict[str, Callable[..., Verdict]] = {
    "greedy": decide_greedy,
    "predraw": decide_predraw,
    "sequential": decide_sequential,
    "tev": decide_tev,
}


def check_verifier(name: str, params: SamplingParams) -> None:
    """Raises ValueError for an unknown verifier, or the greedy verifier with a non-zero temperature."""
    if name not in DECIDERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of {sorted(DECIDERS)}")
    if name == "greedy" and not params.greedy:
        raise ValueError("the greedy verifier is exact only at temperature 0; use predraw, sequential or tev")


def verify(
    name: str,
    tree: DraftTree,
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Warps logits [N+1, V] into the target distribution and runs verifier `name` on it.

    The library's checked entry point: the logits must have one row per node and a column for every tree
    token; -inf entries are allowed where a row keeps a finite maximum (sampling.check_logits).
    """
    check_verifier(name, params)
    if logits.dim() != 2 or logits.shape[0] != tree.size:
        raise ValueError(f"logits must be [N+1, V] = [{tree.size}, V] for this tree, got shape {tuple(logits.shape)}")
    tree.validate(vocab_size=logits.shape[-1])
    probs = target_probs(logits, params)  # [N+1, V]
    return DECIDERS[name](tree, probs, generator, tree_flow(tree, probs, check=False))
