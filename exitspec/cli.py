"""Command line: `exitspec generate | check | inspect | bench | train`.

    exitspec generate "Why is the sky blue?"                 # default model, greedy, streamed
    exitspec generate "..." --temperature 1 --compare        # plus speedup over autoregressive decoding
    exitspec generate "..." --json                           # one JSON object for scripts
    exitspec check                                           # verifier-law check on random trees
    exitspec inspect "..." --rounds 8                        # where the target's mass leaves the trees (+ PNG)
    exitspec bench --preset table1 --num-prompts 20          # τ and SR per dataset, report + plots
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from exitspec.budget import parse_budget
from exitspec.drafters import DRAFTER_HELP
from exitspec.verify import DECIDERS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["inspect"]:  # their own parsers, so that `exitspec inspect --help` reaches them
        from exitspec.inspect import main_inspect

        return main_inspect(argv[1:])
    if argv[:1] == ["bench"]:
        from exitspec.bench.cli import main_bench

        return main_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="exitspec", description="Exact tree speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate text with exact tree speculative decoding"))
    _add_check(commands.add_parser("check", help="check every verifier's output law on random trees"))
    commands.add_parser("inspect", help="where the target's mass leaves the draft trees (`exitspec inspect --help`)")
    commands.add_parser("bench", help="τ and speedup on datasets, paper-style tables (`exitspec bench --help`)")
    train = commands.add_parser("train", help="train a drafter (see `exitspec train dflash --help`)")
    train.add_argument("what", choices=["dflash", "exit", "eval"])
    train.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "check":
            return _check(args)
        from exitspec.train.cli import main_dflash, main_eval, main_exit

        return {"dflash": main_dflash, "exit": main_exit, "eval": main_eval}[args.what](args.rest)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"exitspec: error: {err}", file=sys.stderr)
        return 2


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (sent through the chat template)")
    p.add_argument("--model", default=None, help="local HF causal-LM folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--budget", default="auto", metavar="B|auto|auto:B",
                   help="draft tokens per tree: a fixed B, or auto (default; each round the size up to 32, or up to "
                        "B with auto:B, that maximises expected tokens per second)")
    p.add_argument("--verifier", default="tev", choices=sorted(DECIDERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="encode the prompt as plain text, no chat template")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compare", action="store_true", help="also decode autoregressively and report the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")


def _generate(args) -> int:
    from exitspec.decode import SpeculativeDecoder, generate_autoregressive
    from exitspec.drafters import default_drafter

    if args.verifier == "greedy" and args.temperature != 0:
        raise ValueError("the greedy verifier is exact only at temperature 0; use predraw, sequential or tev")
    args.drafter = args.drafter or default_drafter(args.model)
    args.budget = parse_budget(args.budget)
    decoder = SpeculativeDecoder.from_pretrained(args.model, args.drafter, args.device, getattr(torch, args.dtype))
    settings = {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "chat": not args.no_chat,
    }
    spec_settings = dict(settings, budget=args.budget, verifier=args.verifier)
    if args.compare:  # one short warm-up of each loop, so that neither pays one-time costs in the timing
        decoder.generate(args.prompt, **dict(spec_settings, max_new_tokens=4))
        generate_autoregressive(decoder.target, args.prompt, **dict(settings, max_new_tokens=4))
    stream = None if args.json else lambda text: print(text, end="", flush=True)
    result = decoder.generate(args.prompt, stream=stream, **spec_settings)
    baseline = generate_autoregressive(decoder.target, args.prompt, **settings) if args.compare else None
    speedup = baseline.total_seconds / result.total_seconds if baseline else None
    if args.json:
        out = {
            "prompt": args.prompt,
            "prompt_ids": result.prompt_ids,
            "token_ids": result.tokens,
            "text": result.text,
            "settings": dict(spec_settings, model=args.model, drafter=args.drafter, device=args.device),
            "stats": result.summary(),
        }
        if baseline:
            out["autoregressive"] = baseline.summary()
            out["speedup"] = speedup
            out["identical_to_autoregressive"] = baseline.tokens == result.tokens
        print(json.dumps(out))
        return 0
    mean_n = sum(r.tree_size for r in result.rounds) / max(len(result.rounds), 1)
    line = (
        f"\n\n[τ {result.tau:.2f} · {result.tokens_per_second:.1f} tok/s · {len(result.tokens)} tokens in "
        f"{len(result.rounds)} rounds · mean C_p {result.mean_coverage:.2f} · {args.verifier}, B={args.budget} (mean N {mean_n:.1f})"
    )
    if baseline:
        line += f" · speedup {speedup:.2f}× over autoregressive ({baseline.tokens_per_second:.1f} tok/s)"
    print(line + "]", file=sys.stderr)
    return 0


def _add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draws", type=int, default=20_000, help="verifier runs per tree")
    p.add_argument("--trees", type=int, default=2, help="random trees per sampling setting")
    p.add_argument("--vocab", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)


def _check(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from exitspec.check import check_law, law_case
    from exitspec.sampling import SamplingParams

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


if __name__ == "__main__":
    sys.exit(main())
