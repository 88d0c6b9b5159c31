"""Table 1's T = 0 cells with and without the suffix source, side by side in one bench run: the shipped `dflash`
drafter as it ships (suffix trees over the request and the memory, the corpus table, DFlash's marginals) against
the same drafter with the suffix source off (`DFlashDrafter(suffix_source=False)`), on one target, one cost grid,
one row plan and one autoregressive baseline per prompt (bench's Runner, Plan and report). bf16, tev,
--budget auto, 128 new tokens, 2 threads; warm start and learning off in both arms, so neither starts from state
the other lacks.

    python ab.py OUT N        # the first N prompts of each set (MT-Bench, HumanEval, GSM8K, MATH-500); resumable
"""
import json
import sys
from pathlib import Path

import exitspec
from exitspec.app import load_decoders
from exitspec.bench import report
from exitspec.budget import CostModel
from exitspec.bench.runner import Config, Plan, ResultsFile, Runner, environment, run_plan
from exitspec.data import BUILTIN, load_dataset
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters import SHIPPED, SHIPPED_LOOKUP, DFlashDrafter, NgramTable

out, n = Path(sys.argv[1]), int(sys.argv[2])
exitspec.setup_cpu()
decoders = load_decoders(None, ["dflash"], dtype="bfloat16", threads=2, budgets=["auto"], warm_start=False,
                         learn=False)
shipped = decoders["dflash"]
target = shipped.target
vocab = target.model.get_output_embeddings().weight.shape[0]
drafter = DFlashDrafter.from_pretrained(SHIPPED["dflash"], target.model, suffix_source=False,
                                        lookup=NgramTable.load(SHIPPED_LOOKUP, vocab))
without = SpeculativeDecoder(target, drafter, warm_start=False, learn=False)
without.calibrate(max(shipped.costs), cost=shipped.costs[max(shipped.costs)])
runner = Runner({"dflash": shipped, "dflash-without-suffix": without})
plan = Plan({name: load_dataset(name)[1][:n] for name in BUILTIN},
            [Config("dflash", "auto:32", "tev"), Config("dflash-without-suffix", "auto:32", "tev")], [0.0],
            max_new_tokens=128)
out.mkdir(parents=True, exist_ok=True)
results = ResultsFile(out / "results.jsonl")
if results.envs and results.envs[0].cost:  # resumed: run by the first session's cost grid and row plan, as bench does
    runner.adopt(CostModel.from_dict(results.envs[0].cost))
env = environment(None, runner, ["dflash"])
env.drafters["dflash-without-suffix"] = env.drafters["dflash"]
results.start_session(env)
print(run_plan(plan, runner, results, progress=False), "rows measured")
paths = report.write_report(results.path, out)
print("\n".join(report.main_table_markdown(json.loads(paths["json"].read_text())["table"])))
