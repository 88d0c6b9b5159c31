"""The verifier-law check: does a verifier leave the tree at v with bonus y with probability w(v)·p_res_v(y)?

On random trees and random target distributions, each verifier is run many times; a G-test compares the
empirical joint law of (exit node, bonus token) with the exit law (flow.py), and the mean output length is
compared with 1 + C_p(T). `exitspec check` prints the results; the test suite asserts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from exitspec.flow import residual_probs, tree_flow
from exitspec.sampling import SamplingParams, WarpedRows, target_probs
from exitspec.tree import DraftTree
from exitspec.verify import Decision


def random_tree(gen: torch.Generator, vocab: int, max_depth: int = 5, max_branch: int = 4, max_nodes: int = 40):
    """A random tree: a random frontier node at a time gets 0..max_branch children with distinct tokens.

    Growing a random frontier node (rather than breadth-first) gives deep, lopsided trees as well as bushy ones.
    """
    parents, tokens, depths = [-1], [int(torch.randint(vocab, (1,), generator=gen))], [0]
    frontier = [0]
    while frontier and len(parents) < max_nodes + 1:
        node = frontier.pop(int(torch.randint(len(frontier), (1,), generator=gen)))
        if depths[node] >= max_depth:
            continue
        n_kids = int(torch.randint(0, min(max_branch, vocab) + 1, (1,), generator=gen))
        for tok in torch.randperm(vocab, generator=gen)[:n_kids].tolist()[: max_nodes + 1 - len(parents)]:
            parents.append(node)
            tokens.append(tok)
            depths.append(depths[node] + 1)
            frontier.append(len(parents) - 1)
    return DraftTree.from_parents(parents, tokens, vocab_size=vocab)


def random_logits(gen: torch.Generator, size: int, vocab: int, scale: float = 2.0) -> Tensor:
    """[size, vocab] logits peaked enough that trees are often accepted deeply."""
    return scale * torch.randn(size, vocab, generator=gen)


def exact_joint_law(tree: DraftTree, probs: Tensor) -> Tensor:
    """[N+1, V] float64: the probability of exiting at v with bonus token y, w(v)·p_res_v(y)."""
    probs = probs.double()
    return tree_flow(tree, probs).exit[:, None] * residual_probs(tree, probs)


def sample_verdicts(decide: Callable[..., Decision], tree: DraftTree, probs: Tensor, seed: int, draws: int):
    """Runs a verifier (verify.DECIDERS) `draws` times on the target distribution probs [N+1, V] → counts
    [N+1, V] of (exit node, bonus) and output lengths [draws]."""
    gen = torch.Generator(device=probs.device).manual_seed(seed)
    rows = WarpedRows.of_probs(probs)
    counts = torch.zeros(tree.size, probs.shape[-1], dtype=torch.float64)
    lengths = torch.zeros(draws, dtype=torch.float64)
    for i in range(draws):
        verdict = decide(tree, rows, gen).read(tree, rows, gen)
        counts[verdict.exit_node, verdict.bonus] += 1
        lengths[i] = len(verdict.path) + 1
    return counts, lengths


def g_test_pvalue(counts: Tensor, law: Tensor, min_expected: float = 5.0) -> float:
    """G-test of counts against law (same shape); cells expected below min_expected are pooled into one.

    An outcome the law calls impossible gives p = 0. The p-value is the chi-square survival function,
    gammaincc(df/2, G/2).
    """
    counts, law = counts.flatten().double(), law.flatten().double()
    if bool((counts[law == 0] > 0).any()):
        return 0.0
    expected = law * counts.sum()
    big, small = expected >= min_expected, (expected < min_expected) & (law > 0)
    observed = torch.cat([counts[big], counts[small].sum()[None]])
    expected = torch.cat([expected[big], expected[small].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    if observed.numel() < 2:
        return 1.0
    g = 2 * torch.sum(torch.where(observed > 0, observed * torch.log(observed / expected), 0.0))
    return float(torch.special.gammaincc(torch.tensor((observed.numel() - 1) / 2.0), g / 2))


@dataclass(frozen=True)
class LawCheck:
    verifier: str
    params: SamplingParams
    nodes: int
    depth: int
    draws: int
    p_value: float  # G-test of the joint law of (exit node, bonus token)
    mean_length: float  # empirical E[L], bonus included
    expected_length: float  # 1 + C_p(T)
    std_err: float

    @property
    def passed(self) -> bool:
        return self.p_value > 1e-3 and abs(self.mean_length - self.expected_length) < 3 * self.std_err + 1e-9


def check_law(
    name: str,
    decide: Callable[..., Decision],
    tree: DraftTree,
    probs: Tensor,
    params: SamplingParams,
    draws: int,
    seed: int,
) -> LawCheck:
    counts, lengths = sample_verdicts(decide, tree, probs, seed, draws)
    coverage = float(tree_flow(tree, probs.double()).coverage)
    return LawCheck(
        name, params, tree.num_nodes, tree.depth, draws, g_test_pvalue(counts, exact_joint_law(tree, probs)),
        float(lengths.mean()), 1 + coverage, float(lengths.std() / draws**0.5),
    )


def law_case(seed: int, params: SamplingParams, vocab: int = 6, max_nodes: int = 30) -> tuple[DraftTree, Tensor]:
    """A seeded random tree (depth ≤ 5, branching ≤ 4) and its warped target distribution [N+1, V]."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, vocab, max_depth=5, max_branch=4, max_nodes=max_nodes)
    return tree, target_probs(random_logits(gen, tree.size, vocab), params)
