"""The command line: `exitspec check` and `exitspec generate` (JSON and streamed), and its error messages."""

import json

import pytest

from exitspec.cli import main


def test_check_prints_a_passing_table(capsys):
    assert main(["check", "--draws", "3000", "--trees", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("predraw", "sequential", "tev", "greedy", "G-test p", "1 + C_p"):
        assert word in out
    assert "✗" not in out


def test_a_bad_argument_gets_a_clear_error(capsys):
    assert main(["generate", "hi", "--model", "/no/such/folder"]) == 2
    assert "/no/such/folder" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_and_stream_on_the_default_model(capsys):
    assert main(["generate", "Count from one to five.", "--max-new-tokens", "12", "--json", "--compare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12 and out["text"] and out["identical_to_autoregressive"]
    assert out["stats"]["tau"] >= 1 and out["speedup"] > 0 and out["settings"]["verifier"] == "tev"
    assert main(["generate", "Count from one to five.", "--max-new-tokens", "12", "--budget", "-1"]) == 2
    assert "budget must be >= 0" in capsys.readouterr().err
    assert main(["generate", "Count from one to five.", "--max-new-tokens", "12", "--temperature", "0.8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "τ" in captured.err
