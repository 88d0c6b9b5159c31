"""The target stage's cost against tree size N, per backend: what a round pays for verifying N draft tokens.

    exitspec latency --stage forward [--sizes 0 1 2 4 8 16 32 64] [--context 300] [--repeats 7]
    exitspec latency --stage profile [--sizes 0 4 8 16]          # where one forward's time goes (`profile`)

For each N, a chain of N draft tokens (the deepest tree, as a peaked drafter's DDTree tends to be) and a
balanced binary tree of N nodes (`bushy_tree`, as a flat drafter's is) go through `forward_tree` + `commit`
after `context` cached tokens, on transformers' own forward, on the lean Llama-family forward in the model's
dtype, and on the decoder's own target ("decoder": the lean forward with the row plan that `--budget auto`
uses, or the quantized forward of a quantized --dtype), alternated per size so load drift hits all alike.
N = 0 is the root alone: one decoding step, the unit of the ratios. Reported: median milliseconds and ratio
to that backend's own step.

`--llamacpp` adds llama.cpp on the GGUF file of the same weights (llamacpp.same_weights): `llama-bench`'s
causal batch of N + 1 tokens after `context` cached ones (`-p N+1 -d context`; llama.cpp has no tree batch in
its bench, and a chain is what a tree costs it), run before and after exitspec's passes; the table gives their
mean, and both runs are kept.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from exitspec.app import load_decoders
from exitspec.bench.llamacpp import install_dir, same_weights, variant_files
from exitspec.budget import chain_runs
from exitspec.lean import supports
from exitspec.quant import IDENTITY as QUANT_FORWARD
from exitspec.settings import cpu_name
from exitspec.target import TargetModel
from exitspec.timing import fastest, timings
from exitspec.tree import DraftTree

SIZES = (0, 1, 2, 4, 8, 16, 32, 64)
BACKENDS = ("transformers", "lean", "decoder")


def bushy_tree(size: int, root: int, vocab: int, device) -> DraftTree:
    """A balanced binary tree of `size` nodes, parents first: node k's parent is (k − 1) // 2 for k ≥ 1."""
    parents = [-1] + [(k - 1) // 2 for k in range(1, size + 1)]
    depths = [0]
    for k in range(1, size + 1):
        depths.append(depths[parents[k]] + 1)
    tokens = [root] + [(7 * k + 3) % vocab for k in range(1, size + 1)]
    return DraftTree(*(torch.tensor(x, dtype=torch.long) for x in (parents, tokens, depths))).to(device)


def target_stage_seconds(target: TargetModel, tree: DraftTree) -> float:
    """Seconds of one target stage over `tree` (forward_tree + commit of the root), device-synchronised
    (timing.timings); the cache is then cut back, untimed, so every measurement sees the same context."""
    context = target.cache_len

    def verify_nothing() -> None:
        target.forward_tree(tree)
        target.commit(tree, [])

    return timings(verify_nothing, 1, target.device, reset=lambda: target.truncate(context))[0]


def measure(model=None, device=None, dtype="auto", threads=None, sizes=SIZES, context=300, repeats=7,
            llamacpp: bool = False) -> dict:
    """Median seconds of forward_tree + commit per (backend, shape, N), alternating the backends; with `llamacpp`,
    llama.cpp's causal batches on the same weights' GGUF file before and after."""
    decoder = next(iter(load_decoders(model, ["ngram"], device, dtype, threads, budgets=[max(sizes)]).values()))
    hf = decoder.target.model
    backends = [b for b in BACKENDS if b == "transformers" or supports(hf) is None]
    # "decoder" is the decoder's own target, calibrated at load: the forward every decoding run uses
    targets = {b: decoder.target if b == "decoder" else TargetModel(hf, decoder.target.tokenizer, backend=b)
               for b in backends}
    gguf = llamacpp_file(decoder.target.precision) if llamacpp else None
    any_target = targets[backends[0]]
    context = max(1, min(context, any_target.max_context - max(sizes) - 2))
    ids = torch.arange(context, device=any_target.device) % any_target.vocab_size
    for target in targets.values():
        target.prefill(ids)
    times = {(b, shape, n): [] for b in backends for shape in ("chain", "tree") for n in sizes}
    peer_runs = [llama_bench(gguf, sizes, context, repeats)] if gguf else []
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        for n in sizes:
            for shape in ("chain", "tree"):
                for b in backends:
                    target = targets[b]
                    if shape == "chain":
                        tokens = [(7 * k + 3) % target.vocab_size for k in range(n)]
                        tree = DraftTree.chain(1, tokens, device=target.device)
                    else:
                        tree = bushy_tree(n, 1, target.vocab_size, target.device)
                    times[b, shape, n].append(target_stage_seconds(target, tree))
    if gguf:
        peer_runs.append(llama_bench(gguf, sizes, context, repeats))
    rows = []
    for n in sizes:
        for shape in ("chain", "tree"):
            row = {"n": n, "shape": shape}
            for b in backends:
                seconds = statistics.median(times[b, shape, n][1:])
                step = statistics.median(times[b, "chain", 0][1:])
                row[b] = {"ms": round(1000 * seconds, 2), "steps": round(seconds / step, 3)}
            if peer_runs and shape == "chain":
                ms = [run[n] * 1000 for run in peer_runs]
                steps = statistics.mean(ms) / statistics.mean(r[0] * 1000 for r in peer_runs)
                row["llama.cpp"] = {"ms": round(statistics.mean(ms), 2), "runs_ms": [round(x, 2) for x in ms],
                                    "steps": round(steps, 3)}
            rows.append(row)
    return {"model": str(model or "SmolLM2-135M-Instruct"), "device": str(any_target.device), "cpu": cpu_name(),
            "precision": decoder.target.precision, "llama.cpp file": gguf.name if gguf else None,
            "threads": torch.get_num_threads(), "context": context, "repeats": repeats, "rows": rows}


def llamacpp_file(precision: str) -> Path:
    """The GGUF file of llama.cpp's build (scripts/llamacpp.sh) holding the same weights as `precision`."""
    variant = same_weights(precision)
    if variant is None:
        raise ValueError(f"llama.cpp has no file of the {precision} weights; use --dtype gguf, q8_0 or bfloat16")
    return variant_files(variant)[1]


def llama_bench(gguf: Path, sizes, context: int, repeats: int) -> dict[int, float]:
    """{N: seconds} of llama-bench's causal batch of N + 1 tokens after `context` cached ones, at this process's
    thread count."""
    bench = install_dir() / "bin" / "llama-bench"
    command = [str(bench), "-m", str(gguf), "-t", str(torch.get_num_threads()), "-n", "0", "-d", str(context),
               "-p", ",".join(str(n + 1) for n in sizes), "-r", str(repeats), "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return {int(run["n_prompt"]) - 1: run["avg_ns"] / 1e9 for run in json.loads(out)}


def print_table(result: dict, console: Console) -> None:
    backends = [b for b in (*BACKENDS, "llama.cpp") if b in result["rows"][0]]
    table = Table(title=f"Target stage (forward_tree + commit) against N, {result['context']}-token cache, "
                        f"{result['threads']} threads, {result['device']}: ms and × one decoding step")
    table.add_column("N", justify="right")
    table.add_column("shape")
    for b in backends:
        table.add_column(f"{b} ms", justify="right")
        table.add_column(f"{b} × step", justify="right")
    for row in result["rows"]:
        if row["n"] == 0 and row["shape"] == "tree":
            continue  # the root alone is the same in both shapes
        table.add_row(str(row["n"]), row["shape"] if row["n"] else "root", *(
            x for b in backends for x in ((f"{row[b]['ms']:.1f}", f"{row[b]['steps']:.2f}") if b in row else ("", ""))))
    console.print(table)


PRODUCTS = ("mkldnn::_linear_pointwise", "aten::bmm", "aten::mm", "aten::addmm")  # the weight products' kernels
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention")


def profile(model=None, device=None, dtype="auto", threads=None, sizes=(0, 4, 8, 16), context=300, repeats=5) -> dict:
    """Where a tree forward + commit of N nodes spends its time, on the lean forward with the row plan every
    decoding run uses: the weight products (the LM head's over N + 1 rows timed apart), attention over the
    cache, and everything else (norms, RoPE, cache writes, Python and dispatch). Chains after `context` cached
    tokens; per size the mean of `repeats` profiled runs after a warm-up, in ms."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decoder = next(iter(load_decoders(model, ["ngram"], device, dtype, threads, budgets=[max(sizes)]).values()))
    target = decoder.target
    if target.attention == QUANT_FORWARD:
        raise ValueError(f"--stage profile splits the torch forward's ops; the {target.precision} target runs the "
                         f"quantized forward, one C++ call: use --dtype float32 (or --stage forward)")
    head = target.model.get_output_embeddings().weight
    rows = []
    for n, verify_nothing in zip(sizes, chain_runs(target, list(sizes), context)):
        verify_nothing()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            total = sum(timings(verify_nothing, repeats, target.device)) / repeats
        ops = {e.key: e.self_cpu_time_total / 1e6 / repeats for e in prof.key_averages()}
        products = sum(ops.get(k, 0.0) for k in PRODUCTS)
        attention = sum(ops.get(k, 0.0) for k in ATTENTION)
        x = torch.zeros(n + 1, head.shape[1], dtype=head.dtype, device=target.device)
        lm_head = fastest(lambda x=x: target.backend.linear(x, head), repeats + 1, target.device) \
            if hasattr(target.backend, "linear") else 0.0
        rows.append({"n": n, "total_ms": 1000 * total, "products_ms": 1000 * (products - lm_head),
                     "lm_head_ms": 1000 * lm_head, "attention_ms": 1000 * attention,
                     "other_ms": 1000 * (total - products - attention)})
    return {"device": str(target.device), "dtype": target.precision, "threads": torch.get_num_threads(),
            "context": target.cache_len, "row_plan": target.forward_config()["row_plan"], "rows": rows}


def print_profile(result: dict, console: Console) -> None:
    table = Table(title=f"Where a tree forward's time goes: lean forward with the row plan, {result['context']}-token "
                        f"cache, {result['dtype']}, {result['threads']} threads, {result['device']} (ms)")
    for column in ("N", "total", "weight products", "LM head", "attention", "other", "total × step"):
        table.add_column(column, justify="right")
    step = result["rows"][0]["total_ms"] if result["rows"][0]["n"] == 0 else None
    for r in result["rows"]:
        table.add_row(str(r["n"]), *(f"{r[k]:.1f}" for k in ("total_ms", "products_ms", "lm_head_ms", "attention_ms",
                                                              "other_ms")),
                      f"{r['total_ms'] / step:.2f}" if step else "-")
    console.print(table)
