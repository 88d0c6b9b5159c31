"""Where the gap lies: per depth, the nodes and the reach mass Σ P(u) of the best trees of N = 5 nodes against
the drafter's fixed trees of 5, DFlash's block forward every round ("model") or the copy sources alone
("cheap"); T = 1, 3 prompts a set, 30 rounds each, warm start off.

    python data/bench/smollm2-135m-instruct/edit-oracle/shape.py > shape.txt
"""

import torch

import exitspec

exitspec.setup_cpu()
from exitspec.app import load_decoders
from exitspec.data import load_dataset
from exitspec.exits import best_trees, inspect_rounds
from exitspec.sampling import SamplingParams

dec = load_decoders(None, ["dflash"], "cpu", "auto", 2, "auto", warm_start=False, learn=False)["dflash"]
params = SamplingParams(1.0)
N = 5
orig = dec.drafter.propose
for variant in ("model", "cheap"):
    dec.drafter.propose = (lambda c, d, cheap=False: orig(c, d, cheap=True)) if variant == "cheap" else orig
    for name in ["humaneval-edit", "mtbench"]:
        _, samples = load_dataset(name)
        bd = torch.zeros(N + 2, dtype=torch.float64)
        dd = torch.zeros(N + 2, dtype=torch.float64)
        bw = torch.zeros(N + 2)
        dw = torch.zeros(N + 2)
        n = 0
        for s in samples[:3]:
            pids, rounds, _ = inspect_rounds(dec, s.prompt(0), 30, N, params, seed=0)
            for rnd, bt in zip(rounds, best_trees(dec.target, pids, rounds, N, params)):
                for u in range(1, bt.size):
                    bd[int(bt.depths[u])] += bt.scores[u]
                    bw[int(bt.depths[u])] += 1
                tr = rnd.tree
                for u in range(1, tr.size):
                    dd[int(tr.depths[u])] += float(rnd.flow.reach[u])
                    dw[int(tr.depths[u])] += 1
                n += 1
        print(
            variant,
            name,
            n,
            "best: nodes/depth",
            [round(x / n, 2) for x in bw.tolist()[1:]],
            "P/depth",
            [round(x / n, 3) for x in bd.tolist()[1:]],
            "| drafter: nodes/depth",
            [round(x / n, 2) for x in dw.tolist()[1:]],
            "P/depth",
            [round(x / n, 3) for x in dd.tolist()[1:]],
            flush=True,
        )
