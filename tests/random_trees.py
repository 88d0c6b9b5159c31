"""Random draft trees and target distributions for the law tests (seeded, small vocabularies)."""

from __future__ import annotations

import torch

from exitspec.tree import DraftTree


def random_tree(gen: torch.Generator, vocab: int, max_depth: int = 5, max_branch: int = 4, max_nodes: int = 40):
    """A random tree: each node gets 0..max_branch children with distinct tokens, breadth-first."""
    parents, tokens, depths = [-1], [int(torch.randint(vocab, (1,), generator=gen))], [0]
    frontier = [0]
    while frontier and len(parents) < max_nodes + 1:
        node = frontier.pop(0)
        if depths[node] >= max_depth:
            continue
        n_kids = int(torch.randint(0, min(max_branch, vocab) + 1, (1,), generator=gen))
        kid_tokens = torch.randperm(vocab, generator=gen)[:n_kids].tolist()
        for tok in kid_tokens[: max_nodes + 1 - len(parents)]:
            parents.append(node)
            tokens.append(tok)
            depths.append(depths[node] + 1)
            frontier.append(len(parents) - 1)
    return DraftTree.from_parents(parents, tokens, vocab_size=vocab)


def random_logits(gen: torch.Generator, size: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    """[size, vocab] logits peaked enough that trees are often accepted deeply."""
    return scale * torch.randn(size, vocab, generator=gen)


def subtree_matrix(tree: DraftTree) -> torch.Tensor:
    """[N+1, N+1] float, S[u, v] = 1 when v lies in the subtree of u (v = u included)."""
    return tree.visibility_mask().T.float()
