"""The drafter protocol: what the decode loop needs from any drafter, trained or not.

One round, as the decode loop drives it (shapes for one sequence):

    drafter.estimate_for(params)                           # once per sequence: the sampling settings it is for
    proposal = drafter.propose(context, max_depth, cheap)  # context: the L token ids so far (a list), the last the root
    tree = drafter.build(proposal, root_token, budget)     # DraftTree with at most `budget` non-root nodes
    ... --budget auto may verify only tree.head(n) ...
    ... one target forward over the tree, a verifier picks root → path plus a bonus token ...
    drafter.observe(tree, reach)                           # the realised P(u) of the N+1 nodes (a list), NaN: unseen
    drafter.commit(committed_ids, committed_features)      # the root and the accepted path, now in the target cache

`cheap` asks for a draft from the drafter's cheapest source only (for DFlash: prompt lookup without the
block forward); a drafter with one source ignores it. Trees list their nodes best first and, where the
drafter can, carry `scores`: estimates of each node's reach probability P(u), which `--budget auto`
weighs against the cost of a bigger tree.

`propose` is timed as the draft stage and `build` as the build stage. Features are the concatenated hidden
states of the target layers named by `feature_layers` (outputs of those decoder layers, 0-based), one row
per token that the target's KV cache holds; a drafter that reads none has `feature_layers = ()` and
receives `None`.

What the estimates learned outlives the process: warm.py saves `estimates_state()` after a run, under the
drafter's `identity()`, and a later process's decoder hands it back through `load_estimates`. A drafter
that drafts from the target's earlier answers (suffix.py) gets each finished one through `learn`, and warm.py
keeps its `memory()` on disk too.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from exitspec.drafters.suffix import SuffixMemory
from exitspec.tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    feature_layers: tuple[int, ...]

    def estimate_for(self, setting: Hashable) -> None:
        """Estimates of P(u) for the sampling settings (SamplingParams) of the sequences to come: P(u) depends on
        them, so a drafter that learns its estimates keeps them per setting."""

    def identity(self) -> str:
        """What this drafter is, as one string: its kind and parameters, and for trained weights or a table a
        digest of them. Warm-start files (warm.py) keep the learned state of each identity apart."""

    def estimates_state(self) -> dict:
        """What the estimates of P(u) learned under the current setting (estimate_for), JSON-ready; {} for a
        drafter that learns nothing."""

    def load_estimates(self, state: dict) -> None:
        """Restores an estimates_state() for the current setting; ValueError (and nothing changed) if it does
        not fit this drafter."""

    def begin(self, prompt_ids: Tensor, features: Tensor | None) -> None:
        """Starts a sequence. prompt_ids [L]; features [L-1, F] for prompt_ids[:-1] (the cached tokens)."""

    def propose(self, context: Sequence[int], max_depth: int, cheap: bool = False) -> Any:
        """Drafts up to `max_depth` future tokens after the context's L token ids (context[-1] is the root). The
        decode loop keeps them on the host, so no drafter reads them back from the device."""

    def build(self, proposal: Any, root_token: int, budget: int) -> DraftTree:
        """Selects at most `budget` of the proposed tokens as a prefix-closed tree rooted at root_token."""

    def observe(self, tree: DraftTree, reach: list[float]) -> None:
        """Learns from the tree just built: reach [N+1] holds each node's realised P(u) (Eq. 2), NaN for nodes
        the target's forward did not reveal (flow.observed_reach)."""

    def commit(self, committed_ids: Tensor, features: Tensor | None) -> None:
        """committed_ids [n]: the root and accepted path tokens now in the target cache; features [n, F]."""

    def learn(self, answer: list[int]) -> None:
        """A finished answer of the target (its new tokens), for drafters that draft from earlier answers."""

    def memory(self) -> SuffixMemory | None:
        """The suffix memory of earlier answers this drafter drafts from (warm.py keeps it on disk), or None."""
