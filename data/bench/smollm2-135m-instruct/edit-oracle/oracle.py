"""How far are the drafter's trees from the best trees possible? `inspect --oracle` over a preset's prompts.

For each prompt: one sampled answer by exact speculative decoding (`dflash`, `--budget auto:B`, TEV), at most
--rounds rounds; for every round, the best tree of each size N <= B for that round's context (the target's own
best-first tree, `exitspec.exits.best_tree`). Per set: the drafter's mean C_p, the best trees' mean C*_p at
the same sizes and at B, and SR* (`exitspec.exits.ceiling`), beside the same cost model's speed-up of the
drafter's own trees with their drafting free (SR_trees). A context turn (mtbench-revise's first) is answered by
the autoregressive loop at the same temperature and seed, as `exitspec bench` does.

    python data/bench/smollm2-135m-instruct/edit-oracle/oracle.py --sets humaneval-edit gsm8k-rewrite \\
        mtbench-revise --num-prompts 8 --rounds 48 --out data/bench/smollm2-135m-instruct/edit-oracle/edit.json

Each answer ends at --rounds rounds or --max-new-tokens tokens (256, as in `bench --preset edit`), whichever
comes first; the context turn is answered up to --max-new-tokens.
"""

import argparse
import json
import time

import exitspec

exitspec.setup_cpu()

from exitspec.app import load_decoders
from exitspec.data import load_dataset
from exitspec.exits import best_coverages, ceiling, describe, inspect_rounds, summarize
from exitspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", nargs="+", required=True)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    decoder = load_decoders(None, ["dflash"], "cpu", "auto", 2, "auto", warm_start=False, learn=False)["dflash"]
    cost = decoder.calibrate(args.budget)
    params = SamplingParams(args.temperature)
    out = {"settings": vars(args), "forward_config": decoder.target.forward_config(),
           "cost_ms": [1e3 * cost(n) for n in range(args.budget + 1)], "sets": {}}
    for name in args.sets:
        _, samples = load_dataset(name)
        answers = []
        for sample in samples[: args.num_prompts]:
            start = time.time()
            context: list[str] = []
            for turn in range(sample.context_turns):
                context.append(decoder.autoregressive(sample.prompt(turn, context), max_new_tokens=args.max_new_tokens,
                                                      temperature=args.temperature, seed=args.seed).text)
            prompt = sample.prompt(sample.context_turns, context)
            prompt_ids, rounds, _ = inspect_rounds(
                decoder, prompt, args.rounds, f"auto:{args.budget}", params, seed=args.seed,
                max_new_tokens=args.max_new_tokens)
            best = best_coverages(decoder.target, prompt_ids, rounds, args.budget, params)
            records = describe(rounds, decoder.target.tokenizer, top=1, best=best)
            sizes = [r["tree_size"] for r in records]
            trees = sum(1 + r["coverage"] for r in records) / sum(cost(n) for n in sizes) * cost(0)
            summary = summarize(records) | ceiling(best, cost) | {"trees_speedup": trees, "sizes": sizes}
            answers.append({"id": sample.id, "seconds": time.time() - start, "best": best,
                            "coverage": [r["coverage"] for r in records], **summary})
            print(f"{name} {sample.id}: {len(rounds)} rounds, C_p {summary['mean_coverage']:.2f}, C*_p same size "
                  f"{summary['mean_best_coverage_same_size']:.2f}, at B {summary['mean_best_coverage']:.2f}, "
                  f"SR_trees {trees:.2f}, SR* {summary['best_speedup']:.2f} ({time.time() - start:.0f} s)", flush=True)
        out["sets"][name] = answers
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
