"""`chain:SPEC`: plain chain speculative decoding with any drafter, the best path of its trees."""

from __future__ import annotations

from pathlib import Path

from exitspec.drafters.base import Drafter
from exitspec.tree import DraftTree

CHAIN_PREFIX = "chain:"


def split_chain(spec: str) -> tuple[str, bool]:
    """("dflash", True) for "chain:dflash"; (spec, False) for any other spec."""
    spec = str(spec)
    return (spec[len(CHAIN_PREFIX) :], True) if spec.startswith(CHAIN_PREFIX) else (spec, False)


def drafter_label(spec: str) -> str:
    """A drafter spec for tables and legends: "dflash", "ngram", a checkpoint folder's name (its run's name for
    a run's `final` folder), or "chain:" and one of those."""
    inner, chained = split_chain(spec)
    folder = Path(inner)
    name = folder.parent.name if folder.name == "final" and folder.parent.name else folder.name
    return CHAIN_PREFIX + name if chained else name


class ChainDrafter:
    """Plain chain speculative decoding with any drafter: the spine of its tree, the best child at each node.

    Both builders (DDTree best-first, weighted trie) list nodes in descending score, so a node's first child
    is its best one. `chain:D` in a drafter list names this wrapper around D.
    """

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.feature_layers = inner.feature_layers

    def estimate_for(self, setting) -> None:
        self.inner.estimate_for(setting)

    def identity(self) -> str:
        return CHAIN_PREFIX + self.inner.identity()

    def estimates_state(self) -> dict:
        return self.inner.estimates_state()

    def load_estimates(self, state: dict) -> None:
        self.inner.load_estimates(state)

    def begin(self, prompt_ids, features) -> None:
        self.inner.begin(prompt_ids, features)

    def propose(self, context, max_depth: int, cheap: bool = False):
        return self.inner.propose(context, max_depth, cheap)

    def build(self, proposal, root_token: int, budget: int) -> DraftTree:
        tree = self.inner.build(proposal, root_token, budget)
        spine, node = [0], 0
        while tree.children[node]:
            node = tree.children[node][0]
            spine.append(node)
        scores = None if tree.scores is None else [tree.scores[u] for u in spine]
        return DraftTree.chain(root_token, [tree.token_list[u] for u in spine[1:]], tree.device, scores)

    def observe(self, tree: DraftTree, reach) -> None:
        pass  # the inner drafter learns from the trees it built, not on their spines

    def commit(self, committed_ids, features) -> None:
        self.inner.commit(committed_ids, features)

    def learn(self, answer: list[int]) -> None:
        self.inner.learn(answer)

    def memory(self):
        return self.inner.memory()
