"""scripts/gpu-record.sh at tiny shapes on the CPU, as CI runs it, so the GPU record cannot rot before a GPU is lent."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_record_runs_at_tiny_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "record"
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu-record.sh"), "--tiny", "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, check=False, cwd=ROOT,
                         env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((out / "record.json").read_text())
    shape = record["shapes"]["tiny-qwen3"]
    assert [r["n"] for r in shape["forward"]] == [0, 1, 2, 4, 8, 16, 32, 64]
    assert shape["greedy"]["equal"]  # fp32 on the CPU: the tree forward agrees with the steps
    assert shape["rounds"]["counts"]["syncs_total"] <= 3 and shape["projected_sr"] > 0
    assert record["table3"]["rows"] and "passed" in (out / "log.txt").read_text()
