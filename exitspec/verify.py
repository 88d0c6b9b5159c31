"""Exact tree verifiers: (tree, the target distribution at its nodes, generator) → accepted path + bonus token.

Every verifier here is *saturated*: it leaves the tree at node v with probability w(v) = P(v)·rho(v) and
draws the bonus token from the residual at v (flow.py, Eqs. 1–5), so the output block
[x_path..., bonus] has exactly the target's distribution. They differ in how they get there:

    greedy      follow the child that carries argmax p_v (temperature 0 only);
    predraw     DDTree's predraw-and-follow: draw y_v ~ p_v at every node, follow matching children;
    sequential  EAGLE-style sequential residual: test children in order, accept child c with probability
                p(x_c) / (mass not yet rejected), remove a rejected child's mass and renormalise;
    tev         Tree Exit Verification: compute w level-parallel, draw one exit node v ~ w, then one bonus
                y ~ residual(v). Two small draws instead of one draw per node.

Each `decide_*` reads the target distribution through `WarpedRows` (only the rows it needs) and returns a
`Decision` that stays on the device: greedy, predraw and TEV make no host read at all, so the decode loop
reads the exit node and bonus with the round's other numbers in one transfer (decode.py). `Decision.read`
is that read for one decision. `verify(name, tree, logits, params, generator)` is the checked entry point:
it validates the tree against the logits and runs the same deciders the decode loop runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from exitspec.flow import TreeFlow, edge_flow, node_residual, row_flow, tree_flow
from exitspec.sampling import SamplingParams, WarpedRows, sample_cdf, sample_rows
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
        tokens = tree.token_list
        return [tokens[u] for u in self.path] + [self.bonus]


@dataclass(frozen=True)
class Decision:
    """A verifier's choice, on the device: the exit node v, the bonus y drawn from its residual, and the tree's
    flow (P, rho, w: Eqs. 1–5). `drawable` is False only where rounding left w(v) > 0 at a node whose residual
    is empty (rho(v) is truly 0): `read` then takes v out and redraws, which is the exact law."""

    exit_node: Tensor  # [] int64
    bonus: Tensor  # [] int64
    drawable: Tensor  # [] bool
    flow: TreeFlow

    def scalars(self) -> Tensor:
        """[3] int64: exit node, bonus, drawable, for a host read."""
        return torch.stack([self.exit_node, self.bonus, self.drawable])

    def read(self, tree: DraftTree, rows: WarpedRows, generator: torch.Generator | None) -> Verdict:
        node, bonus, drawable = self.scalars().tolist()
        return self.verdict(tree, rows, generator, node, bonus, bool(drawable))

    def verdict(self, tree: DraftTree, rows: WarpedRows, generator: torch.Generator | None, node: int, bonus: int,
                drawable: bool) -> Verdict:
        """The Verdict of host values read back from `scalars`; the rare redraw where the residual was empty."""
        exit_mass = self.flow.exit
        while not drawable:
            exit_mass = exit_mass.index_fill(0, torch.tensor([node], device=exit_mass.device), 0.0)
            retry = _draw_exit(tree, rows, generator, exit_mass, self.flow)
            node, bonus, drawable = retry.scalars().tolist()
        return Verdict(tree.path(node), bonus)


def decide_tev(tree: DraftTree, rows: WarpedRows, generator: torch.Generator | None = None) -> Decision:
    """Tree Exit Verification: v ~ w (level-parallel exit law), then bonus ~ residual(v).

    The flow reads only the rows of nodes with children (flow.row_flow); beyond them only the exit node's
    row is warped, for its residual. No host read: the exit node is an index on the device throughout.
    """
    flow = row_flow(tree, rows)
    return _draw_exit(tree, rows, generator, flow.exit, flow)


def _draw_exit(tree, rows: WarpedRows, generator, exit_mass: Tensor, flow: TreeFlow) -> Decision:
    # v ~ w by an exponential race: argmax_v w(v) / E_v with E_v ~ Exp(1) i.i.d. wins with probability w(v) / Σ w,
    # and a node of zero mass never wins against one of positive mass
    race = torch.empty_like(exit_mass).exponential_(generator=generator).clamp_(min=1e-30)  # [N+1], never 0
    node = (exit_mass / race).argmax()  # []
    residual = rows.row(node) * child_free(tree, node, rows.vocab_size)  # [V] p_v without v's child tokens
    cdf = residual.cumsum(dim=0)  # [V]
    return Decision(node, sample_cdf(cdf, generator), cdf[-1] > 0, flow)


def child_free(tree: DraftTree, node: Tensor, vocab_size: int) -> Tensor:
    """[V] float: 0 at the tokens of `node`'s children ([] int64 on the device), 1 elsewhere."""
    not_child = (tree.parents != node).float()  # [N+1]
    return torch.ones(vocab_size, device=node.device).scatter_reduce(0, tree.tokens, not_child, "amin")


def decide_greedy(tree: DraftTree, rows: WarpedRows, generator: torch.Generator | None = None) -> Decision:
    """Temperature 0: the target token at each node is argmax p_v; follow it while the tree has it."""
    return _follow(tree, rows.logits.argmax(dim=-1))  # the flow: the one-hot law of those tokens


def decide_predraw(tree: DraftTree, rows: WarpedRows, generator: torch.Generator | None = None) -> Decision:
    """Predraw-and-follow (DDTree): one target draw per node [N+1], then follow matching children."""
    probs = rows.all()  # [N+1, V]
    return _follow(tree, sample_rows(probs, generator), tree_flow(tree, probs, check=False))


def decide_sequential(
    tree: DraftTree,
    rows: WarpedRows,
    generator: torch.Generator | None = None,
    child_order: Callable[[list[int]], Sequence[int]] | None = None,
) -> Decision:
    """Sequential residual (EAGLE-style), children tested in `child_order` (default: tree order).

    After rejecting children c_1..c_{i-1} of v, the residual has mass q_i + Σ_{j>i} q_j + rho(v), with
    q_j = p_v(x_{c_j}); child c_i is accepted with probability q_i over that mass. Children that are never
    tested are not sampled, so the decision costs one uniform per tested child and one residual draw. It
    walks the tree on the host, one read per level.
    """
    probs = rows.all()  # [N+1, V]
    node = 0
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
                continue
        device = probs.device
        return Decision(torch.tensor(node, device=device), sample_rows(residual, generator),
                        torch.tensor(True, device=device), tree_flow(tree, probs, check=False))


def _follow(tree: DraftTree, target_tokens: Tensor, flow: TreeFlow | None = None) -> Decision:
    """Accept every node whose ancestors-or-self all carry their parent's target token; exit at the deepest.

    target_tokens [N+1] holds the target's token at every node. Sibling tokens are distinct, so the accepted
    nodes form one root path; its deepest node is the exit and its target token the bonus. `flow` defaults
    to the one-hot law of those tokens (greedy's): edge(u) = 1 where x_u is its parent's target token (Eq. 1).
    """
    match = (target_tokens.gather(0, tree.parents.clamp(min=0)) == tree.tokens) | (tree.parents < 0)  # [N+1]
    on_path = ~(tree.ancestors & ~match).any(dim=-1)  # [N+1] every ancestor-or-self matches
    node = torch.where(on_path, tree.depths, -1).argmax()  # []
    bonus = target_tokens.index_select(0, node.view(1))[0]  # (indexing by a tensor would read it on the host)
    return Decision(node, bonus, torch.ones((), dtype=torch.bool, device=node.device),
                    flow or edge_flow(tree, match.float()))


DECIDERS: dict[str, Callable[..., Decision]] = {
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
    """Verifier `name` on the target distribution of logits [N+1, V] warped by `params`: the decode loop's
    deciders behind the checks of the library's entry point. The logits must have one row per node and a
    column for every tree token; -inf entries are allowed where a row keeps a finite maximum
    (sampling.check_logits).
    """
    check_verifier(name, params)
    if logits.dim() != 2 or logits.shape[0] != tree.size:
        raise ValueError(f"logits must be [N+1, V] = [{tree.size}, V] for this tree, got shape {tuple(logits.shape)}")
    tree.validate(vocab_size=logits.shape[-1])
    rows = WarpedRows(logits, params)  # checks the logits
    return DECIDERS[name](tree, rows, generator).read(tree, rows, generator)
