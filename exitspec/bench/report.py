"""Reports of benchmark results: paper-style Markdown and JSON tables, PNG plots, and A/B comparisons.

    write_report("runs/bench/table1/results.jsonl")        # report.md, report.json and three PNGs beside it
    write_comparison(a_jsonl, b_jsonl, "runs/bench/compare")   # compare.md, compare.json

A cell is one (dataset, temperature, drafter, budget, verifier). It pools its rows: τ is the mean block
length over all its rounds, mean C_p the round-weighted mean coverage, and each SR the ratio of total
seconds per generated token, baseline over speculative (runner.speedup on the summed seconds and tokens).
The main table has the shape of the paper's Table 1: rows dataset x temperature plus a mean row per
temperature (the plain mean over datasets), and per config the columns τ, SR (over exitspec's autoregressive
loop on the same backend) and SR_HF (over transformers' model.generate).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from exitspec.bench.rows import LOOP_SPAN, BaselineRow, EnvRow, PeerRow, SpecRow, loops
from exitspec.bench.runner import ResultsFile, speedup
from exitspec.decode import STAGES
from exitspec.drafters.chain import drafter_label
from exitspec.paired import paired_cell, paired_difference
from exitspec.settings import DRAFT_MODEL_PREFIXES, budget_cap

CELL = ("dataset", "temperature", "drafter", "budget", "verifier")
CONFIG = ("drafter", "budget", "verifier")
SETTING = ("temperature", "budget", "verifier")  # a column of the by-drafter tables
PLOTS = ("tau_sr_vs_budget.png", "stages.png", "accepted_lengths.png")
SIZE_BANDS = (("0", (0, 0)), ("1", (1, 1)), ("2", (2, 2)), ("3–4", (3, 4)), ("5–8", (5, 8)), ("9–16", (9, 16)),
              ("17–32", (17, 32)), ("> 32", (33, 1 << 30)))  # the tree-size table's columns


def _budget_order(budget: int | str) -> tuple[int, bool]:
    """Budgets by value, auto:B right after B."""
    return budget_cap(budget), isinstance(budget, str)


def _setting_order(setting: tuple) -> tuple:
    """(temperature, budget, verifier) columns by temperature, then budget, then verifier name."""
    temperature, budget, verifier = setting
    return temperature, _budget_order(budget), verifier


def summarize(rows: list[BaselineRow | SpecRow]) -> list[dict]:
    """One aggregate per cell of the spec rows, ordered by dataset, temperature, drafter, budget and verifier
    (datasets, drafters and verifiers in the order they first appear, so re-measured rows keep their place)."""
    groups: dict[tuple, list[SpecRow]] = defaultdict(list)
    for row in rows:
        if isinstance(row, SpecRow):
            groups[tuple(getattr(row, f) for f in CELL)].append(row)
    looping = looping_prompts(rows)
    rank = [{v: i for i, v in enumerate(dict.fromkeys(key[j] for key in groups))} for j in range(len(CELL))]
    # temperature and budget sort by value (auto:B right after B), the others by first appearance
    value = {"temperature": lambda t: t, "budget": _budget_order}
    order = sorted(groups, key=lambda key: tuple(
        value[f](v) if f in value else rank[j][v] for j, (f, v) in enumerate(zip(CELL, key))
    ))
    return [{**dict(zip(CELL, key)), **aggregate(groups[key]), **_without(groups[key], looping)} for key in order]


def looping_prompts(rows: list) -> set[tuple]:
    """The prompts (`_prompt`) of which an answer, autoregressive or speculative, ends in a repetition loop
    (rows.loops, against the conversation's earlier autoregressive answers too): every table's means are also
    given without them."""
    conversations = defaultdict(list)  # (dataset, temperature, prompt id, repeat) -> [(turn, AR answer)]
    for r in rows:
        if isinstance(r, BaselineRow):
            conversations[r.dataset, r.temperature, r.prompt_id, r.repeat].append((r.turn, r.ar.tokens))

    def earlier(r) -> list[list[int]]:
        conversation = conversations[r.dataset, r.temperature, r.prompt_id, r.repeat]
        return [a for turn, a in conversation if turn < r.turn]

    answer = {BaselineRow: lambda r: r.ar.tokens, SpecRow: lambda r: r.tokens}
    return {_prompt(r) for r in rows if type(r) in answer and loops(answer[type(r)](r), earlier(r))}


def _without(rows: list[SpecRow], looping: set[tuple]) -> dict:
    """A cell's `looped` rows and its τ, SR and tok/s without them (None when every row loops)."""
    kept = [r for r in rows if _prompt(r) not in looping]
    pooled = aggregate(kept) if kept else None
    return {"looped": len(rows) - len(kept),
            "without_loops": pooled and {k: pooled[k] for k in ("tau", "sr_ar", "sr_hf", "tokens_per_second")}}


def aggregate(rows: list[SpecRow]) -> dict:
    """Pooled statistics of spec rows of one cell (see the module docstring)."""
    rounds = sum(r.rounds for r in rows)
    accepted = Counter(a for r in rows for a in r.accepted_lengths)
    sizes = Counter(n for r in rows for n in r.tree_sizes)  # empty for rows from before `--budget auto`
    seconds = {k: sum(getattr(r, f) for r in rows)
               for k, f in (("spec", "total_seconds"), ("ar", "ar_seconds"), ("hf", "hf_seconds"))}
    tokens = {k: sum(getattr(r, f) for r in rows)
              for k, f in (("spec", "new_tokens"), ("ar", "ar_tokens"), ("hf", "hf_tokens"))}
    greedy = rows[0].temperature == 0
    return {
        "rows": len(rows),
        "prompts": len({(r.prompt_id, r.turn) for r in rows}),
        "new_tokens": tokens["spec"],
        "rounds": rounds,
        "tau": (sum(a * n for a, n in accepted.items()) + rounds) / max(rounds, 1),
        "mean_coverage": sum(r.mean_coverage * r.rounds for r in rows) / max(rounds, 1),
        "tokens_per_second": _rate(tokens["spec"], seconds["spec"]),
        "ar_tokens_per_second": _rate(tokens["ar"], seconds["ar"]),
        "hf_tokens_per_second": _rate(tokens["hf"], seconds["hf"]),
        "sr_ar": speedup(seconds["ar"], tokens["ar"], seconds["spec"], tokens["spec"]),
        "sr_hf": speedup(seconds["hf"], tokens["hf"], seconds["spec"], tokens["spec"]),
        "sr_ar_quartiles": _quartiles([speedup(r.ar_seconds, r.ar_tokens, r.total_seconds, r.new_tokens)
                                       for r in rows]),  # per-row SR, each against its adjacent baseline
        "seconds": seconds,
        "stage_seconds": {s: sum(r.stage_seconds[s] for r in rows) for s in STAGES},
        "prefill_seconds": sum(r.prefill_seconds for r in rows),
        "accepted_histogram": [accepted.get(a, 0) for a in range(max(accepted, default=0) + 1)],
        "tree_size_histogram": [sizes.get(n, 0) for n in range(max(sizes, default=-1) + 1)],  # rounds per N
        "matches_ar": statistics.mean(r.matches_ar for r in rows) if greedy else None,  # exactness at T=0
    }


def config_labels(cells: list[dict]) -> dict[tuple, str]:
    """A short label per config, naming only the fields that vary between the configs (the verifier at least)."""
    configs = list(dict.fromkeys(tuple(c[f] for f in CONFIG) for c in cells))
    varying = [i for i in range(3) if len({c[i] for c in configs}) > 1] or [2]
    names = ({c[0]: drafter_label(c[0]) for c in configs}, {c[1]: f"B{c[1]}" for c in configs}, {})
    return {c: " · ".join(names[i].get(c[i], c[i]) for i in varying) for c in configs}


def main_table(cells: list[dict]) -> dict:
    """The Table-1 shape: {"columns": config labels, "rows": [{dataset, temperature, values: {label: ...}}]}."""
    labels = config_labels(cells)
    by_row: dict[tuple, dict] = defaultdict(dict)
    for c in cells:
        by_row[(c["temperature"], c["dataset"])][labels[tuple(c[f] for f in CONFIG)]] = {
            **{k: c.get(k) for k in ("tau", "sr_ar", "sr_hf", "sr_ar_quartiles", "rows", "looped")},
            "sr_ar_without_loops": (c.get("without_loops") or {}).get("sr_ar"),
        }
    rows = []
    for temperature in sorted({t for t, _ in by_row}):
        block = [{"dataset": d, "temperature": t, "values": v} for (t, d), v in by_row.items() if t == temperature]
        mean = {}
        for label in labels.values():
            present = [r["values"][label] for r in block if label in r["values"]]
            mean[label] = {k: _mean([p[k] for p in present]) for k in ("tau", "sr_ar", "sr_hf", "sr_ar_without_loops")}
            mean[label] |= {k: sum(p[k] or 0 for p in present) for k in ("rows", "looped")}
        rows += block + [{"dataset": "mean", "temperature": temperature, "values": mean}]
    return {"columns": list(labels.values()), "rows": rows}


def drafter_table(cells: list[dict]) -> dict:
    """The crossed shape (table 4, ExitTrain against its controls): a row per drafter, a column per (temperature,
    budget, verifier), each value the mean over datasets of the cells' τ, SR and SR_HF.

    {"columns": [{"temperature", "budget", "verifier"}], "rows": [{"drafter", "values": [{tau, sr_ar, sr_hf}]}]}"""
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        by_key[(c["drafter"], c["temperature"], c["budget"], c["verifier"])].append(c)
    columns = sorted({k[1:] for k in by_key}, key=_setting_order)
    rows = []
    for drafter in dict.fromkeys(c["drafter"] for c in cells):
        values = []
        for column in columns:
            group = by_key.get((drafter, *column), [])
            values.append({k: _mean([c[k] for c in group]) for k in ("tau", "sr_ar", "sr_hf")} if group else None)
        rows.append({"drafter": drafter, "values": values})
    return {"columns": [dict(zip(SETTING, c)) for c in columns], "rows": rows}


def paired_tau(rows: list[BaselineRow | SpecRow]) -> dict:
    """The last drafter listed (the candidate) against each other one, paired by prompt: per (temperature,
    budget, verifier), τ_candidate − τ_other over prompts (paired.py: mean, standard error, 95% interval).
    Pairing removes the spread between prompts that the per-cell means of drafter_table carry.

    {"candidate", "columns": [{"temperature", "budget", "verifier"}], "rows": [{"drafter", "values":
    [paired_difference or None]}]}"""
    tau: dict[tuple, dict[tuple, float]] = defaultdict(dict)  # (drafter, T, B, verifier) -> {prompt: τ}
    for r in rows:
        if isinstance(r, SpecRow):
            prompt = (r.dataset, r.prompt_id, r.turn, r.repeat, r.seed)
            tau[(r.drafter, r.temperature, r.budget, r.verifier)][prompt] = r.tau
    drafters = list(dict.fromkeys(key[0] for key in tau))
    columns = sorted({key[1:] for key in tau}, key=_setting_order)
    table = {"candidate": drafters[-1] if drafters else None, "rows": [],
             "columns": [dict(zip(SETTING, c)) for c in columns]}
    for other in drafters[:-1]:
        values = []
        for column in columns:
            mine, theirs = tau.get((drafters[-1], *column), {}), tau.get((other, *column), {})
            values.append(paired_difference(mine, theirs))
        table["rows"].append({"drafter": other, "values": values})
    return table


def paired_tau_markdown(table: dict) -> list[str]:
    """paired_tau's Markdown lines: cells "mean ± standard error [95% interval]"."""
    header = ["minus"] + _setting_labels(table)
    body = [[drafter_label(r["drafter"])] + [paired_cell(v) for v in r["values"]] for r in table["rows"]]
    return _markdown_table(header, body)


def drafter_table_markdown(table: dict) -> list[str]:
    """drafter_table's Markdown lines: cells "τ / SR"."""
    header = ["drafter"] + _setting_labels(table)
    body = [[drafter_label(r["drafter"])] + [f"{_num(v and v['tau'])} / {_num(v and v['sr_ar'], '×')}"
                                             for v in r["values"]] for r in table["rows"]]
    return _markdown_table(header, body)


def peer_table(rows: list) -> dict | None:
    """Tokens per second (pooled: all tokens over all seconds) per dataset and temperature of exitspec's
    autoregressive loop, each speculative config, transformers' generate and each peer (bench/peers.py), on the
    prompts that the peers ran (the same prompts and turns for every column); None without peer rows.
    `ratio`: the best exitspec config over the fastest other way; `ratio_without_loops`: the same without the
    `looped` prompts (looping_prompts)."""
    peered = {_prompt(r) for r in rows if isinstance(r, PeerRow)}
    if not peered:
        return None
    looping = looping_prompts(rows) & peered
    everything, kept = pooled_rates(rows, peered), pooled_rates(rows, peered - looping)
    columns = list(dict.fromkeys(name for cell in everything.values() for name in cell))
    body = [{"dataset": dataset, "temperature": temperature,
             "runs": len({p for p in peered if p[:2] == (dataset, temperature)}),
             "looped": len({p for p in looping if p[:2] == (dataset, temperature)}),
             "tokens_per_second": rates, "ratio": _best_over_other(rates),
             "ratio_without_loops": _best_over_other(kept.get((dataset, temperature), {}))}
            for (dataset, temperature), rates in sorted(everything.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    return {"columns": columns, "rows": body}


def pooled_rates(rows: list, prompts: set[tuple], by=lambda r: (r.dataset, r.temperature)
                  ) -> dict[tuple, dict[str, float]]:
    """{by(row), default (dataset, temperature): {run name: tokens per second pooled over `prompts`}}."""
    pooled: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    runs = {BaselineRow: lambda r: [("exitspec AR", r.ar.new_tokens, r.ar.total_seconds),
                                    ("transformers", r.hf.new_tokens, r.hf.total_seconds)],
            SpecRow: lambda r: [(f"exitspec {r.drafter} {r.budget} {r.verifier}", r.new_tokens, r.total_seconds)],
            PeerRow: lambda r: [(r.peer, r.new_tokens, r.total_seconds)]}
    for r in rows:
        if type(r) in runs and _prompt(r) in prompts:
            for name, tokens, seconds in runs[type(r)](r):
                pooled[by(r)][name][0] += tokens
                pooled[by(r)][name][1] += seconds
    return {key: {name: _rate(*run) for name, run in cell.items()} for key, cell in pooled.items()}


def _best_over_other(rates: dict[str, float]) -> float | None:
    """The fastest speculative exitspec run over the fastest run that is not exitspec's."""
    spec = max((v for k, v in rates.items() if k.startswith("exitspec ") and k != "exitspec AR"), default=None)
    other = max((v for k, v in rates.items() if not k.startswith("exitspec ")), default=None)
    return spec / other if spec and other else None


def _prompt(row) -> tuple:
    """The prompt a row decoded, dataset and temperature first: rows of any kind with equal ones ran the same prompt."""
    return row.dataset, row.temperature, row.prompt_id, row.turn, row.repeat


def draft_model_table(rows: list) -> list[dict]:
    """Trees against chains from one draft model: per dataset and temperature, each exitspec run with a draft model
    (drafter model:PATH or layers:K) and each hf-assistant peer, pooled over the prompts both ran: τ (new tokens
    over target forwards), the draft's seconds a round and tokens per second; [] without such rows."""
    peers = [r for r in rows if isinstance(r, PeerRow) and r.rounds]
    ours = [r for r in rows if isinstance(r, SpecRow) and r.drafter.startswith(DRAFT_MODEL_PREFIXES)]
    shared = {_prompt(r) for r in peers} & {_prompt(r) for r in ours}
    pooled: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0, 0.0])  # tokens, rounds, draft seconds, seconds
    for r in peers + ours:
        if _prompt(r) not in shared:
            continue
        name = f"{r.peer}" if isinstance(r, PeerRow) else f"exitspec {r.drafter} {r.budget} {r.verifier}"
        draft = r.draft_seconds if isinstance(r, PeerRow) else r.stage_seconds.get("draft", 0.0)
        cell = pooled[r.dataset, r.temperature, name]
        cell[0] += r.new_tokens
        cell[1] += r.rounds
        cell[2] += draft
        cell[3] += r.total_seconds
    order = sorted(pooled.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2]))
    return [{"dataset": d, "temperature": t, "run": name, "tau": tokens / rounds,
             "draft_seconds_per_round": draft / rounds, "tokens_per_second": _rate(tokens, seconds)}
            for (d, t, name), (tokens, rounds, draft, seconds) in order]


def peer_table_markdown(table: dict) -> list[str]:
    header = ["dataset", "T", "runs", "looped", *table["columns"], "best exitspec / fastest other",
              "the same without loops"]
    body = [[r["dataset"], f"{r['temperature']:g}", str(r["runs"]), str(r.get("looped", 0)),
             *(_num(r["tokens_per_second"].get(c), digits=1) for c in table["columns"]), _num(r["ratio"], "×"),
             _num(r.get("ratio_without_loops"), "×")] for r in table["rows"]]
    return _markdown_table(header, body)


def write_report(results: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """report.md, report.json and the PNG plots of a results JSONL, in out_dir (default: beside it)."""
    results = Path(results)
    if not results.is_file():
        raise FileNotFoundError(f"no results file at {results}")
    data = ResultsFile(results)
    cells = summarize(data.rows)
    if not cells:
        raise ValueError(f"{results} holds no speculative rows yet")
    out = Path(out_dir or results.parent)
    out.mkdir(parents=True, exist_ok=True)
    table = main_table(cells)
    ar = _baseline_stages(data.rows)
    paths = {"markdown": out / "report.md", "json": out / "report.json"}
    crossed, paired, peers = drafter_table(cells), paired_tau(data.rows), peer_table(data.rows)
    markdown = _report_markdown(data.envs, table, crossed, paired, cells, ar, results)
    if peers is not None:
        markdown += "\n".join(["", "## Peers: tokens per second on the same prompts", "",
                                *peer_table_markdown(peers), ""])
    drafts = draft_model_table(data.rows)
    if drafts:
        body = [[r["dataset"], f"{r['temperature']:g}", r["run"], _num(r["tau"]),
                 _num(1000 * r["draft_seconds_per_round"], " ms", 1), _num(r["tokens_per_second"], digits=1)]
                for r in drafts]
        markdown += "\n".join(["", "## One draft model: exitspec's trees against transformers' chains", "",
                                *_markdown_table(["dataset", "T", "run", "τ", "draft a round", "tok/s"], body), ""])
    paths["markdown"].write_text(markdown)
    report = {"results": str(results), "env": [asdict(e) for e in data.envs], "table": table, "drafter_table": crossed,
              "paired_tau": paired, "cells": cells, "autoregressive": ar, "peers": peers, "draft_models": drafts}
    paths["json"].write_text(json.dumps(report, indent=2))
    figures = dict(zip(PLOTS, (_plot_budgets(cells), _plot_stages(cells, ar), _plot_accepted(cells))))
    for name, fig in figures.items():
        paths[name] = out / name
        fig.savefig(paths[name], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def write_comparison(a: str | Path, b: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """compare.md and compare.json: the cells of two results files side by side (B over A as a ratio)."""
    files = [ResultsFile(p) for p in (a, b)]
    summaries = [{tuple(c[f] for f in CELL): c for c in summarize(f.rows)} for f in files]
    common = [k for k in summaries[0] if k in summaries[1]]
    if not common:
        raise ValueError(f"{a} and {b} share no (dataset, temperature, drafter, budget, verifier) cell")
    rows = []
    for key in common:
        ca, cb = summaries[0][key], summaries[1][key]
        row = dict(zip(CELL, key))
        for k in ("tau", "sr_ar", "sr_hf", "tokens_per_second"):
            row[k] = {"a": ca[k], "b": cb[k], "b_over_a": cb[k] / ca[k] if ca[k] and cb[k] is not None else None}
        rows.append(row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmark comparison", "", f"A: `{a}`", "", *_env_lines(files[0].envs), "", f"B: `{b}`", "",
             *_env_lines(files[1].envs), ""]
    header = ["Dataset", "T", "drafter", "B", "verifier"]
    for k in ("τ", "SR", "SR_HF", "tok/s"):
        header += [f"{k} A", f"{k} B", "B/A"]
    body = []
    for r in rows:
        cells = [r["dataset"], f"{r['temperature']:g}", drafter_label(r["drafter"]), str(r["budget"]), r["verifier"]]
        for k in ("tau", "sr_ar", "sr_hf", "tokens_per_second"):
            cells += [_num(r[k]["a"]), _num(r[k]["b"]), _num(r[k]["b_over_a"])]
        body.append(cells)
    lines += _markdown_table(header, body)
    paths = {"markdown": out / "compare.md", "json": out / "compare.json"}
    paths["markdown"].write_text("\n".join(lines) + "\n")
    envs = {"env_a": [asdict(e) for e in files[0].envs], "env_b": [asdict(e) for e in files[1].envs]}
    paths["json"].write_text(json.dumps({"a": str(a), "b": str(b), **envs, "rows": rows}, indent=2))
    return paths


def main_table_markdown(table: dict) -> list[str]:
    """The Table-1 Markdown lines of main_table's result."""
    header = ["Dataset", "T"] + [f"{label} {k}" for label in table["columns"]
                                 for k in ("τ", "SR", "SR without loops", "SR_HF")]
    body = []
    for row in table["rows"]:
        cells = [f"**{row['dataset']}**" if row["dataset"] == "mean" else row["dataset"], f"{row['temperature']:g}"]
        for label in table["columns"]:
            v = row["values"].get(label)
            spread = v and v.get("sr_ar_quartiles")
            sr = _num(v and v["sr_ar"], "×") + (f" ({spread[0]:.2f}–{spread[2]:.2f})" if spread else "")
            looped = f" ({v['looped']} of {v['rows']} rows looped)" if v and v.get("looped") else ""
            cells += [_num(v and v["tau"]), sr, _num(v and v.get("sr_ar_without_loops"), "×") + looped,
                      _num(v and v["sr_hf"], "×")]
        body.append(cells)
    return _markdown_table(header, body)


def verifier_markdown(result: dict) -> str:
    """Markdown of exitspec.bench.latency's result (the paper's Table 3): decision and verify-stage latency."""
    setting = (f"{result['mode']}; device {result['device']}, {result['threads']} threads, V = {result['vocab']}, "
               f"depth {result['depth']}, {result['pairs_per_budget']} trees x {result['repeats']} repeats, "
               f"top-p {result['top_p']}")
    lines = ["# Verifier latency (table 3)", "", setting, ""]
    header = ["B", "N", "T", "C_p", "predraw ms", "TEV ms", "speedup", "sequential ms", "greedy ms",
              "stage predraw ms", "stage TEV ms", "stage speedup", "full-warp TEV stage ms", "check_probs ms"]
    body = []
    for r in result["rows"]:
        m, s = r["median_ms"], r["stage_median_ms"]
        body.append([str(r["budget"]), f"{r['nodes']:.0f}", f"{r['temperature']:g}", f"{r['coverage']:.2f}",
                     f"{m['predraw']:.3f}", f"{m['tev']:.3f}", f"{r['speedup']:.2f}×", f"{m['sequential']:.3f}",
                     f"{m['greedy']:.3f}", f"{s['predraw']:.3f}", f"{s['tev']:.3f}", f"{r['stage_speedup']:.2f}×",
                     _num(s.get("tev_full_warp"), digits=3), _num(m.get("check"), digits=3)])
    return "\n".join(lines + _markdown_table(header, body)) + "\n"


def _report_markdown(envs: list[dict], table: dict, crossed: dict, paired: dict, cells: list[dict], ar: dict,
                     results: Path) -> str:
    labels = config_labels(cells)
    lines = ["# exitspec benchmark", "", f"Results: `{results}`", "", *_env_lines(envs), "", "## τ and SR", ""]
    lines += main_table_markdown(table)
    legend = ("τ: mean tokens per round (accepted + bonus). SR: speedup over exitspec's autoregressive loop on the "
              "same backend; SR_HF: over transformers' `model.generate`. Both: baseline seconds / speculative "
              "seconds per generated token, summed over the cell's prompts. In brackets: the quartiles of SR per "
              "prompt, each against its paired baseline (the spread a busy machine leaves). Without loops: the "
              "same, leaving out prompts of which an answer ends in a repetition loop (its last "
              f"{LOOP_SPAN} tokens came before, in the answer or the conversation).")
    lines += ["", legend, ""]
    if len(crossed["rows"]) > 1:
        lines += ["## By drafter (τ / SR, means over datasets)", "", *drafter_table_markdown(crossed), ""]
        lines += [f"## Paired τ: {drafter_label(paired['candidate'])} minus each other drafter", "",
                  *paired_tau_markdown(paired), "",
                  "Mean ± standard error over the prompts both drafters ran, the same prompt, seed and setting.", ""]
    lines += ["## Details", ""]
    header = ["Dataset", "T", "config", "prompts", "looped", "tokens", "τ", "mean C_p", "tok/s", "AR tok/s",
              "HF tok/s", "SR", "SR_HF", "= AR at T=0"]
    body = []
    for c in cells:
        body.append([c["dataset"], f"{c['temperature']:g}", labels[tuple(c[f] for f in CONFIG)], str(c["prompts"]),
                     str(c["looped"]), str(c["new_tokens"]), _num(c["tau"]), _num(c["mean_coverage"]),
                     _num(c["tokens_per_second"], "", 1),
                     _num(c["ar_tokens_per_second"], "", 1), _num(c["hf_tokens_per_second"], "", 1),
                     _num(c["sr_ar"], "×"), _num(c["sr_hf"], "×"),
                     "-" if c["matches_ar"] is None else f"{100 * c['matches_ar']:.0f}%"])
    lines += _markdown_table(header, body)
    sized = [c for c in cells if c["tree_size_histogram"]]
    if sized:
        lines += ["", "## Tree sizes: share of rounds at each N (draft tokens verified)", ""]
        header = ["Dataset", "T", "config", "mean N", *(label for label, _ in SIZE_BANDS)]
        body = []
        for c in sized:
            counts = c["tree_size_histogram"]
            rounds = sum(counts)
            shares = [sum(counts[lo : hi + 1]) / rounds for _, (lo, hi) in SIZE_BANDS]
            mean = sum(n * k for n, k in enumerate(counts)) / rounds
            body.append([c["dataset"], f"{c['temperature']:g}", labels[tuple(c[f] for f in CONFIG)], f"{mean:.1f}",
                         *(f"{100 * x:.0f}%" for x in shares)])
        lines += _markdown_table(header, body)
    lines += ["", "## Time per generated token (ms)", ""]
    header = ["config", "T", "prefill", *STAGES, "total"]
    body = [[label, f"{t:g}", *(f"{v:.2f}" for v in ms)] for label, t, ms in _stage_rows(cells, ar)]
    lines += _markdown_table(header, body)
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _baseline_stages(rows: list[BaselineRow | SpecRow]) -> dict[str, dict]:
    """Per temperature, the pooled stage seconds, prefill and tokens of the autoregressive baseline rows of the
    prompts that spec rows ran (not context turns)."""
    measured = {_prompt(r) for r in rows if isinstance(r, SpecRow)}
    out: dict[str, dict] = {}
    for row in rows:
        if not isinstance(row, BaselineRow) or _prompt(row) not in measured:
            continue
        agg = out.setdefault(f"{row.temperature:g}", {"tokens": 0, "prefill_seconds": 0.0,
                                                       "stage_seconds": dict.fromkeys(STAGES, 0.0)})
        agg["tokens"] += row.ar.new_tokens
        agg["prefill_seconds"] += row.ar.prefill_seconds
        for s in STAGES:
            agg["stage_seconds"][s] += row.ar.stage_seconds[s]
    return out


def _stage_rows(cells: list[dict], ar: dict) -> list[tuple[str, float, list[float]]]:
    """(label, temperature, ms per token: prefill, each stage, total) per config x temperature, then AR."""
    labels = config_labels(cells)
    pooled: dict[tuple, dict] = {}
    for c in cells:
        key = (labels[tuple(c[f] for f in CONFIG)], c["temperature"])
        p = pooled.setdefault(key, {"tokens": 0, "prefill_seconds": 0.0, "stage_seconds": dict.fromkeys(STAGES, 0.0)})
        p["tokens"] += c["new_tokens"]
        p["prefill_seconds"] += c["prefill_seconds"]
        for s in STAGES:
            p["stage_seconds"][s] += c["stage_seconds"][s]
    pooled.update({("autoregressive", float(t)): a for t, a in ar.items()})
    rows = []
    for (label, t), p in pooled.items():
        ms = [1e3 * p["prefill_seconds"] / max(p["tokens"], 1)]
        ms += [1e3 * p["stage_seconds"][s] / max(p["tokens"], 1) for s in STAGES]
        rows.append((label, t, ms + [sum(ms)]))
    return rows


def _plot_budgets(cells: list[dict]):
    """τ (top) and SR (bottom) against the budget, one column per dataset, one line per drafter/verifier/T.

    A series keeps its colour in every column, and one legend below the panels names all of them."""
    datasets = list(dict.fromkeys(c["dataset"] for c in cells))
    budgets = sorted({budget_cap(c["budget"]) for c in cells})
    names = list(dict.fromkeys(_series_name(c) for c in cells))
    colours = _colours(names)
    fig, axes = plt.subplots(2, len(datasets), figsize=(4 * len(datasets), 6.5), squeeze=False, sharex=True)
    if budgets[0] > 0:
        axes[0, 0].set_xscale("log", base=2)
    axes[0, 0].set_xticks(budgets, [str(b) for b in budgets])
    axes[0, 0].minorticks_off()
    handles = {}
    for col, dataset in enumerate(datasets):
        series: dict[str, list] = defaultdict(list)
        for c in cells:
            if c["dataset"] == dataset:
                series[_series_name(c)].append((budget_cap(c["budget"]), c["tau"], c["sr_ar"]))
        for name, points in series.items():
            points.sort()
            xs = [p[0] for p in points]
            style = {"marker": "o", "color": colours[name], "label": name}
            handles[name] = axes[0, col].plot(xs, [p[1] for p in points], **style)[0]
            axes[1, col].plot(xs, [p[2] or 0 for p in points], **style)
        axes[0, col].set_title(dataset)
        axes[1, col].set_xlabel("budget B (draft tokens per tree; auto: its cap)")
    axes[0, 0].set_ylabel("τ (tokens per round)")
    axes[1, 0].set_ylabel("SR over autoregressive")
    fig.legend([handles[n] for n in names], names, loc="lower center", ncol=min(len(names), 4), fontsize="small")
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 4), 1, 1))
    return fig


def _colours(names: list[str]) -> dict[str, tuple]:
    """One fixed colour per series name, so a series looks the same in every panel of a figure."""
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def _series_name(cell: dict) -> str:
    auto = " · auto" if isinstance(cell["budget"], str) else ""  # auto:B sits at its cap B on the budget axis
    return f"{drafter_label(cell['drafter'])}{auto} · {cell['verifier']} · T={cell['temperature']:g}"


def _plot_stages(cells: list[dict], ar: dict):
    """Stacked horizontal bars of ms per generated token by stage, per config x temperature and the AR loop."""
    rows = _stage_rows(cells, ar)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    names = [f"{label} · T={t:g}" for label, t, _ in rows]
    left = [0.0] * len(rows)
    for i, stage in enumerate(("prefill", *STAGES)):
        widths = [ms[i] for _, _, ms in rows]
        ax.barh(names, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token")
    ax.legend(ncol=3, fontsize="small")
    return fig


def _plot_accepted(cells: list[dict]):
    """Share of rounds by accepted draft tokens, one panel per temperature, one bar group per config."""
    labels = config_labels(cells)
    colours = _colours(list(labels.values()))
    temperatures = sorted({c["temperature"] for c in cells})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    for ax, t in zip(axes[0], temperatures):
        hists: dict[str, Counter] = defaultdict(Counter)
        for c in cells:
            if c["temperature"] == t:
                hists[labels[tuple(c[f] for f in CONFIG)]].update(dict(enumerate(c["accepted_histogram"])))
        width = 0.8 / len(hists)
        for i, (label, hist) in enumerate(hists.items()):
            total = sum(hist.values()) or 1
            xs = sorted(hist)
            offset = (i - (len(hists) - 1) / 2) * width
            ax.bar([x + offset for x in xs], [hist[x] / total for x in xs], width=width, label=label,
                   color=colours[label])
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"T = {t:g}")
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize="small")
    return fig


def _env_lines(envs: list[EnvRow]) -> list[str]:
    if not envs:
        return ["(no environment recorded)"]
    e = envs[0]
    load = f", load average {e.load_average[0]:.2f}" if e.load_average else ""
    drafters = {spec: sha for env in envs for spec, sha in env.drafters.items()}
    return [
        f"- model: `{e.model}` (sha256 {e.model_sha})",
        "- drafters: " + ", ".join(f"`{spec}` ({sha})" for spec, sha in drafters.items()),
        f"- device: {e.device} ({e.device_name}), {e.dtype}, {e.threads} threads{load}",
        f"- torch {e.torch}, transformers {e.transformers}, python {e.python}",
        f"- sessions: {len(envs)}, first {e.created}",
    ]


def _setting_labels(table: dict) -> list[str]:
    """Column headers "T=0 B32 tev" of drafter_table and paired_tau."""
    return [f"T={c['temperature']:g} B{c['budget']} {c['verifier']}" for c in table["columns"]]


def _markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in body]


def _quartiles(values: list) -> list[float] | None:
    """[q1, median, q3] of the values that are not None (None with fewer than two)."""
    values = [v for v in values if v is not None]
    return statistics.quantiles(values, n=4, method="inclusive") if len(values) >= 2 else None


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _num(value, suffix: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"
