"""Which source falls short? Fixed trees of N nodes at T = 1, drafted every round by DFlash's block forward
("model": what `auto` calls a model round) or by the copy sources alone ("cheap": prompt lookup, suffix trees,
the corpus table), against the best tree of the same size; 4 prompts a set, 40 rounds each, warm start off.

    python data/bench/smollm2-135m-instruct/edit-oracle/sources.py 5 > sources.txt
"""

import sys

import exitspec

exitspec.setup_cpu()

from exitspec.app import load_decoders
from exitspec.data import load_dataset
from exitspec.exits import best_coverages, inspect_rounds
from exitspec.sampling import SamplingParams

dec = load_decoders(None, ["dflash"], "cpu", "auto", 2, "auto", warm_start=False, learn=False)["dflash"]
params = SamplingParams(1.0)
N = int(sys.argv[1])
orig = dec.drafter.propose
for variant in ("model", "cheap"):
    dec.drafter.propose = (lambda c, d, cheap=False: orig(c, d, cheap=True)) if variant == "cheap" else orig
    for name in ["humaneval-edit", "gsm8k-rewrite", "mtbench"]:
        _, samples = load_dataset(name)
        cs, bs = [], []
        for s in samples[:4]:
            pids, rounds, _ = inspect_rounds(dec, s.prompt(0), 40, N, params, seed=0)
            best = best_coverages(dec.target, pids, rounds, N, params)
            cs += [r.flow.coverage.item() for r in rounds]
            bs += [b[r.tree.num_nodes] for b, r in zip(best, rounds)]
        print(
            variant,
            N,
            name,
            len(cs),
            f"C {sum(cs) / len(cs):.2f} best {sum(bs) / len(bs):.2f} reached {sum(cs) / sum(bs):.0%}",
            flush=True,
        )
