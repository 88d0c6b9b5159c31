"""Tree builders: pick the `budget` most promising draft prefixes as one prefix-closed DraftTree.

Both builders run the same best-first search. Every candidate node scores no higher than the node that put
it on the heap, so nodes leave the heap in descending score and each arrives after its parent: the first B
pops are the B best nodes and already form a tree listed parents-first.

- `build_ddtree` (DDTree): candidates are all prefixes over per-depth top-k tokens of a drafter's marginals,
  scored by their summed log-probabilities.
- `build_trie`: candidates are the nodes of a trie of whole continuations (the n-gram drafter's), scored by
  the total weight of the continuations passing through them.
- `build_best_first`: candidates are all paths of a next-token model that, given a path, names its likely next
  tokens with probabilities (corpus lookup's n-gram table), scored by their products.
- `ranked_tree`: candidates already made (a suffix tree's speculation, a draft model's expansions) with scores
  that never grow along a path, listed best first.
- `merge_best_first`: the union of several such candidate trees (a model's and a copy source's), ranked by
  learned estimates of each node's reach probability P(u), so the sources compete for one budget.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from exitspec.tree import DraftTree


def build_ddtree(log_marginals: Tensor, root_token: int, budget: int, top_k: int | None = None) -> DraftTree:
    """The `budget` highest-scoring prefixes under a factorised drafter, as a tree on log_marginals' device.

    log_marginals [H, V]: row d-1 scores the token at depth d = 1..H. Rows are normalised here with
    log_softmax, so raw logits and log-probabilities give the same tree. A prefix (x_1..x_d) scores
    sum_i logp[i-1, x_i]; only the top_k (default min(budget, V)) tokens of each row are candidates.
    -inf entries are allowed and never selected, so the tree can hold fewer than `budget` nodes. Nodes come
    in pop order (descending score); ties go to the prefix pushed first. The tree's `scores` are the
    drafter's prefix probabilities exp(sum_i logp[i-1, x_i]).
    """
    if log_marginals.dim() != 2 or log_marginals.shape[0] == 0 or log_marginals.shape[1] == 0:
        raise ValueError(f"log_marginals must be [H, V] with H, V >= 1, got {tuple(log_marginals.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    device = log_marginals.device
    if budget == 0:
        return DraftTree.root_only(root_token, device=device)
    horizon, vocab_size = log_marginals.shape
    k = min(top_k or budget, vocab_size)
    logp = torch.log_softmax(log_marginals, dim=-1, dtype=torch.float32)  # [H, V]
    top_logp, top_tokens = logp.topk(k, dim=-1)  # [H, k] each, sorted descending
    # one transfer to the host, in float32 (token ids below 2^24 are exact)
    step_logp, step_tokens = torch.stack([top_logp, top_tokens]).tolist()  # [H][k] each
    if any(math.isnan(row[0]) for row in step_logp):  # a NaN or +inf entry, or an all -inf row, poisons its row
        raise ValueError("log_marginals must not contain NaN or +inf, and every row needs a finite entry")

    parents, tokens, depths, scores = [-1], [int(root_token)], [0], [0.0]
    push_order = itertools.count()
    # heap entry: (-score, push order, depth d, rank r_d, parent node, parent score)
    heap = [(-step_logp[0][0], next(push_order), 1, 0, 0, 0.0)]
    while heap and len(parents) <= budget:
        neg_score, _, d, rank, parent, parent_score = heapq.heappop(heap)
        score = -neg_score
        if score == -math.inf:  # everything left scores -inf too
            break
        node = len(parents)
        parents.append(parent)
        tokens.append(int(step_tokens[d - 1][rank]))
        depths.append(d)
        scores.append(score)
        if rank + 1 < k:  # next sibling: (r_1..r_{d-1}, r_d + 1)
            sibling_score = parent_score + step_logp[d - 1][rank + 1]
            heapq.heappush(heap, (-sibling_score, next(push_order), d, rank + 1, parent, parent_score))
        if d < horizon:  # first child: (r_1..r_d, 0)
            child_score = score + step_logp[d][0]
            heapq.heappush(heap, (-child_score, next(push_order), d + 1, 0, node, score))

    return DraftTree.from_lists(parents, tokens, depths, [math.exp(x) for x in scores], device)


def build_trie(
    root_token: int, continuations: list[list[int]], weights: list[float], budget: int, device=None
) -> DraftTree:
    """The `budget` heaviest nodes of the trie of `continuations` under root_token, as a tree on `device`.

    A node's score is the total weight of the continuations passing through it (duplicates add up), which
    never grows along a path since weights must be positive. Nodes come in pop order; ties go to the node
    that reached the frontier first (siblings in order of first appearance in `continuations`). The tree's
    `scores` are each node's share of the total weight: the fraction of the evidence that agrees on its prefix.
    A tree of `budget` nodes holds no node deeper than `budget`, so only that many tokens of each continuation
    enter the trie.
    """
    if len(continuations) != len(weights):
        raise ValueError(f"got {len(continuations)} continuations but {len(weights)} weights")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"weights must be finite and positive, got {weights}")

    # the trie: node 0 is the root; children[n] maps a token to its child node
    children: list[dict[int, int]] = [{}]
    trie_tokens, trie_weights = [int(root_token)], [0.0]
    for continuation, weight in zip(continuations, weights):
        node = 0
        for token in continuation[:budget]:
            if token < 0:
                raise ValueError(f"continuation tokens must be >= 0, got {token}")
            if token not in children[node]:
                children[node][token] = len(children)
                children.append({})
                trie_tokens.append(int(token))
                trie_weights.append(0.0)
            node = children[node][token]
            trie_weights[node] += weight

    parents, tokens, depths, scores = [-1], [int(root_token)], [0], [1.0]
    total = sum(weights)
    # heap entry: (-score, push order, trie node, tree parent node)
    push_order = itertools.count()
    heap = [(-trie_weights[c], next(push_order), c, 0) for c in children[0].values()]
    heapq.heapify(heap)
    while heap and len(parents) <= budget:
        _, _, trie_node, parent = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        tokens.append(trie_tokens[trie_node])
        depths.append(depths[parent] + 1)
        scores.append(trie_weights[trie_node] / total)
        for child in children[trie_node].values():
            heapq.heappush(heap, (-trie_weights[child], next(push_order), child, node))

    return DraftTree.from_lists(parents, tokens, depths, scores, device)


def build_best_first(
    root_token: int, next_tokens: Callable[[tuple[int, ...]], Sequence[tuple[int, float]]], budget: int,
    max_depth: int, device=None,
) -> DraftTree:
    """The `budget` most probable paths of at most `max_depth` tokens under a next-token model, as a tree.

    next_tokens(path) lists (token, q) for the tokens after root → path, q in (0, 1] (distinct tokens). A path
    scores the product of its q's (the model's prefix probability), which never grows along it, so pops come
    in descending score, parents first; ties go to the node pushed first. The tree's `scores` are those products.
    """
    if budget < 0 or max_depth < 0:
        raise ValueError(f"budget and max_depth must be >= 0, got {budget} and {max_depth}")
    parents, tokens, depths, scores = [-1], [int(root_token)], [0], [1.0]
    paths: list[tuple[int, ...]] = [()]
    push_order = itertools.count()
    heap: list[tuple[float, int, int, int]] = []  # (-score, push order, parent node, token)

    def push_children(node: int) -> None:
        if depths[node] < max_depth:
            for token, q in next_tokens(paths[node]):
                heapq.heappush(heap, (-scores[node] * q, next(push_order), node, token))

    push_children(0)
    while heap and len(parents) <= budget:
        neg_score, _, parent, token = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent), tokens.append(token), depths.append(depths[parent] + 1), scores.append(-neg_score)
        paths.append(paths[parent] + (token,))
        push_children(node)
    return DraftTree.from_lists(parents, tokens, depths, scores, device)


def ranked_tree(root_token: int, nodes: Sequence[int], parents: Sequence[int], tokens: Sequence[int],
                depths: Sequence[int], scores: Sequence[float]) -> DraftTree:
    """The candidates `nodes` (indices into the lists, a prefix-closed set) as a tree listed best first by score,
    ties in index order; `scores` are the nodes' prefix probabilities. A parent index outside `nodes` is the root.
    Scores never grow along a path and a parent's index is below its children's, so parents come first."""
    order = sorted(nodes, key=lambda i: (-scores[i], i))
    position = {i: k + 1 for k, i in enumerate(order)}
    return DraftTree.from_lists(
        [-1, *(position.get(parents[i], 0) for i in order)], [root_token, *(tokens[i] for i in order)],
        [0, *(depths[i] for i in order)], (1.0, *(scores[i] for i in order)),
    )


def merge_best_first(
    root_token: int, sources: Sequence[tuple[DraftTree, Sequence[float]]], budget: int, device=None
) -> tuple[DraftTree, list[list[tuple[int, int]]]]:
    """The `budget` best nodes of the union of several candidate trees under one root, ranked by estimate.

    sources: (tree, estimates) pairs; estimates[u] is that source's estimate of node u's reach probability
    P(u) (Eq. 2). A prefix proposed by several sources keeps the largest estimate, and an estimate is capped
    by its parent's, so estimates never grow along a path. A stable sort by descending estimate then lists
    every parent before its children: the first `budget` nodes are the best prefix-closed tree, best first
    (its `scores`). Also returns, per node, the (source index, source node) pairs that proposed it.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    parents, tokens, depths, estimates, origins = [-1], [int(root_token)], [0], [1.0], [[]]
    for s, (tree, node_estimates) in enumerate(sources):
        if tree.token_list[0] != int(root_token):
            raise ValueError(f"source {s} is rooted at token {tree.token_list[0]}, not {root_token}")
        merged = [0] * tree.size  # source node -> merged node
        for u, (p, tok) in enumerate(zip(tree.parent_list[1:], tree.token_list[1:]), start=1):
            key = (merged[p], tok)
            if key not in index:
                index[key] = len(parents)
                parents.append(merged[p]), tokens.append(tok), depths.append(depths[merged[p]] + 1)
                estimates.append(0.0), origins.append([])
            m = merged[u] = index[key]
            estimates[m] = max(estimates[m], float(node_estimates[u]))
            origins[m].append((s, u))
    for m in range(1, len(parents)):  # parents come first, so their estimates are final when read
        estimates[m] = min(estimates[m], estimates[parents[m]])
    order = [0, *sorted(range(1, len(parents)), key=lambda m: -estimates[m])[:budget]]
    position = {m: i for i, m in enumerate(order)}
    tree = DraftTree.from_lists(
        [-1] + [position[parents[m]] for m in order[1:]], [tokens[m] for m in order],
        [depths[m] for m in order], [estimates[m] for m in order], device,
    )
    return tree, [origins[m] for m in order]

