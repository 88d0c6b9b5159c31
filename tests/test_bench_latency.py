"""The verifier latency benchmark, synthetic mode at toy sizes: JSON fields only, no timing assertions."""

from __future__ import annotations

import json

import pytest

from exitspec.cli import main


def test_synthetic_json(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--synthetic", "--vocab", "64", "--budgets", "4", "8", "--temperatures", "1.0", "0.5", "--top-p", "0.9"]
    argv += ["--depth", "4", "--prompts", "2", "--repeats", "3", "--warmup", "1", "--device", "cpu"]
    assert main(["latency", *argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    table = out.with_suffix(".md").read_text()  # the paper's Table 3 beside it
    assert "| B | N | T | C_p | predraw ms | TEV ms | speedup |" in table and table.count("\n| 4 |") == 2
    assert result["budgets"] == [4, 8] and result["vocab"] == 64 and result["mode"] == "synthetic"
    rows = result["rows"]
    assert [(r["budget"], r["temperature"]) for r in rows] == [(4, 1.0), (4, 0.5), (8, 1.0), (8, 0.5)]
    for row in rows:
        assert 1 <= row["nodes"] <= row["budget"] and row["top_p"] == 0.9
        assert set(row["median_ms"]) == {"warp", "check", "tev_rows", "predraw", "tev", "sequential", "greedy"}
        assert all(ms > 0 for ms in row["median_ms"].values())
        assert row["speedup"] == pytest.approx(row["median_ms"]["predraw"] / row["median_ms"]["tev"])
        stage = row["stage_median_ms"]
        assert stage["predraw"] > 0 and stage["tev"] == row["median_ms"]["tev_rows"] and stage["tev_full_warp"] > 0
        assert row["stage_speedup"] == pytest.approx(stage["predraw"] / stage["tev"])


def test_rejects_bad_arguments(capsys):
    assert main(["latency", "--synthetic", "--budgets", "0"]) == 2
    assert "--budgets: 0 is out of range" in capsys.readouterr().err


def test_forward_stage_json(tmp_path):
    """--stage forward on a tiny Llama: all backends, chain and tree shapes, each size, ratios to the root alone."""
    from tiny_models import save_tiny_llama

    from exitspec.bench.forward import bushy_tree

    save_tiny_llama(tmp_path / "model")
    out = tmp_path / "forward.json"
    argv = ["--stage", "forward", "--model", str(tmp_path / "model"), "--sizes", "0", "3", "6", "--context", "20",
            "--repeats", "2", "--device", "cpu", "--out", str(out)]
    assert main(["latency", *argv]) == 0
    result = json.loads(out.read_text())
    assert [(r["n"], r["shape"]) for r in result["rows"]] == [
        (0, "chain"), (0, "tree"), (3, "chain"), (3, "tree"), (6, "chain"), (6, "tree")]
    for row in result["rows"]:
        for backend in ("transformers", "lean", "decoder"):
            assert row[backend]["ms"] > 0 and row[backend]["steps"] > 0
    assert result["rows"][0]["lean"]["steps"] == 1.0
    tree = bushy_tree(6, 1, 32, "cpu")
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2] and tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 2]


def test_profile_stage_splits_a_forward(tmp_path):
    """--stage profile on a tiny Llama: per N, the total and its parts (products, LM head, attention, the rest)."""
    from tiny_models import save_tiny_llama

    save_tiny_llama(tmp_path / "model")
    out = tmp_path / "profile.json"
    argv = ["--stage", "profile", "--model", str(tmp_path / "model"), "--sizes", "0", "4", "--context", "20",
            "--repeats", "2", "--device", "cpu", "--dtype", "float32", "--out", str(out)]
    assert main(["latency", *argv]) == 0
    result = json.loads(out.read_text())
    assert [r["n"] for r in result["rows"]] == [0, 4] and "row_plan" in result
    for row in result["rows"]:
        parts = row["products_ms"] + row["lm_head_ms"] + row["attention_ms"] + row["other_ms"]
        assert row["total_ms"] > 0 and row["attention_ms"] > 0 and row["lm_head_ms"] > 0
        assert parts == pytest.approx(row["total_ms"])


def test_the_old_spelling_of_a_renamed_option_warns_and_still_works(tmp_path, capsys):
    """`latency --json PATH` became `--out PATH` (`--json` is a flag everywhere else): kept for one release."""
    out = tmp_path / "old.json"
    argv = ["--synthetic", "--vocab", "64", "--budgets", "4", "--temperatures", "1.0", "--depth", "3", "--prompts", "1",
            "--repeats", "1", "--warmup", "0", "--device", "cpu"]
    assert main(["latency", *argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["budgets"] == [4]
    assert "--json is renamed --out here" in capsys.readouterr().err
