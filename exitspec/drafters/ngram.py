"""Prompt-lookup drafting: training-free, it guesses that the context repeats itself.

The drafter finds earlier places in the context whose preceding tokens match the context's last tokens
(its suffix n-gram, n = max_ngram down to min_ngram) and proposes the tokens that followed them. The
continuations go into a trie (`build.build_trie`), so the tree keeps the tokens that most matches agree on.
Its nodes carry learned estimates of P(u) (estimates.py), learned from the rounds the target verified.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import Tensor

from exitspec.build import build_trie
from exitspec.estimates import SourceMerge, copy_bins, copy_estimator
from exitspec.tree import DraftTree


@dataclass(frozen=True)
class NgramProposal:
    """Candidate continuations, best first, with their positive weights."""

    continuations: list[list[int]]
    weights: list[float]


class NgramDrafter:
    """A prompt-lookup drafter; it reads no target features and keeps no state between rounds."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_candidates: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.max_ngram, self.min_ngram, self.max_candidates = max_ngram, min_ngram, max_candidates
        self.merge = SourceMerge({"copy": (copy_estimator, copy_bins)})

    def estimate_for(self, setting: Hashable) -> None:
        self.merge.use(setting)

    def identity(self) -> str:
        return f"ngram(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, max_candidates={self.max_candidates})"

    def estimates_state(self) -> dict:
        return self.merge.state(self.merge.setting)

    def load_estimates(self, state: dict) -> None:
        self.merge.load_state(self.merge.setting, state)

    def begin(self, prompt_ids: Tensor, features: Tensor | None) -> None:
        pass

    def commit(self, committed_ids: Tensor, features: Tensor | None) -> None:
        pass

    def learn(self, answer: list[int]) -> None:
        pass

    def memory(self) -> None:
        return None

    def propose(self, context: Sequence[int], max_depth: int, cheap: bool = False) -> NgramProposal:
        """Up to max_candidates continuations (each <= max_depth tokens) of earlier suffix matches in the context's L
        tokens.

        A match starting the continuation at position e has length m = how many tokens before e equal the
        context's last tokens (at most max_ngram); matches with m >= min_ngram count. They rank by m, then by
        recency, and weigh m + e / L, so a longer match outweighs any shorter one and ties favour recent text.
        """
        ctx = list(context)  # [L]: a loop over a Python list beats a dozen tensor ops on a few hundred tokens
        length = len(ctx)
        n = min(self.max_ngram, length - 1)
        if max_depth < 1 or n < self.min_ngram:
            return NgramProposal([], [])

        matches = []  # (m, e)
        for e in [i + 1 for i, token in enumerate(ctx[:-1]) if token == ctx[-1]]:  # e <= L-1: ctx[e-1] agrees
            m = 1
            while m < n and m < e and ctx[e - 1 - m] == ctx[length - 1 - m]:
                m += 1
            if m >= self.min_ngram:
                matches.append((m, e))
        matches.sort(reverse=True)  # longest match first, then most recent
        matches = matches[: self.max_candidates]
        continuations = [ctx[e : e + max_depth] for _, e in matches]  # each stops where the context ends
        weights = [m + e / length for m, e in matches]
        return NgramProposal(continuations, weights)

    def trie(self, proposal: NgramProposal, root_token: int, budget: int) -> DraftTree:
        """The trie of the proposed continuations, cut to its `budget` heaviest nodes (root-only without matches)."""
        return build_trie(root_token, proposal.continuations, proposal.weights, budget)

    def build(self, proposal: NgramProposal, root_token: int, budget: int) -> DraftTree:
        """The trie's nodes ranked by their learned estimates of P(u), the best `budget` of them."""
        candidates = {"copy": self.trie(proposal, root_token, budget)} if proposal.continuations else {}
        return self.merge.build(root_token, candidates, budget)

    def observe(self, tree: DraftTree, reach: list[float]) -> None:
        """The realised reach probabilities P(u) [N+1] (NaN: unobserved) of the last tree built teach its
        estimates."""
        self.merge.observe(tree, reach)
