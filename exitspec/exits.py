"""`exitspec inspect "prompt"`: where does the target's probability mass leave the drafter's trees?

A few rounds of ordinary exact tree speculative decoding (`SpeculativeDecoder.generate` with `max_rounds`)
hand each round's tree, warped target distribution and verdict to an `on_round` hook. For every round the
exit law of flow.py (paper Eqs. 1–5) is evaluated on the warped target distribution p_v:

    P(root) = 1,  P(u) = P(parent) · p_parent(x_u),  rho(v) = 1 − Σ_children p_v(x_c),  w(v) = P(v) · rho(v)
    C_p = Σ_{u≠root} P(u),   τ = accepted + 1 (this round),   E[τ] = 1 + C_p

and reported: τ, C_p, the exit mass w at the root and summed per depth, and the nodes with the largest w with
their root-to-node draft text. A PNG shows one round's tree coloured by w(v) (x = depth, y = sibling order)
and the exit mass per depth across rounds; `--json` prints everything (trees included) as one object.

`--oracle` measures how far each tree is from the best one possible. The best tree of N nodes for the round's
context holds the N sequences of largest P(u) (P falls along every path, so they form a prefix-closed tree);
best-first search over the target itself finds it, one target forward a node (`best_tree`). Its coverage
C*_p(N) bounds every drafter's at that size, so 1 + C*_p(N) bounds E[τ] of any exact verifier on any tree of
N nodes (Eq. 5), and with the target stage's measured cost t(N) (budget.CostModel) the best round gives

    SR* = Σ_rounds (1 + C*_p(N_r)) · t(0) / Σ_rounds t(N_r),   N_r = argmax_N (1 + C*_p(N)) / t(N),

a ceiling on the speed-up of tree speculation with a free drafter over the one-token step t(0).

    exitspec inspect "Write a haiku about the sea." --rounds 8 --budget 32 --plot inspect.png
    exitspec inspect "5 6 7 5 6" --ids --model tiny_folder --drafter ngram --json
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from exitspec.app import check_budgets, load_decoders
from exitspec.budget import CostModel, best_size
from exitspec.decode import RoundTrace, SpeculativeDecoder
from exitspec.drafters import default_drafter
from exitspec.flow import TreeFlow, tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.settings import budget_cap
from exitspec.target import TargetModel
from exitspec.tree import DraftTree
from exitspec.verify import check_verifier


@dataclass(frozen=True)
class RoundExit:
    tree: DraftTree  # on the CPU
    flow: TreeFlow  # the exit law on the warped target distribution, float64, on the CPU
    path: list[int]  # accepted nodes, root excluded
    bonus: int | None  # the bonus token (None when a stop token or the limit cut the block)
    tokens: list[int]  # what this round added to the output

    @property
    def exit_by_depth(self) -> list[float]:
        """Σ_{v at depth d} w(v) for d = 0 (the root) .. tree depth; sums to 1."""
        mass = torch.zeros(self.tree.depth + 1, dtype=self.flow.exit.dtype)
        return mass.scatter_add_(0, self.tree.depths, self.flow.exit).tolist()


def inspect_rounds(
    decoder: SpeculativeDecoder,
    prompt,
    rounds: int,
    budget: int | str,
    params: SamplingParams,
    verifier: str = "tev",
    seed: int = 0,
    chat: bool = True,
    max_new_tokens: int | None = None,
) -> tuple[list[int], list[RoundExit], list[int]]:
    """Decodes `rounds` rounds (fewer where `max_new_tokens` binds first) → (prompt ids, per-round exit laws,
    generated tokens)."""
    traces: list[RoundTrace] = []
    result = decoder.generate(
        prompt,
        # by default never binds: a round emits <= budget + 1 tokens
        max_new_tokens=max_new_tokens or rounds * (budget_cap(budget) + 1),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        budget=budget,
        verifier=verifier,
        seed=seed,
        chat=chat,
        max_rounds=rounds,
        on_round=traces.append,
    )
    exits = []
    for t in traces:
        tree = t.tree.to("cpu")
        bonus = t.verdict.bonus if t.emitted > len(t.verdict.path) else None
        exits.append(RoundExit(tree, tree_flow(tree, t.probs.double().cpu()), t.verdict.path, bonus,
                               t.verdict.output_tokens(t.tree)[: t.emitted]))
    return result.prompt_ids, exits, result.tokens


@torch.inference_mode()
def best_tree(target: TargetModel, root: int, budget: int, params: SamplingParams) -> DraftTree:
    """The tree of `budget` draft tokens with the largest coverage C_p after the target's cache + `root`, found
    best-first over the target's own warped distribution (one `forward_tree` per node, discarded after it):
    nodes in order of decreasing P(u), so its head of N nodes is the best tree of N (`head`). scores = P(u).
    No node lies deeper than the model's context leaves room for."""
    parents, tokens, depths, reach = [-1], [root], [0], [1.0]
    frontier: list[tuple[float, int, int]] = []  # (−P(child), parent, token)
    deepest = target.max_context - target.cache_len - 1  # a tree of depth d takes d + 1 positions after the cache
    while True:
        tree = DraftTree.from_lists(parents, tokens, depths, reach, device=target.device)
        if len(tokens) > budget:
            return tree
        logits = target.forward_tree(tree, logits_to_keep=1).logits  # [1, V]: the newest node's row
        target.discard()
        probs, children = target_probs(logits.float(), params)[0].topk(budget + 1 - len(tokens))
        node = len(tokens) - 1
        for p, x in zip(probs.tolist(), children.tolist()):
            if p > 0 and depths[node] < deepest:
                heapq.heappush(frontier, (-reach[node] * p, node, x))
        if not frontier:
            return tree
        minus_p, parent, token = heapq.heappop(frontier)
        parents.append(parent)
        tokens.append(token)
        depths.append(depths[parent] + 1)
        reach.append(-minus_p)


def best_trees(
    target: TargetModel, prompt_ids: list[int], rounds: list[RoundExit], budget: int, params: SamplingParams
) -> Iterator[DraftTree]:
    """Per round, the best tree of `budget` nodes (`best_tree`) for that round's context (prompt + everything
    emitted before it): runs the rounds' contexts through the target's cache again."""
    target.reset()
    target.prefill(torch.tensor(prompt_ids[:-1], device=target.device))
    context = list(prompt_ids)
    for rnd in rounds:
        yield best_tree(target, context[-1], budget, params)
        context.extend(rnd.tokens)
        target.forward_tokens(torch.tensor(context[-1 - len(rnd.tokens) : -1], device=target.device), 1)


def best_coverages(
    target: TargetModel, prompt_ids: list[int], rounds: list[RoundExit], budget: int, params: SamplingParams
) -> list[list[float]]:
    """Per round, C*_p(N) for N = 0..budget: the coverage of the best tree of N nodes for that round's context."""
    out = []
    for tree in best_trees(target, prompt_ids, rounds, budget, params):
        reach = list(tree.scores[1:])
        reach += [0.0] * (budget - len(reach))  # a warp (top-k, top-p, T = 0) may leave fewer sequences than B
        out.append([0.0, *itertools.accumulate(reach)])
    return out


def ceiling(best: list[list[float]], cost: CostModel) -> dict:
    """The best trees' bounds over rounds (module docstring): mean C*_p at the full budget, and SR*, the speed-up
    over the one-token step t(0) of rounds that each keep the best tree of their most profitable size (the size
    `--budget auto` would pick, `budget.best_size`, were its estimates the true P(u) and drafting free)."""
    reach = [[1.0, *(b - a for a, b in itertools.pairwise(c))] for c in best]  # P(u) in best-first order, root first
    sizes = [best_size(r, cost, 0.0, len(r) - 1) for r in reach]
    tokens = sum(1 + c[n] for c, n in zip(best, sizes))
    seconds = sum(cost(n) for n in sizes)
    return {
        "mean_best_coverage": sum(c[-1] for c in best) / max(len(best), 1),
        "best_speedup": tokens / seconds * cost(0) if best else 0.0,
        "best_sizes": sizes,
    }


def describe(rounds: list[RoundExit], tokenizer, top: int = 5, best: list[list[float]] | None = None) -> list[dict]:
    """JSON-able per-round records: τ, C_p, exit mass by depth, the `top` most-exited nodes, the whole tree; with
    `best` (`best_coverages`), the best tree's C*_p at the round's size and at the full budget."""
    out = []
    for r, rnd in enumerate(rounds):
        tree, flow = rnd.tree, rnd.flow
        accepted = set(rnd.path)
        order = torch.argsort(flow.exit, descending=True, stable=True)[:top].tolist()
        exits = []
        for v in order:
            tokens = tree.tokens[tree.path(v)].tolist()
            exits.append(
                {
                    "node": v,
                    "depth": int(tree.depths[v]),
                    "w": float(flow.exit[v]),
                    "P": float(flow.reach[v]),
                    "rho": float(flow.rho[v]),
                    "accepted": v == 0 or v in accepted,
                    "tokens": tokens,
                    "text": _text(tokenizer, tokens),
                }
            )
        out.append(
            {
                "round": r,
                "tree_size": tree.num_nodes,
                "depth": tree.depth,
                "accepted": len(rnd.path),
                "tau": len(rnd.path) + 1,
                "coverage": float(flow.coverage),
                "exit_root": float(flow.exit[0]),
                "exit_by_depth": rnd.exit_by_depth,
                "bonus": rnd.bonus,
                "top_exits": exits,
                "tree": {
                    "parents": tree.parents.tolist(),
                    "tokens": tree.tokens.tolist(),
                    "w": flow.exit.tolist(),
                    "accepted_path": rnd.path,
                },
            }
        )
        if best is not None:
            out[-1] |= {"best_coverage_same_size": best[r][tree.num_nodes], "best_coverage": best[r][-1]}
    return out


def summarize(records: list[dict]) -> dict:
    """Means over rounds: τ, C_p (so 1 + C_p is the expected τ), exit mass per depth (0 past a tree's depth)."""
    n = max(len(records), 1)
    depth = max((len(r["exit_by_depth"]) for r in records), default=0)
    by_depth = [sum(r["exit_by_depth"][d] for r in records if d < len(r["exit_by_depth"])) / n for d in range(depth)]
    summary = {
        "rounds": len(records),
        "tau": sum(r["tau"] for r in records) / n,
        "mean_coverage": sum(r["coverage"] for r in records) / n,
        "mean_exit_by_depth": by_depth,
    }
    if records and "best_coverage" in records[0]:
        summary["mean_best_coverage_same_size"] = sum(r["best_coverage_same_size"] for r in records) / n
    return summary


# ---------------------------------------------------------------------------------------------------------
# The plot


def tree_layout(tree: DraftTree) -> Tensor:
    """[N+1, 2] (x, y): x = depth; leaves take y = 0, 1, … in depth-first sibling order, a parent the mean of its
    children (children follow their parents in the node order, so one backward sweep places every parent)."""
    y = torch.zeros(tree.size, dtype=torch.float64)
    stack, leaf = [0], 0
    while stack:
        v = stack.pop()
        if not tree.children[v]:
            y[v], leaf = leaf, leaf + 1
        stack.extend(reversed(tree.children[v]))
    for v in range(tree.size - 1, -1, -1):
        if tree.children[v]:
            y[v] = y[tree.children[v]].mean()
    return torch.stack([tree.depths.double(), y], dim=1)


def plot_rounds(rounds: list[RoundExit], records: list[dict], path: str, plot_round: int = 0) -> None:
    """Writes a PNG: round `plot_round`'s tree coloured by w(v) (accepted path in red), then the exit mass per
    depth of every round as stacked bars."""
    fig = Figure(figsize=(14, 6), layout="constrained")
    ax_tree, ax_bars = fig.subplots(1, 2, width_ratios=[3, 2])
    rnd, rec = rounds[plot_round], records[plot_round]
    tree, w = rnd.tree, rnd.flow.exit
    xy = tree_layout(tree)
    on_path = set(rnd.path)
    for u in range(1, tree.size):
        p = int(tree.parents[u])
        accepted = u in on_path
        ax_tree.plot(*xy[[p, u]].T, color="tab:red" if accepted else "0.7", lw=2.5 if accepted else 0.8, zorder=1)
    norm = Normalize(0.0, max(float(w.max()), 1e-12))
    ax_tree.scatter(xy[:, 0], xy[:, 1], c=w, cmap="viridis", norm=norm, s=60, edgecolors="k", linewidths=0.4, zorder=2)
    labels = {e["node"]: e["text"] for e in rec["top_exits"]}
    for v in range(tree.size):
        label = "root" if v == 0 else repr(labels[v]) if v in labels else ""
        ax_tree.annotate(label, xy[v], xytext=(5, 3), textcoords="offset points", fontsize=7)
    ax_tree.invert_yaxis()
    ax_tree.set_yticks([])
    ax_tree.set_xlabel("depth")
    ax_tree.set_title(
        f"round {plot_round}: N={tree.num_nodes}, τ={rec['tau']}, C_p={rec['coverage']:.2f}, "
        f"w(root)={rec['exit_root']:.2f}"
        f"\nlabels: the {len(labels)} most-exited nodes (root-to-node text); red: the accepted path",
        fontsize=10,
    )
    fig.colorbar(ScalarMappable(norm, "viridis"), ax=ax_tree, label="exit mass w(v) = P(v)·rho(v)")

    depth = max(len(r["exit_by_depth"]) for r in records)
    bottom = torch.zeros(len(records), dtype=torch.float64)
    colors = [f"C{d % 10}" for d in range(depth)]
    for d in range(depth):
        mass = torch.tensor([r["exit_by_depth"][d] if d < len(r["exit_by_depth"]) else 0.0 for r in records])
        ax_bars.bar(range(len(records)), mass, bottom=bottom, color=colors[d], label=f"depth {d}")
        bottom += mass
    ax_bars.set_xlabel("round")
    ax_bars.set_ylabel("exit mass Σ w(v) per depth (bars)")
    ax_bars.set_ylim(0, 1)
    ax_acc = ax_bars.twinx()
    ax_acc.plot([r["coverage"] for r in records], "k--", label="C_p = E[accepted]")
    ax_acc.plot([r["tau"] - 1 for r in records], "ko", label="accepted = τ − 1")
    ax_acc.set_ylim(0, max(r["depth"] for r in records) + 1)
    ax_acc.set_ylabel("draft tokens")
    handles = [h + a for h, a in zip(ax_bars.get_legend_handles_labels(), ax_acc.get_legend_handles_labels())]
    ax_acc.legend(*handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.15, 1.0))
    for ax in (ax_tree, ax_bars):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_bars.set_title("where the target's mass leaves the tree, per round")
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------------------
# The command


def run(args) -> int:
    """Checks every option, loads the decoder, inspects the rounds and prints (or --json dumps) the report."""
    if budget_cap(args.budget) < 1:
        raise ValueError("--budget must be at least 1: inspect looks at draft trees")
    if args.plot_round >= args.rounds:
        raise ValueError(f"--plot-round {args.plot_round} is not one of the {args.rounds} rounds")
    prompt = _prompt_ids(args.prompt) if args.ids else args.prompt
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    check_verifier(args.verifier, params)
    args.drafter = args.drafter or default_drafter(args.model)
    check_budgets([args.budget], args.model, args.device)
    decoder = load_decoders(args.model, [args.drafter], args.device, args.dtype, args.threads, args.lookup,
                            warm_start=not args.no_warm_start, learn=False)[args.drafter]
    prompt_ids, rounds, tokens = inspect_rounds(
        decoder, prompt, args.rounds, args.budget, params, args.verifier, args.seed, chat=not args.no_chat
    )
    if not rounds:
        raise ValueError("decoding stopped before the first round")
    if args.plot_round >= len(rounds):
        raise ValueError(f"--plot-round {args.plot_round} is not one of the {len(rounds)} rounds")
    tokenizer = decoder.target.tokenizer
    cap = budget_cap(args.budget)
    best = best_coverages(decoder.target, prompt_ids, rounds, cap, params) if args.oracle else None
    records = describe(rounds, tokenizer, args.top, best)
    if args.plot:
        plot_rounds(rounds, records, args.plot, args.plot_round)
    summary = summarize(records) | (ceiling(best, decoder.calibrate(cap)) if best is not None else {})
    if not args.json:
        print(_report(records, summary, args.plot))
        return 0
    keys = ("model", "drafter", "budget", "temperature", "top_p", "top_k", "verifier", "seed", "device", "dtype",
            "oracle")
    print(json.dumps({
        "prompt": args.prompt, "prompt_ids": prompt_ids, "token_ids": tokens, "text": _text(tokenizer, tokens),
        "settings": {k: getattr(args, k) for k in keys}, "rounds": records, "summary": summary,
        "plot": args.plot or None,
    }))
    return 0


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--ids expects token ids separated by spaces or commas, got {text!r}") from None


def _report(records: list[dict], summary: dict, plot: str) -> str:
    lines = []
    for r in records:
        depths = "  ".join(f"d{d} {m:.3f}" for d, m in enumerate(r["exit_by_depth"]))
        lines.append(
            f"round {r['round']}: N={r['tree_size']} depth {r['depth']}  τ={r['tau']}  C_p={r['coverage']:.3f}  "
            f"exit at root {r['exit_root']:.3f}  | exit mass by depth: {depths}"
        )
        if "best_coverage" in r:
            lines.append(f"   best tree: C*_p {r['best_coverage_same_size']:.3f} at N={r['tree_size']}, "
                         f"{r['best_coverage']:.3f} at the full budget")
        for e in r["top_exits"]:
            mark = "✓" if e["accepted"] else " "
            lines.append(
                f"   {mark} w {e['w']:.3f}  P {e['P']:.3f}  rho {e['rho']:.3f}  depth {e['depth']}  "
                f"{'(root)' if e['node'] == 0 else repr(e['text'])}"
            )
    mean = "  ".join(f"d{d} {m:.3f}" for d, m in enumerate(summary["mean_exit_by_depth"]))
    lines.append(
        f"\n{summary['rounds']} rounds: mean τ {summary['tau']:.2f}, mean C_p {summary['mean_coverage']:.2f} "
        f"(E[τ] = 1 + C_p = {1 + summary['mean_coverage']:.2f}); mean exit mass by depth: {mean}"
        "\n(✓: on the accepted path; w = P·rho is where a target sample leaves the tree)"
    )
    if "best_speedup" in summary:
        same = summary["mean_best_coverage_same_size"]
        lines.append(
            f"best trees (the target's own, best-first): mean C*_p {same:.2f} at the rounds' sizes (the drafter "
            f"reaches {summary['mean_coverage'] / same if same else 1:.0%} of it), {summary['mean_best_coverage']:.2f} "
            f"at the full budget; SR* {summary['best_speedup']:.2f}× (a free drafter, each round the best tree of "
            "its most profitable size, over the one-token step)"
        )
    if plot:
        lines.append(f"plot: {plot}")
    return "\n".join(lines)


def _text(tokenizer, tokens: list[int]) -> str:
    """Decoded text, or the ids themselves when the model has no tokenizer."""
    if tokenizer is None:
        return " ".join(map(str, tokens))
    return tokenizer.decode(tokens, skip_special_tokens=False)
