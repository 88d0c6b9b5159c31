"""The commands that have no module of their own: `generate` (with --compare's alternated runs, llama.cpp's row
and the closing output), `calibrate` (the target's cost grid, measured again) and `check` (every verifier's
output law on random trees). The parser (cli.py) names them by their `run` strings, "exitspec.commands:generate",
and imports this module only once the options are valid.
"""

from __future__ import annotations

import json
import statistics
import sys
from contextlib import ExitStack

import torch
from rich.console import Console
from rich.table import Table

from exitspec import app
from exitspec.bench.llamacpp import BUILD_HINT, LlamaServer, built, same_weights
from exitspec.check import check_law, law_case
from exitspec.decode import default_stop_tokens
from exitspec.drafters import default_drafter
from exitspec.models import resolve_device
from exitspec.sampling import SamplingParams
from exitspec.settings import budget_cap, parse_budget
from exitspec.verify import DECIDERS, check_verifier


def generate(args) -> int:
    """`exitspec generate`: the answer streamed (or one JSON object), and with --compare the alternated
    speculative and autoregressive runs (and llama.cpp's) whose tokens per second give the speedup."""
    if args.llamacpp and not args.compare:
        raise ValueError("--llamacpp adds a row to --compare's runs: give --compare too")
    if args.llamacpp and args.model is not None:
        raise ValueError("--llamacpp decodes the default model's GGUF file: drop --model or --llamacpp")
    check_verifier(args.verifier, SamplingParams(args.temperature, args.top_k, args.top_p))
    args.drafter = args.drafter or default_drafter(args.model)
    resolve_device(args.device)
    app.check_budgets([args.budget], args.model, args.device)
    decoder = app.load_decoders(args.model, [args.drafter], args.device, args.dtype, args.threads, args.lookup,
                                budgets=[args.budget], warm_start=not args.no_warm_start,
                                learn=not args.compare)[args.drafter]  # a measurement must not find its own answers
    if args.compare and not args.llamacpp and args.model is None:
        args.llamacpp = _same_weights_in_llamacpp(decoder.target.precision)
    settings = {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "chat": not args.no_chat,
    }
    spec_settings = dict(settings, budget=args.budget, verifier=args.verifier)
    if args.compare:  # one short warm-up of each loop, so that neither pays one-time costs in the timing
        decoder.generate(args.prompt, **dict(spec_settings, max_new_tokens=4))
        decoder.autoregressive(args.prompt, **dict(settings, max_new_tokens=4))
    stream = None if args.json else lambda text: print(text, end="", flush=True)
    result = decoder.generate(args.prompt, stream=stream, **spec_settings)
    speedups, baseline, llama_tokens, llama_version = [], None, None, None
    llama_row = f"llama.cpp {args.llamacpp}"
    per_run = {"speculative": [], "autoregressive": [], **({llama_row: []} if args.llamacpp else {})}  # tok/s
    with ExitStack() as server_up:
        if args.llamacpp:
            request = _llamacpp_request(args, decoder.target)
            llama = server_up.enter_context(_llamacpp_server(args, result.prompt_ids, request))
            llama_version = llama.version
        # after the warm-ups the runs alternate S A[ L] S A[ L] ... (the streamed answer is the first S), so that
        # a drift in the machine's load hits every way alike
        for i in range(args.repeats if args.compare else 0):
            spec = result if i == 0 else decoder.generate(args.prompt, **spec_settings)
            if not args.json:
                print(f"\n[compare {i + 1}/{args.repeats}: autoregressive run ...]", end="", file=sys.stderr,
                      flush=True)
            baseline = decoder.autoregressive(args.prompt, **settings)
            speedups.append(spec.tokens_per_second / baseline.tokens_per_second)  # per token: lengths may differ
            per_run["speculative"].append(spec.tokens_per_second)
            per_run["autoregressive"].append(baseline.tokens_per_second)
            if args.llamacpp:
                run = llama.complete(result.prompt_ids, **request)
                per_run[llama_row].append(len(run.tokens) / run.seconds)
                llama_tokens = run.tokens if llama_tokens is None else llama_tokens
    memory = decoder.drafter.memory() if args.compare else None  # as read from the cache: --compare learns nothing
    held = {"answers": len(memory.answers), "holds_this_answer": memory.holds(result.tokens)} if memory else None
    _print_generate(args, result, spec_settings, baseline, speedups, per_run, llama_version, llama_tokens, held)
    return 0


def _print_generate(args, result, spec_settings, baseline, speedups, per_run, llama_version, llama_tokens,
                    memory: dict | None) -> None:
    """generate's closing output: one JSON object (--json), or the statistics line and, with llama.cpp, the per-run
    table, on stderr. `memory`: how many answers the suffix memory held, and whether one began as this one does
    (a measurement then times a repeated request, not a new one)."""
    if args.json:
        out = _generate_json(args, result, spec_settings, baseline, speedups, per_run) | {"memory": memory}
        if args.llamacpp:
            out["llamacpp"] = {"variant": args.llamacpp, "version": llama_version, "token_ids": llama_tokens,
                               "first_difference": first_difference(baseline.tokens, llama_tokens),
                               "tokens_per_second": per_run}
        print(json.dumps(out))
    else:
        print(_generate_line(args, result, baseline, speedups, memory), file=sys.stderr)
        if args.llamacpp:
            print(_per_run_table(per_run, llama_version, first_difference(baseline.tokens, llama_tokens)),
                  file=sys.stderr)


def _same_weights_in_llamacpp(precision: str) -> str | None:
    """--compare's llama.cpp row by default: the llama.cpp file of the target's own weights where it is built; else
    None, after a line on stderr with the command that builds it."""
    variant = same_weights(precision)
    if variant is not None and built(variant):
        return variant
    if variant is not None:
        print(f"[llama.cpp on the same weights: {BUILD_HINT}, then this command again]", file=sys.stderr)
    return None


def _llamacpp_request(args, target) -> dict:
    """`generate --llamacpp`'s settings of each llama-server request: generate's own, and the target's stop ids."""
    return {"stop_tokens": default_stop_tokens(target), "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}


def _llamacpp_server(args, prompt_ids: list[int], request: dict):
    """`generate --llamacpp`'s llama-server, with torch's thread count, warmed by one short request."""
    server = LlamaServer(args.llamacpp, torch.get_num_threads())
    try:
        server.complete(prompt_ids, **dict(request, max_new_tokens=4))
    except BaseException:
        server.close()
        raise
    return server


def _per_run_table(per_run: dict[str, list[float]], version: str, differs: int | None) -> str:
    """`generate --compare --llamacpp`'s rows: tokens per second of each run and their median, one row per way."""
    runs = len(next(iter(per_run.values())))
    lines = [f"{'tok/s':<24}" + "".join(f"{f'run {i + 1}':>9}" for i in range(runs)) + f"{'median':>9}"]
    for name, values in per_run.items():
        lines.append(f"{name:<24}" + "".join(f"{v:9.1f}" for v in values) + f"{statistics.median(values):9.1f}")
    same = "the same tokens" if differs is None else f"differs from token {differs}"
    return "\n".join([*lines, f"llama.cpp: {version}; against the autoregressive output: {same}"])


def _generate_json(args, result, settings: dict, baseline, speedups: list[float], per_run: dict) -> dict:
    """`generate --json`'s one object: the answer, its statistics, and with --compare the last autoregressive run's,
    each pair's speedup (the ratio of its tokens per second) and each run's tokens per second."""
    out = {
        "prompt": args.prompt,
        "prompt_ids": result.prompt_ids,
        "token_ids": result.tokens,
        "text": result.text,
        "settings": dict(settings, model=args.model, drafter=args.drafter, lookup=args.lookup, device=args.device),
        "stats": result.summary(),
    }
    if baseline:
        out["autoregressive"] = baseline.summary()
        out["speedup"] = statistics.median(speedups)
        out["speedups"] = speedups
        out["tokens_per_second"] = per_run  # speculative, autoregressive and, where run, llama.cpp's row
        out["identical_to_autoregressive"] = baseline.tokens == result.tokens
        out["first_difference"] = first_difference(baseline.tokens, result.tokens)
    return out


def _generate_line(args, result, baseline, speedups: list[float], memory: dict | None) -> str:
    """`generate`'s closing line on stderr: τ, speed, rounds, C_p, with --compare the speedup, and whether the
    suffix memory already held this answer."""
    mean_n = sum(r.tree_size for r in result.rounds) / max(len(result.rounds), 1)
    line = (
        f"\n\n[τ {result.tau:.2f} · {result.tokens_per_second:.1f} tok/s · {len(result.tokens)} tokens in "
        f"{len(result.rounds)} rounds · mean C_p {result.mean_coverage:.2f} · {args.verifier}, B={args.budget} "
        f"(mean N {mean_n:.1f})"
    )
    differs = first_difference(baseline.tokens, result.tokens) if baseline else None
    if differs is not None:
        line += f" · differs from autoregressive output from token {differs}"
    if baseline:
        line += (f" · speedup {statistics.median(speedups):.2f}× in tok/s over autoregressive (median of "
                 f"{len(speedups)} alternated pairs, range {min(speedups):.2f}–{max(speedups):.2f}; "
                 f"{baseline.tokens_per_second:.1f} tok/s)")
    if memory and memory["holds_this_answer"]:
        line += " · the suffix memory held this answer already (--no-warm-start measures a new request)"
    return line + "]"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one extends the other), None
    where they are equal: at T = 0 in fp32 always None; in bf16 where batch-shape rounding first flips a token."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def calibrate(args) -> int:
    """Measures the target stage's cost against N afresh (budget.CostModel), caches it when the machine was
    quiet, and prints the grid, the row plan and how it was measured."""
    decoder = app.load_decoders(args.model, ["ngram"], args.device, args.dtype, args.threads, budgets=())["ngram"]
    cost = decoder.calibrate(budget_cap(parse_budget(args.budget)), refresh=True)
    step = cost.effective[0]  # a one-token step as the decoder runs it: by the row plan
    print(f"one step: {1000 * step:.1f} ms as planned ({1000 * cost.seconds[0]:.1f} ms unplanned); measured "
          f"{cost.info['measured_at']}, other processes used "
          f"{cost.info['other_load']:.0%} of the CPUs, repeats within {cost.info['spread']:.0%}; "
          + ("cached" if cost.trustworthy() is None else f"not cached: {cost.trustworthy()}"))
    print("N      " + " ".join(f"{n:>5}" for n in cost.sizes))
    print("× step " + " ".join(f"{s / step:5.2f}" for s in cost.effective))
    print(f"row plan (rows: rows run on, layout): {decoder.target.forward_config()['row_plan']}")
    return 0


def check(args) -> int:
    """`exitspec check`: every verifier's (exit node, bonus) law against w(v)·p_res_v(y) on random trees, a table
    row each; exit code 1 where one fails."""
    table = Table(title=f"Verifier law check: (exit node, bonus) ~ w(v)·p_res_v(y), {args.draws} draws per row")
    for col in ("verifier", "sampling", "tree", "nodes", "depth", "G-test p", "E[L]", "1 + C_p", "±3 s.e.", "ok"):
        table.add_column(col, justify="right")
    all_passed = True
    settings = [SamplingParams(1.0), SamplingParams(1.0, top_p=0.9), SamplingParams(0.0)]
    for params in settings:
        for t in range(args.trees):
            tree, probs = law_case(args.seed + t, params, vocab=args.vocab)
            for name in DECIDERS:
                if name == "greedy" and not params.greedy:
                    continue
                r = check_law(name, DECIDERS[name], tree, probs, params, args.draws, seed=args.seed + 1000 + t)
                all_passed &= r.passed
                sampling = "greedy" if params.greedy else f"T={params.temperature:g}, top-p {params.top_p:g}"
                table.add_row(
                    name, sampling, str(t), str(r.nodes), str(r.depth), f"{r.p_value:.3f}", f"{r.mean_length:.3f}",
                    f"{r.expected_length:.3f}", f"{3 * r.std_err:.3f}", "✓" if r.passed else "✗",
                )
    console = Console()
    if not console.is_terminal:
        console.width = 120
    console.print(table)
    return 0 if all_passed else 1
