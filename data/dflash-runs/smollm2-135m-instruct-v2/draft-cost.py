"""Issue 17, item 4: the draft stage's ms per round against τ, for drafters of 1 and 2 layers.

    python data/dflash-runs/smollm2-135m-instruct-v2/draft-cost.py DRAFTER_FOLDER... [--threads 2]

Each drafter decodes the same 8 prompts (2 each of GSM8K test, MATH-500, HumanEval, MT-Bench), 64 new tokens,
T = 0, fixed B = 32, TEV; the drafters take turns prompt by prompt so machine load falls on all alike. Prints
the draft stage's (drafter.propose) and build stage's mean ms per round, the target stage's for scale, and τ.
"""

import argparse
import statistics

import torch

from exitspec.app import load_decoders, setup_cpu
from exitspec.data import load_dataset

setup_cpu()  # MKL's AVX2 path on AMD, as the `exitspec` command does: timings as users see them
parser = argparse.ArgumentParser()
parser.add_argument("drafters", nargs="+")
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
decoders = load_decoders(None, args.drafters, "cpu", "auto", args.threads)
prompts = [s.prompt(0) for name in ("gsm8k", "math500", "humaneval", "mtbench") for s in load_dataset(name)[1][:2]]
stats = {d: {"draft": [], "build": [], "target": [], "tau": []} for d in args.drafters}
for prompt in prompts:
    for spec, decoder in decoders.items():
        result = decoder.generate(prompt, max_new_tokens=64, temperature=0.0, budget=32, verifier="tev")
        rounds = len(result.rounds)
        for stage in ("draft", "build", "target"):
            stats[spec][stage].append(1e3 * result.stage_seconds[stage] / rounds)
        stats[spec]["tau"].append(result.tau)
print(f"torch threads {torch.get_num_threads()}, {len(prompts)} prompts, 64 tokens, T = 0, B = 32, TEV")
print("| drafter | draft ms/round | build ms/round | target ms/round | τ |")
print("|---|---|---|---|---|")
for spec, s in stats.items():
    print(f"| {spec} | " + " | ".join(f"{statistics.mean(s[k]):.2f}" for k in ("draft", "build", "target", "tau")) + " |")
