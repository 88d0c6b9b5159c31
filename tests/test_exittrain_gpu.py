"""scripts/exittrain-gpu.sh (issue 19's protocol under torchrun) at tiny sizes on the CPU, so the GPU recipe
cannot rot before a GPU is lent: every stage runs, the sweep picks one of its λ, four arms train online on one
stream of chunks, and the evaluation pairs ExitTrain with the init and the three other arms."""

import json
import os
import subprocess
from pathlib import Path

import torch
from tiny_models import save_tiny_llama, save_word_tokenizer

from exitspec.drafters.dflash_model import DFlashModel

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_recipe_runs_every_stage_at_tiny_sizes(tmp_path):
    model = save_tiny_llama(tmp_path / "target")
    save_word_tokenizer(tmp_path / "target")
    torch.manual_seed(0)
    DFlashModel.for_target(model.config, num_layers=1, block_size=4, std=0.5).save_pretrained(tmp_path / "init")
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    with (tmp_path / "data" / "gsm8k" / "train.jsonl").open("w") as f:
        f.writelines(json.dumps({"question": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(4, 14))
    for name, first in (("validation", 10), ("held", 20)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"w{i} w{i + 3} w{i + 1}"}) + "\n" for i in range(first, first + 3)))
    out, runs = tmp_path / "record", tmp_path / "runs"
    env = {**os.environ, "HOME": str(tmp_path), "MODEL": str(tmp_path / "target"), "INIT": str(tmp_path / "init"),
           "DATA_DIR": str(tmp_path / "data"), "DEVICE": "cpu", "NPROC": "1", "OUT": str(out), "RUNS": str(runs),
           "STEPS": "4", "SWEEP": "2", "LAMS": "1 4", "ONLINE": "4", "GSM8K": "-1", "SHAREGPT": "0", "CODE": "0",
           "MAX_NEW_TOKENS": "6", "BUDGET": "4", "ANCHORS": "2", "WARMUP": "1", "SAVE_EVERY": "2", "EVAL_EVERY": "2",
           "VALIDATION": str(tmp_path / "validation.jsonl"), "VALIDATION_PROMPTS": "2",
           "DATASETS": str(tmp_path / "held.jsonl"), "EVAL_PROMPTS": "2", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(ROOT / "scripts/exittrain-gpu.sh")], capture_output=True, text=True,
                         check=False, cwd=ROOT, env=env)
    logs = "".join(p.read_text()[-2000:] for p in out.glob("*.log")) if out.is_dir() else ""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + logs
    lam = (out / "sweep" / "lam.txt").read_text().strip()
    assert lam in ("1", "4")
    for arm in (f"exit-lam{lam}", "none", f"prefix-lam{lam}", "reach-lam6.4"):
        assert (runs / arm / "final" / "model.safetensors").is_file() and (out / arm / "log.jsonl").is_file()
    assert len(list((runs / "online").iterdir())) == 4  # 4 steps × 4 sequences: four chunks of 4, shared by all arms
    report = json.loads((out / "eval" / "heldout.json").read_text())
    assert {p["other"] for p in report["paired"]} == {str(tmp_path / "init"), *(str(runs / a / "final") for a in (
        "none", f"prefix-lam{lam}", "reach-lam6.4"))}
    paired = {(p["budget"], p["temperature"]) for p in report["paired"]}
    assert paired == {(b, t) for b in (32, 64, 128) for t in (0, 1)}
    stages = [line.split("\t")[0] for line in (out / "times.tsv").read_text().splitlines()]
    assert stages == ["sweep-1", "sweep-4", "sweep-eval", "exit", "none", "prefix", "reach", "eval"]
    assert (out / "curve.png").stat().st_size > 0 and (out / "eval" / "exit-by-depth.png").stat().st_size > 0
    again = subprocess.run(["bash", str(ROOT / "scripts/exittrain-gpu.sh")], capture_output=True, text=True,
                           check=False, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((out / "times.tsv").read_text().splitlines()) == len(stages)  # a rerun skips every finished stage
