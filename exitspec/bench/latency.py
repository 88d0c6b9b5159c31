"""Latency of the verifier decision alone: predraw vs TEV (plus sequential and greedy) on the same trees.

    exitspec latency [--budgets 16 32 64 128] [--temperatures 1.0 0.6] [--top-p 1.0]
        [--prompts 4] [--depth 16] [--repeats 50] [--drafter dflash|oracle|PATH] [--device cpu|cuda]
        [--threads N] [--synthetic] [--json PATH]

Realised trees. For each built-in chat prompt the target (fp32) is prefilled and the drafter gives its
per-depth log-marginals for the tokens after the prompt: the DFlash drafter (`--drafter dflash`, the one
shipped for the default model and its default there, or a checkpoint folder) from one block forward, or,
with `--drafter oracle` (the default for other models), the target's own log-probabilities d-1 steps ahead
along its greedy continuation of `depth` steps, whose trees agree with the target more often than a real
drafter's. DDTree (`build_ddtree`, budget B) turns them into the tree the decode loop would verify, and one
`forward_tree` gives the real logits [N+1, V] of each tree. `--synthetic` skips the model: random trees and
peaked random logits of the same shapes.

Timing. Per (tree, logits) pair and temperature, probs = target_probs(logits) is computed once; then the
warp itself and every verifier are timed `repeats` times after `warmup` calls, round-robin with a rotating
order so drift and cache effects hit all of them alike, synchronising the device around every call. Each
call gets a fresh DraftTree view of the same tensors: as in the decode loop, whatever tree structure a
verifier needs (the ancestor matrix, the child lists) is computed inside its decision. Reported: medians
over all repeats and pairs, speedup = predraw / TEV, and the whole verify stage: warp + decision per call
for predraw; for TEV the decode loop's stage, which reads only the rows it needs (WarpedRows: one logsumexp
per parent row for the edge probabilities, then the exit node's row for its residual draw), with the full
warp + TEV decision beside it.
On a CPU shared with other work, multi-threaded kernels wait on descheduled threads; `--threads 1` then
measures the code rather than the scheduler.

Fairness. Predraw is exitspec's `decide_predraw`: all N+1 draws in one batched inverse-CDF pass
(`sample_rows`, several times faster than torch.multinomial on CPU), then one vectorised ancestor test to
find the accepted path; no Python loop over nodes. Sequential is the EAGLE-style loop over accepted nodes;
greedy runs on the temperature-0 (one-hot) probabilities of the same logits.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

from exitspec.app import load_decoders
from exitspec.bench import forward, rounds, suffix
from exitspec.bench.report import verifier_markdown
from exitspec.build import build_ddtree
from exitspec.decode import encode_prompt
from exitspec.drafters import DFlashDrafter
from exitspec.flow import check_probs, tree_flow
from exitspec.models import resolve_device
from exitspec.sampling import SamplingParams, WarpedRows, target_probs
from exitspec.settings import MAX_BUDGET, parse_budget
from exitspec.target import TargetModel
from exitspec.timing import timings
from exitspec.tree import DraftTree
from exitspec.verify import DECIDERS, decide_tev

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for learning a new programming language.",
    "Write a Python function that reverses a string.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How do I make a cup of green tea?",
    "List the planets of the solar system in order from the Sun.",
)
VERIFIERS = ("predraw", "tev", "sequential", "greedy")  # greedy decides on the temperature-0 probabilities
Pair = tuple[DraftTree, Tensor]  # a tree and its target logits [N+1, V]


def oracle_log_marginals(target: TargetModel, prompt_ids: list[int], depth: int) -> Tensor:
    """[H, V] target log-probs along its own greedy continuation: row d-1 scores the token at depth d."""
    target.reset()
    target.prefill(torch.tensor(prompt_ids[:-1], device=target.device))
    token, rows = prompt_ids[-1], []
    for _ in range(depth):
        logits = target.forward_tokens(torch.tensor([token], device=target.device)).logits[-1]  # [V]
        rows.append(torch.log_softmax(logits, dim=-1))
        token = int(logits.argmax())
    return torch.stack(rows)


def drafter_log_marginals(target: TargetModel, drafter: DFlashDrafter, prompt_ids: list[int], depth: int) -> Tensor:
    """[H, V] the DFlash drafter's log-marginals for the tokens after the prompt, H = min(block size − 1, depth)."""
    target.reset()
    ids = torch.tensor(prompt_ids, device=target.device)
    drafter.begin(ids, target.prefill(ids[:-1]))
    return torch.log_softmax(drafter.marginals(ids, depth), dim=-1)


def realised_pairs(
    target: TargetModel, budgets: list[int], n_prompts: int, depth: int, drafter: DFlashDrafter | None = None
) -> dict[int, list[Pair]]:
    """Per budget, one DDTree per prompt from the drafter's marginals (None: the oracle's), with the target's
    logits over it."""
    pairs: dict[int, list[Pair]] = defaultdict(list)
    for prompt in PROMPTS[:n_prompts]:
        prompt_ids = encode_prompt(target.tokenizer, prompt)
        if drafter is None:
            log_marginals = oracle_log_marginals(target, prompt_ids, depth)  # [H, V]
        else:
            log_marginals = drafter_log_marginals(target, drafter, prompt_ids, depth)  # [H, V]
        for budget in budgets:
            target.reset()
            target.prefill(torch.tensor(prompt_ids[:-1], device=target.device))
            tree = build_ddtree(log_marginals, prompt_ids[-1], budget)
            pairs[budget].append((tree, target.forward_tree(tree).logits))  # logits [N+1, V]
            target.commit(tree, [])
    return pairs


def synthetic_pairs(
    budgets: list[int], n_pairs: int, depth: int, vocab: int, device: torch.device, seed: int
) -> dict[int, list[Pair]]:
    """Random pairs of the realised shapes, no model.

    The drafter's marginals put ~80% of each depth's mass on one random token (a deep spine with side
    branches); the target logits are standard normal with every child token lifted by log V, so each child
    holds about as much of its parent's mass as all the other tokens together.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    pairs: dict[int, list[Pair]] = defaultdict(list)
    for budget in budgets:
        for _ in range(n_pairs):
            log_marginals = torch.randn(depth, vocab, generator=gen, device=device)  # [H, V]
            spine = torch.randint(vocab, (depth,), generator=gen, device=device)  # [H]
            log_marginals[torch.arange(depth, device=device), spine] += math.log(vocab) + 2.0
            tree = build_ddtree(log_marginals, 0, budget)
            logits = torch.randn(tree.size, vocab, generator=gen, device=device)  # [N+1, V]
            logits[tree.parents[1:], tree.tokens[1:]] += math.log(vocab)
            pairs[budget].append((tree, logits))
    return pairs


def time_pair(
    tree: DraftTree, logits: Tensor, params: SamplingParams, repeats: int, warmup: int, gen: torch.Generator
) -> dict[str, list[float]]:
    """Seconds per call of the warp ("warp") and of every verifier on one pair, `repeats` samples each."""
    probs = target_probs(logits, params)  # [N+1, V], shared by the stochastic verifiers
    greedy_probs = target_probs(logits, SamplingParams(temperature=0.0))  # [N+1, V] one-hot
    calls = {"warp": lambda t: target_probs(logits, params), "check": lambda t: check_probs(t, probs),
             "tev_rows": lambda t: _tev_stage(t, logits, params, gen)}
    for name in VERIFIERS:
        rows = WarpedRows.of_probs(greedy_probs if name == "greedy" else probs)  # already warped
        calls[name] = lambda t, decide=DECIDERS[name], r=rows: decide(t, r, gen).read(t, r, gen)
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no call always follows another
            fresh = DraftTree(tree.parents, tree.tokens, tree.depths, host=tree.host)  # empty structure caches
            (seconds,) = timings(lambda call=calls[name], t=fresh: call(t), 1, logits.device)
            if r >= warmup:
                samples[name].append(seconds)
    return samples


def _tev_stage(tree: DraftTree, logits: Tensor, params: SamplingParams, gen: torch.Generator):
    """The decode loop's whole TEV verify stage: the parents' rows and the exit node's row warped, then decided."""
    rows = WarpedRows(logits, params, check=False)  # the loop screens logits in its one read
    return decide_tev(tree, rows, gen).read(tree, rows, gen)


def run_bench(
    pairs: dict[int, list[Pair]], temperatures: list[float], top_p: float, repeats: int, warmup: int, seed: int
) -> list[dict]:
    """One row per (budget, temperature): medians in ms over all repeats and pairs, and the speedups."""
    rows = []
    for budget, budget_pairs in pairs.items():
        gen = torch.Generator(device=budget_pairs[0][1].device).manual_seed(seed)
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature, top_p=top_p)
            pooled: dict[str, list[float]] = defaultdict(list)
            coverage = []
            for tree, logits in budget_pairs:
                for name, seconds in time_pair(tree, logits, params, repeats, warmup, gen).items():
                    pooled[name] += seconds
                # E[accepted]
                coverage.append(float(tree_flow(tree, target_probs(logits, params), check=False).coverage))
            med = {name: 1e3 * statistics.median(s) for name, s in pooled.items()}
            stage = {  # warp + decision of the same repeat; "tev": the decode loop's TEV stage, which warps lazily
                name: 1e3 * statistics.median(w + d for w, d in zip(pooled["warp"], pooled[full]))
                for name, full in (("predraw", "predraw"), ("tev_full_warp", "tev"))
            } | {"tev": med["tev_rows"]}
            rows.append(
                {
                    "budget": budget,
                    "nodes": statistics.mean(tree.num_nodes for tree, _ in budget_pairs),
                    "temperature": temperature,
                    "top_p": top_p,
                    "coverage": statistics.mean(coverage),
                    "median_ms": med,
                    "speedup": med["predraw"] / med["tev"],
                    "stage_median_ms": stage,
                    "stage_speedup": stage["predraw"] / stage["tev"],
                }
            )
    return rows


def print_tables(result: dict, console: Console) -> None:
    """The decision table and the verify-stage table of main's result."""
    load = result["load_average"]
    console.print(
        f"[bold]verifier latency[/bold]: {result['mode']}, device {result['device']}, {result['threads']} threads, "
        f"V={result['vocab']}, depth {result['depth']}, {result['pairs_per_budget']} pairs x {result['repeats']} "
        f"repeats, top-p {result['top_p']}" + (f", load average {load[0]:.2f}" if load else "")
    )
    decision = Table(
        title="Verifier decision alone: median ms (speedup = predraw / TEV)",
        caption="N: mean nodes, C_p: mean coverage (expected accepted), seq: sequential",
    )
    for col in ("B", "N", "T", "C_p", "predraw", "TEV", "speedup", "seq", "greedy@T0"):
        decision.add_column(col, justify="right")
    stage = Table(
        title="Verify stage = warp (target_probs) + decision: median ms; TEV reads only the rows it needs",
        caption="check_probs: the input check of the public tree_flow/verify, which the decode loop skips",
    )
    for col in ("B", "T", "warp", "warp+predraw", "TEV stage", "speedup", "full warp+TEV", "check_probs"):
        stage.add_column(col, justify="right")
    for row in result["rows"]:
        m, s = row["median_ms"], row["stage_median_ms"]
        b, t = str(row["budget"]), f"{row['temperature']:g}"
        predraw, tev, seq, greedy = (f"{m[name]:.3f}" for name in VERIFIERS)
        shape = (b, f"{row['nodes']:.0f}", t, f"{row['coverage']:.2f}")
        decision.add_row(*shape, predraw, tev, f"{row['speedup']:.2f}x", seq, greedy)
        stage.add_row(
            b, t, f"{m['warp']:.3f}", f"{s['predraw']:.3f}", f"{s['tev']:.3f}", f"{row['stage_speedup']:.2f}x",
            f"{s['tev_full_warp']:.3f}", f"{m['check']:.3f}",
        )
    console.print(decision)
    console.print(stage)


def run(args) -> int:
    """`exitspec latency`: measures, prints the tables and with --out writes the results (JSON; the verifier
    stage's also as Markdown, OUT with .md)."""
    if args.stage == "round":
        result = rounds.measure(PROMPTS[: args.prompts], args.model, args.drafter, args.device, args.dtype,
                                args.threads, [parse_budget(b) for b in args.round_budgets],
                                args.temperatures or [0.0, 1.0])
        rounds.print_table(result, Console(width=160))
        return _write_json(result, args.out)
    if args.stage == "suffix":
        result = suffix.measure(args.model, args.sizes or suffix.SIZES)
        suffix.print_table(result, Console())
        return _write_json(result, args.out)
    sizes = args.sizes or forward.SIZES
    if max(sizes) > MAX_BUDGET:
        raise ValueError(f"--sizes: a tree holds at most {MAX_BUDGET} draft tokens, got {max(sizes)}")
    if args.stage == "profile":
        result = forward.profile(args.model, args.device, args.dtype, args.threads, sizes, args.context,
                                 args.repeats)
        forward.print_profile(result, Console())
    elif args.stage == "forward":
        result = forward.measure(args.model, args.device, args.dtype, args.threads, sizes, args.context,
                                 args.repeats, args.llamacpp)
        forward.print_table(result, Console())
    else:
        result = measure(
            args.model, args.drafter, args.device, args.dtype, args.threads, args.budgets,
            args.temperatures or [1.0, 0.6],
            args.top_p, args.prompts, args.depth, args.repeats, args.warmup, args.synthetic, args.vocab, args.seed,
        )
        print_tables(result, Console())
        if args.out:  # the paper's Table 3 as Markdown beside the JSON
            Path(args.out).with_suffix(".md").write_text(verifier_markdown(result))
    return _write_json(result, args.out)


def _write_json(result: dict, path: str | None) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def measure(
    model: str | None = None, drafter: str | None = None, device: str | None = None, dtype: str = "auto",
    threads: int | None = None, budgets=(16, 32, 64, 128), temperatures=(1.0, 0.6), top_p: float = 1.0,
    prompts: int = 4, depth: int = 16, repeats: int = 50, warmup: int = 5, synthetic: bool = False,
    vocab: int = 49152, seed: int = 0,
) -> dict:
    """The benchmark's result: settings and one row per (budget, temperature), see run_bench."""
    budgets, temperatures = list(budgets), list(temperatures)
    if synthetic:
        dev = resolve_device(device)
        if threads:
            torch.set_num_threads(threads)
        pairs = synthetic_pairs(budgets, prompts, depth, vocab, dev, seed)
        mode = "synthetic"
    else:
        spec = drafter or ("oracle" if model else "dflash")
        decoder = load_decoders(model, ["ngram" if spec == "oracle" else spec], device, dtype, threads, budgets=())
        target, draft = next(iter(decoder.values())).target, next(iter(decoder.values())).drafter
        if spec != "oracle" and not isinstance(draft, DFlashDrafter):
            raise ValueError(f"drafter {spec!r} gives no marginals: use 'oracle', a shipped drafter or a checkpoint "
                             "folder")
        pairs = realised_pairs(target, budgets, prompts, depth, None if spec == "oracle" else draft)
        vocab, dev = target.vocab_size, target.device
        mode = f"{spec}-drafter trees on {model or 'SmolLM2-135M-Instruct'}"
        del decoder, target, draft  # the timing touches only the (tree, logits) pairs
    return {
        "mode": mode,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "vocab": vocab,
        "depth": depth,
        "pairs_per_budget": prompts,
        "repeats": repeats,
        "warmup": warmup,
        "top_p": top_p,
        "budgets": budgets,
        "temperatures": temperatures,
        "rows": run_bench(pairs, temperatures, top_p, repeats, warmup, seed),
    }

