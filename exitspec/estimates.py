"""Node estimates: what a drafter's score is worth in target reach probability, learned online.

A drafter scores its nodes (a model's prefix probability, a copy source's share of agreeing matches), but
the decode loop needs the probability that a target continuation walks to the node, P(u) (Eq. 2): the
sum of P(u) over a tree is its exact expected accepted length C_p (Eq. 5). Every verified round reveals
P(u) for every node of its tree, so each node's score falls in a bin and the bin keeps a running mean of
the realised P(u) of its nodes, shrunk towards a prior while it has few of them:

    estimate(b) = (Σ_b decay^age · P(u) + w0 · prior(b)) / (Σ_b decay^age + w0)

Bins form a grid [rows, cols] whose columns go from more to less promising (a lower model score, a deeper
copy node); estimates are made non-increasing along a row, which keeps the best-first order of a tree
prefix-closed. `SourceMerge` ranks the nodes of several sources on one scale with these estimates
(build.merge_best_first) and routes each round's realised P(u) back to the bins that predicted them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from exitspec.build import merge_best_first
from exitspec.tree import DraftTree


class ReachEstimator:
    """Running means of realised reach probabilities per bin of a [rows, cols] grid, with priors.

    Counts live in plain lists: `observe` runs every round on a few dozen nodes, where per-element tensor
    indexing would cost more than the arithmetic."""

    def __init__(self, prior: Tensor, prior_weight: float = 4.0, decay: float = 0.995):
        self.cols = prior.shape[-1]
        self.prior = prior.double().flatten().tolist()  # [rows * cols], row-major
        self.prior_weight, self.decay = prior_weight, decay
        self.mass = [0.0] * len(self.prior)  # decayed sum of realised P(u)
        self.count = [0.0] * len(self.prior)  # decayed number of nodes
        self._table: list[float] | None = None

    def table(self) -> list[float]:
        """Estimates of all bins, flat in row-major order, non-increasing along each row."""
        if self._table is None:
            w = self.prior_weight
            table = [(m + w * p) / (c + w) for m, p, c in zip(self.mass, self.prior, self.count)]
            for b in range(len(table)):
                if b % self.cols:
                    table[b] = min(table[b], table[b - 1])
            self._table = table
        return self._table

    def estimate(self, bins: Sequence[int]) -> list[float]:
        table = self.table()
        return [table[b] for b in bins]

    def observe(self, bins: Sequence[int], reach: Sequence[float]) -> None:
        """Adds the realised P(u) of nodes that fell in `bins` (flat indices)."""
        for b, r in zip(bins, reach):
            self.mass[b] = self.decay * self.mass[b] + r
            self.count[b] = self.decay * self.count[b] + 1.0
        self._table = None

    def state(self) -> dict:
        """What the bins learned, JSON-ready: {"mass": [rows * cols], "count": [rows * cols]} (the prior is code)."""
        return {"mass": list(self.mass), "count": list(self.count)}

    def load_state(self, state: dict) -> None:
        """Restores a `state()`; ValueError (and nothing changed) unless it holds a finite mass and count >= 0
        for each of this grid's bins."""
        bins = len(self.prior)
        if not isinstance(state, dict) or set(state) != {"mass", "count"}:
            raise ValueError("a estimator's state holds exactly 'mass' and 'count'")
        for name, values in state.items():
            if not isinstance(values, list) or len(values) != bins:
                raise ValueError(f"a estimator's {name!r} needs {bins} bins")
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"a estimator's {name!r} holds a value that is not a finite number >= 0")
        self.mass, self.count = [float(v) for v in state["mass"]], [float(v) for v in state["count"]]
        self._table = None


MODEL_BIN_NATS, MODEL_BINS = 0.5, 24  # model scores: bins of half a nat of -log q, the last one open
COPY_DEPTHS, COPY_SHARES = 8, 4  # copy nodes: depth 1..8 (deeper in the last) x share of agreeing matches


def model_estimator() -> ReachEstimator:
    """For a model's prefix probability q: bin b holds -log q in [b/2, (b+1)/2) nats; prior q / 2 (drafters
    are overconfident far more often than not, and a bin earns its estimate from what the target accepts)."""
    return ReachEstimator(_half_bin_centres()[None])


def _half_bin_centres() -> Tensor:
    """[MODEL_BINS] q / 2 at the centre of each bin of -log q: the prior of prefix-probability bins."""
    centres = torch.arange(MODEL_BINS, dtype=torch.float64) + 0.5
    return 0.5 * torch.exp(-MODEL_BIN_NATS * centres)


def model_bins(scores: Sequence[float]) -> list[int]:
    return [min(int(-math.log(max(q, 1e-300)) / MODEL_BIN_NATS), MODEL_BINS - 1) for q in scores]


def lookup_estimator() -> ReachEstimator:
    """For corpus-lookup nodes by (depth, prefix probability q under the n-gram table): a table's chains stay
    confident where the target has long left them, so depth d gets its own row of q bins; prior
    q / 2 · 0.6^(d-1)."""
    return ReachEstimator(_depth_prior())


def _depth_prior() -> Tensor:
    """[COPY_DEPTHS, MODEL_BINS] q / 2 · 0.6^(d-1): depth rows of prefix-probability bins."""
    depth = torch.arange(COPY_DEPTHS, dtype=torch.float64)
    return _half_bin_centres()[None] * 0.6 ** depth[:, None]


def lookup_bins(tree: DraftTree) -> list[int]:
    """Bins of a lookup tree's nodes (its `scores` are prefix probabilities q): row depth, column q."""
    return [(min(d, COPY_DEPTHS) - 1) * MODEL_BINS + b for d, b in zip(tree.lists[2], model_bins(tree.scores))]


def draft_path_estimator() -> ReachEstimator:
    """For a draft model's nodes by (on its greedy path or off it, depth, prefix probability q): at T = 0 the target
    accepts only its own greedy path, and a draft model agrees with it most along the draft's greedy path, which
    q alone does not tell apart from a sibling of the same q; the lookup prior for both."""
    return ReachEstimator(torch.cat([_depth_prior(), _depth_prior()]))


def draft_path_bins(tree: DraftTree) -> list[int]:
    """Bins of a draft model's candidate tree (listed best first, `scores` its prefix probabilities q): the draft's
    greedy path (each node its parent's first, so most probable, child, down from the root) in the first half of
    the grid, the other nodes in the second; within each, row depth, column q."""
    parents, depths = tree.parent_list, tree.lists[2]
    greedy, first_child = [True] * tree.size, set()
    for u in range(1, tree.size):
        greedy[u] = greedy[parents[u]] and parents[u] not in first_child
        first_child.add(parents[u])
    return [(0 if g else COPY_DEPTHS * MODEL_BINS) + (min(d, COPY_DEPTHS) - 1) * MODEL_BINS + b
            for d, b, g in zip(depths, model_bins(tree.scores), greedy)]


def copy_estimator() -> ReachEstimator:
    """For copy nodes by (share of agreeing matches, depth); prior 0.15 · share · 0.6^(depth-1), low until the
    text shows that it repeats itself."""
    share = (torch.arange(COPY_SHARES, dtype=torch.float64) + 1) / COPY_SHARES
    depth = torch.arange(COPY_DEPTHS, dtype=torch.float64)
    return ReachEstimator(0.15 * share[:, None] * 0.6 ** depth[None])


def copy_bins(tree: DraftTree) -> list[int]:
    """Bins of a trie tree's nodes (its `scores` are shares of agreeing matches): row share, column depth."""
    depths = tree.lists[2]
    return [
        min(int(share * COPY_SHARES), COPY_SHARES - 1) * COPY_DEPTHS + min(d, COPY_DEPTHS) - 1
        for share, d in zip(tree.scores, depths)
    ]


class SourceMerge:
    """Candidate trees from several named sources, each with its estimator, merged into one ranked tree.

    P(u) depends on the sampling settings (at T = 0 it is 0 or 1, at T = 1 a product of probabilities), so the
    estimators are kept per setting: `use(setting)` switches to that setting's, made fresh on first use."""

    def __init__(self, sources: dict[str, tuple[Callable[[], ReachEstimator], Callable[[DraftTree], list[int]]]]):
        self.sources = sources  # name -> (a fresh estimator, tree -> bin of every node)
        self._by_setting: dict[Hashable, dict[str, ReachEstimator]] = {}
        self._origins: list[list[tuple[str, int]]] = []  # per node of the last tree: (source, bin)
        self.use(None)

    def use(self, setting: Hashable) -> None:
        """Estimates learned under `setting` from here on (the sampling parameters of the rounds to come)."""
        if setting not in self._by_setting:
            self._by_setting[setting] = self._fresh()
        self.setting, self.estimators = setting, self._by_setting[setting]

    def state(self, setting: Hashable) -> dict:
        """What the estimators learned under `setting`, JSON-ready: {source: ReachEstimator.state()}; fresh ones'
        for a setting not used yet."""
        return {name: c.state() for name, c in (self._by_setting.get(setting) or self._fresh()).items()}

    def load_state(self, setting: Hashable, state: dict) -> None:
        """Restores a `state(setting)`; ValueError (and nothing changed) unless it holds a fitting state for
        exactly these sources."""
        if not isinstance(state, dict) or set(state) != set(self.sources):
            raise ValueError(f"an estimates state holds exactly the sources {sorted(self.sources)}")
        estimators = self._fresh()
        for name, estimator in estimators.items():
            estimator.load_state(state[name])
        self._by_setting[setting] = estimators
        if setting == self.setting:
            self.estimators = estimators

    def _fresh(self) -> dict[str, ReachEstimator]:
        return {name: make() for name, (make, _) in self.sources.items()}

    def build(self, root_token: int, candidates: dict[str, DraftTree], budget: int, device=None) -> DraftTree:
        """The `budget` best nodes over all sources' candidate trees, by learned estimate of P(u); the root
        alone when no source has a candidate node."""
        candidates = {name: tree for name, tree in candidates.items() if tree.num_nodes}
        if not candidates:
            self._origins = [[]]
            return DraftTree.root_only(root_token, device)
        names, scored, bins = [], [], []
        for name, tree in candidates.items():
            _, binning = self.sources[name]
            node_bins = [0, *binning(tree)[1:]]
            names.append(name)
            bins.append(node_bins)
            scored.append((tree, [1.0, *self.estimators[name].estimate(node_bins[1:])]))
        tree, origins = merge_best_first(root_token, scored, budget, device)
        self._origins = [[(names[s], bins[s][u]) for s, u in node] for node in origins]
        return tree

    def observe(self, tree: DraftTree, reach: Sequence[float]) -> None:
        """Feeds the realised P(u) of the last built tree's nodes (reach [N+1], NaN where the target did not
        reveal it: flow.observed_reach)."""
        for u in range(1, min(tree.size, len(self._origins))):
            if not math.isnan(reach[u]):
                for name, b in self._origins[u]:
                    self.estimators[name].observe([b], [reach[u]])
