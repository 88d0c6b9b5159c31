"""A GPU record in one call: random-weight Qwen3-4B- and Qwen3-8B-shaped targets built on the device, no downloads.

    python -m exitspec.bench.gpu_record --device cuda --out data/bench/gpu-<device>   # scripts/gpu-record.sh
    python -m exitspec.bench.gpu_record --tiny --device cpu --out /tmp/record          # CI: the same, tiny shapes

For each target shape, in bf16 (fp32 with --tiny on a CPU):

    forward     the target stage (forward_tree + commit) against N = 0…64, a 512-token cache, eager
    greedy      where the speculative greedy output first leaves the autoregressive one (batch-shape numerics
                in bf16: reported, not hidden)
    rounds      one DFlash-shaped drafter (random weights) drafting B = 32 TEV rounds: ops and syncs per round
                (bench/rounds.py) and the seconds of each stage; the round overhead is everything but the
                target's forward, as a share of the round
    projected   SR from a τ measured by a real run (--tau-from a bench results file: its T = 0 speculative rows,
                pooled; or --tau): τ · t(step) / t(round at B = 32)

and Table 3 (the verifier decision's latency, bench/latency.py) on synthetic trees at V = 151,936. The tree
forward runs eager: CUDA graphs for it are not built yet, so the record says so instead of a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from exitspec.bench import latency
from exitspec.bench.forward import bushy_tree, target_stage_seconds
from exitspec.bench.report import aggregate
from exitspec.bench.rounds import count_rounds
from exitspec.bench.rows import SpecRow
from exitspec.bench.runner import ResultsFile
from exitspec.decode import SpeculativeDecoder, generate_autoregressive
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.settings import cpu_name
from exitspec.target import TargetModel

QWEN3 = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
         "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}
SHAPES = {
    "qwen3-4b": {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "tie_word_embeddings": False},
}
TINY = {"tiny-qwen3": {**QWEN3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096,
                       "max_position_embeddings": 1024, "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 4, "tie_word_embeddings": False}}
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)
CONTEXT = 512


def random_target(shape: dict, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """A Qwen3 causal LM of `shape` with random weights, made on the device (N(0, 0.02), sdpa), eval."""
    config = Qwen3Config(**shape)
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in `dtype`: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def forward_cost(target: TargetModel, sizes=SIZES, repeats: int = 5) -> list[dict]:
    """Median ms of forward_tree + commit of a bushy tree of N nodes after a CONTEXT-token cache, per N."""
    target.reset()
    target.prefill(torch.arange(CONTEXT, device=target.device) % target.vocab_size)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first pass warms up
        for n in sizes:
            times[n].append(target_stage_seconds(target, bushy_tree(n, 1, target.vocab_size, target.device)))
    step = statistics.median(times[0][1:])
    return [{"n": n, "ms": 1e3 * statistics.median(times[n][1:]), "steps": statistics.median(times[n][1:]) / step}
            for n in sizes]


def dflash_decoder(model, layers: int) -> SpeculativeDecoder:
    """The target with a DFlash-shaped drafter of random weights (block 16, `layers` layers)."""
    torch.manual_seed(0)
    with torch.device(model.device):
        draft = DFlashModel.for_target(model.config, num_layers=layers, block_size=16).to(model.dtype)
    drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings(), suffix_source=False)
    return SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter, warm_start=False)


def greedy_agreement(decoder: SpeculativeDecoder, prompt: list[int], tokens: int) -> dict:
    """The first index where speculative greedy output (B = 32) leaves the autoregressive one (None: never)."""
    spec = decoder.generate(prompt, tokens, temperature=0.0, budget=32, stop_tokens=(), learn=False).tokens
    plain = generate_autoregressive(decoder.target, prompt, tokens, stop_tokens=()).tokens
    first = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), None)
    return {"tokens": tokens, "first_divergence": first, "equal": spec == plain}


def round_breakdown(decoder: SpeculativeDecoder, prompt: list[int], tokens: int, forward_ms: float) -> dict:
    """Ops and syncs per B = 32 TEV round, and each stage's ms per round (timed apart from the counting; stages
    do not sync, so on a GPU the forward's time lands in the stage that waits for it). The overhead is the
    round's time beyond `forward_ms`, the target stage's cost at N = 32 measured alone."""
    counts, _ = count_rounds(decoder, prompt, max_new_tokens=min(tokens, 24), budget=32, temperature=1.0,
                             stop_tokens=(), learn=False)
    result = decoder.generate(prompt, tokens, temperature=1.0, budget=32, stop_tokens=(), learn=False)
    rounds = len(result.rounds)
    stages = {s: 1e3 * v / rounds for s, v in result.stage_seconds.items()}
    round_ms = sum(stages.values())
    return {"counts": counts.per_round(), "rounds": rounds, "stage_ms": stages, "round_ms": round_ms,
            "tau": result.tau, "overhead_share": max(0.0, 1 - forward_ms / round_ms)}


def measured_tau(results: Path) -> float:
    """τ pooled over the temperature-0 speculative rows of a bench results file (report.aggregate)."""
    rows = [r for r in ResultsFile(results).rows if isinstance(r, SpecRow) and r.temperature == 0]
    if not rows:
        raise ValueError(f"{results} holds no speculative rows at temperature 0 to take τ from")
    return aggregate(rows)["tau"]


def record(device: torch.device, tiny: bool, out: Path, tau: float, tau_source: str) -> dict:
    dtype = torch.float32 if tiny and device.type == "cpu" else torch.bfloat16
    shapes, tokens = (TINY, 32) if tiny else (SHAPES, 128)
    prompt = [(17 * k + 5) % 1000 for k in range(64)]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "tiny": tiny,
              "cuda_graphs": "not built: the tree forward runs eager", "tau": tau, "tau_source": tau_source,
              "shapes": {}}
    for name, shape in shapes.items():
        model = random_target(shape, device, dtype)
        decoder = dflash_decoder(model, layers=1 if tiny else 5)
        forward = forward_cost(decoder.target, repeats=2 if tiny else 5)
        rounds = round_breakdown(decoder, prompt, tokens, next(r["ms"] for r in forward if r["n"] == 32))
        result["shapes"][name] = {
            "shape": shape, "forward": forward, "greedy": greedy_agreement(decoder, prompt, tokens), "rounds": rounds,
            "projected_sr": tau * forward[0]["ms"] / rounds["round_ms"],  # τ tokens a round, against steps
        }
        del model, decoder
        if device.type == "cuda":
            torch.cuda.empty_cache()
    vocab = 4096 if tiny else 151_936
    result["table3"] = latency.measure(device=str(device), budgets=[16, 32, 64], temperatures=[1.0, 0.6],
                                        prompts=2 if tiny else 4, repeats=5 if tiny else 50, warmup=2,
                                        synthetic=True, vocab=vocab)
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CI runs them on the CPU)")
    parser.add_argument("--out", type=Path, required=True, help="the record folder (record.json)")
    tau = parser.add_mutually_exclusive_group(required=True)
    tau.add_argument("--tau-from", type=Path, metavar="RESULTS", help="a bench results.jsonl: τ of its T = 0 rows")
    tau.add_argument("--tau", type=float, help="τ to project the speedup with")
    args = parser.parse_args(argv)
    value, source = (args.tau, "--tau") if args.tau is not None else (measured_tau(args.tau_from), str(args.tau_from))
    result = record(torch.device(args.device), args.tiny, args.out, value, source)
    for name, shape in result["shapes"].items():
        steps = ", ".join(f"N={r['n']}: {r['steps']:.2f}" for r in shape["forward"])
        r = shape["rounds"]
        print(f"{name}: step {shape['forward'][0]['ms']:.2f} ms; forward in steps {steps}; "
              f"round {r['round_ms']:.2f} ms, "
              f"overhead {100 * r['overhead_share']:.0f}%, {r['counts']['syncs_total']:.1f} syncs and "
              f"{r['counts']['ops_outside_target']:.0f} ops outside the target a round; greedy "
              f"{'equal' if shape['greedy']['equal'] else 'diverges at ' + str(shape['greedy']['first_divergence'])}; "
              f"projected SR {shape['projected_sr']:.2f} at τ {result['tau']:.2f} ({result['tau_source']})")
    print(f"wrote {args.out / 'record.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
