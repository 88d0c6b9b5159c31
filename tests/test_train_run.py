"""DFlash trainer: exact resume, checkpoints without pickle, --init, CLI, and two DDP processes over gloo."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import asdict, replace

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_llama

from exitspec.cli import main
from exitspec.train import dist
from exitspec.train.config import TrainConfig
from exitspec.train.rollouts import Rollout, RolloutData
from exitspec.train.trainer import make_drafter, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target folder and 10 synthetic rollouts (random prompt and response ids) in two shards."""
    root = tmp_path_factory.mktemp("train")
    save_tiny_llama(root / "target")
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(10):
        prompt = torch.randint(2, 32, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(1, 32, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        records.append(json.dumps({"id": f"r{i}", "prompt_ids": prompt, "response_ids": response}) + "\n")
    (root / "rollouts").mkdir()
    (root / "rollouts" / "shard-00000.jsonl").write_text("".join(records[:6]))
    (root / "rollouts" / "shard-00001.jsonl").write_text("".join(records[6:]))
    return root


def config(root, run: str, **kw) -> TrainConfig:
    base = {
        "rollouts": str(root / "rollouts"),
        "run_dir": str(root / run),
        "target": str(root / "target"),
        "block_size": 4,
        "steps": 6,
        "batch_size": 3,
        "anchors": 4,
        "max_len": 24,
        "lr": 1e-2,
        "warmup": 2,
        "save_every": 2,
        "log_every": 1,
        "weight_decay": 0.1,
    }
    return TrainConfig(**{**base, **kw})


def weights(folder) -> dict:
    return load_file(folder / "model.safetensors")


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())]


def test_stopped_and_resumed_run_equals_uninterrupted_run(setup):
    whole = config(setup, "whole")
    train(whole, progress=False)
    split = config(setup, "split")
    train(split, stop_at=3, progress=False)  # checkpoints at steps 2 and 3
    ckpts = setup / "split" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000003"]
    step3 = ckpts / "step-00000003"
    assert sorted(p.name for p in step3.iterdir()) == [
        "drafter",
        "optimizer.safetensors",
        "rng-rank0.json",
        "state.json",
    ]
    assert not (setup / "split" / "final").exists()
    state = json.loads((step3 / "state.json").read_text())
    assert state["step"] == 3 and state["data"]["position"] == 9
    assert state["config"] == json.loads(json.dumps(asdict(split)))
    opt = load_file(step3 / "optimizer.safetensors")
    assert {k.rpartition("/")[2] for k in opt} == {"exp_avg", "exp_avg_sq", "step"}
    assert opt["fc.weight/step"].item() == 3

    import shutil

    shutil.rmtree(step3)  # as if killed while step 3's checkpoint was written: the log has a line past step 2
    assert [s for s, _ in losses(setup / "split")] == [1, 2, 3]
    result = train(split, progress=False)
    assert result.summary["steps_this_run"] == 4
    a, b = weights(setup / "whole" / "final"), weights(setup / "split" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(setup / "split") == losses(setup / "whole")  # step 3 logged once, as in the whole run
    assert all(not f.name.endswith((".pt", ".pth", ".bin", ".pkl")) for f in (setup / "split").rglob("*"))
    summary = json.loads((setup / "whole" / "summary.json").read_text())
    assert summary["step"] == 6 and len(summary["last_window"]["acc_k"]) == 3


def test_resume_refuses_another_configuration(setup):
    train(config(setup, "strict", steps=2), progress=False)
    with pytest.raises(ValueError, match="anchors"):
        train(config(setup, "strict", steps=4, anchors=5), progress=False)


def test_resume_ignores_exit_fields_only_while_no_exit_loss_is_on(setup):
    """λ and the tree budget do nothing in a token-only run (weight none), so they may differ on resume; turning
    the exit loss on for a run trained without it is refused."""
    train(config(setup, "token-only", steps=2, exit_weight="none", lam=1.0), progress=False)
    result = train(config(setup, "token-only", steps=3, exit_weight="none", lam=32.0, budget=8), progress=False)
    assert result.summary["steps_this_run"] == 1
    with pytest.raises(ValueError, match="exit_weight"):
        train(config(setup, "token-only", steps=4, exit_weight="exit", lam=32.0), progress=False)


def test_resume_accepts_the_same_target_layers(setup):
    """target_layers is a tuple in the config and a list in the saved JSON: the same value all the same."""
    train(config(setup, "layers", steps=2, target_layers=(1, 0)), progress=False)
    result = train(config(setup, "layers", steps=3, target_layers=(1, 0)), progress=False)
    assert result.summary["steps_this_run"] == 1
    assert list(result.drafter.config.target_layer_ids) == [1, 0]
    with pytest.raises(ValueError, match="target_layers"):
        train(config(setup, "layers", steps=4, target_layers=(0,)), progress=False)


def test_data_stream_is_a_length_bucketed_permutation_per_epoch():
    """Every epoch deals each sequence once; inside a bucket a step's sequences are neighbours in length, so
    they pad far less than random batches; the order is seeded."""
    g = torch.Generator().manual_seed(1)
    rollouts = [
        Rollout(f"r{i}", [1, 2], list(range(3, 3 + int(n))))
        for i, n in enumerate(torch.randint(2, 300, (96,), generator=g))
    ]
    data = RolloutData(rollouts, max_len=512, seed=4, step_size=4, bucket_steps=6)
    lengths = data.lengths
    padded = {"bucketed": 0, "random": 0}
    for epoch in range(2):
        order = data.epoch_order(epoch)
        assert sorted(order.tolist()) == list(range(96))
        assert data.indices(epoch * 96, 96) == order.tolist()
        for batch, shuffled in zip(order.split(4), torch.randperm(96, generator=g).split(4), strict=True):
            padded["bucketed"] += int(lengths[batch].max() * 4 - lengths[batch].sum())
            padded["random"] += int(lengths[shuffled].max() * 4 - lengths[shuffled].sum())
    assert padded["bucketed"] < padded["random"] / 3
    assert not torch.equal(data.epoch_order(0), data.epoch_order(1))
    assert torch.equal(data.epoch_order(0), RolloutData(rollouts, 512, 4, 4, 6).epoch_order(0))


def test_init_starts_from_a_drafter_checkpoint(setup):
    train(config(setup, "base", steps=2), progress=False)
    cfg = config(setup, "tuned", init=str(setup / "base" / "final"))
    from exitspec.models import load_model_and_tokenizer

    target, _ = load_model_and_tokenizer(cfg.target)
    drafter = make_drafter(cfg, target)
    start = weights(setup / "base" / "final")
    assert all(torch.equal(v, start[k]) for k, v in drafter.state_dict().items())


def test_cli_trains_and_reports_errors(setup, capsys):
    argv = [
        "--target",
        str(setup / "target"),
        "--rollouts",
        str(setup / "rollouts"),
        "--run-dir",
        str(setup / "cli"),
        "--block-size",
        "4",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--anchors",
        "3",
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main(["train", "dflash", *argv]) == 0
    assert (setup / "cli" / "final" / "model.safetensors").is_file()
    assert "accuracy by block position" in capsys.readouterr().out
    assert main(["train", "dflash", *argv[:2], "--rollouts", str(setup / "none"),
                 "--run-dir", str(setup / "cli2")]) == 2
    assert "--rollouts-only" in capsys.readouterr().err


def ddp_worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    result = train(TrainConfig(**cfg), progress=False, device="cpu")
    save_file({k: v.contiguous() for k, v in result.drafter.state_dict().items()}, f"{out}/rank{rank}.safetensors")
    dist.teardown()


def test_two_gloo_processes_end_with_identical_weights(setup):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(setup, "ddp", steps=3, batch_size=2)
    mp.spawn(ddp_worker, args=(2, port, asdict(cfg), str(setup)), nprocs=2)
    w0, w1 = load_file(setup / "rank0.safetensors"), load_file(setup / "rank1.safetensors")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    final = weights(setup / "ddp" / "final")
    assert all(torch.equal(w0[k], final[k]) for k in w0)
    ckpt = setup / "ddp" / "checkpoints" / "step-00000003"
    assert {p.name for p in ckpt.glob("rng-rank*.json")} == {"rng-rank0.json", "rng-rank1.json"}
    assert json.loads((ckpt / "state.json").read_text())["data"]["position"] == 12  # 3 steps × 2 ranks × 2
    # the ranks trained on different sequences: one process on the same batch size ends elsewhere
    train(replace(cfg, run_dir=str(setup / "single")), progress=False)
    single = weights(setup / "single" / "final")
    assert any(not torch.equal(w0[k], single[k]) for k in w0)


def test_drafter_learns_to_read_the_context(tmp_path):
    """Responses alternate two random tokens (a, b, a, b, ...): slot 1 after anchor x_a is x_{a−1}, which only
    the context features hold. Chance is 1/30; a working objective, mask and feature path learn it."""
    save_tiny_llama(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(64):
        a, b = torch.randint(2, 32, (2,), generator=g).tolist()
        prompt = torch.randint(2, 32, (4,), generator=g).tolist()
        lines.append(json.dumps({"id": f"r{i:02d}", "prompt_ids": prompt, "response_ids": [a, b] * 12}) + "\n")
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "shard-00000.jsonl").write_text("".join(lines))
    cfg = TrainConfig(
        rollouts=str(tmp_path / "rollouts"), run_dir=str(tmp_path / "run"), target=str(tmp_path / "target"),
        block_size=4, steps=100, batch_size=8, anchors=8, lr=3e-3, warmup=10, gamma=4, log_every=20,
        save_every=100,
    )
    train(cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[0]["acc_k"][0] < 0.2 and log[-1]["acc_k"][0] > 0.4
    assert log[-1]["loss"] < log[0]["loss"] - 1


def test_training_on_cached_features_equals_training_on_the_target(setup, capsys):
    """--features-only caches the target's features once; a run that reads them (fp32 cache) ends with the
    weights of a run that computes them, and a cache of other layers, or one missing rollouts, is refused."""
    from exitspec.models import load_model_and_tokenizer
    from exitspec.train.features import FeatureStore

    cache = setup / "features"
    argv = ["--target", str(setup / "target"), "--rollouts", str(setup / "rollouts"), "--block-size", "4",
            "--no-progress", "--device", "cpu", "--features", str(cache), "--features-dtype", "float32"]
    assert main(["train", "dflash", *argv, "--features-only"]) == 0
    assert "10 rollouts' features added" in capsys.readouterr().out
    assert main(["train", "dflash", *argv, "--features-only"]) == 0  # resumable: nothing left to add
    assert "0 rollouts' features added" in capsys.readouterr().out
    plain = train(config(setup, "plain"), progress=False, device="cpu")
    cached = train(config(setup, "cached", features=str(cache)), progress=False, device="cpu")
    for name, tensor in plain.drafter.state_dict().items():
        torch.testing.assert_close(cached.drafter.state_dict()[name], tensor, atol=1e-5, rtol=1e-4)
    layers = make_drafter(config(setup, "x"), load_model_and_tokenizer(setup / "target")[0]).config.target_layer_ids
    with pytest.raises(ValueError, match="this run reads layers"):
        FeatureStore(cache, [*layers, 0], str((setup / "target").resolve()))
    store = FeatureStore(cache, layers, str((setup / "target").resolve()))
    with pytest.raises(ValueError, match="lacks the features of 1 rollouts"):
        store.check_covers(["r0", "nope"])


def test_kl_distillation_trains_on_a_topk_cache(setup, capsys):
    """--topk caches the target's next-token distribution; --loss kl (Draft-OPD) and ce+kl train on it, the
    whole-vocabulary kl moves the weights away from ce's, and kl without such a cache is refused."""
    cache = setup / "features-topk"
    argv = ["--target", str(setup / "target"), "--rollouts", str(setup / "rollouts"), "--block-size", "4",
            "--no-progress", "--device", "cpu", "--features", str(cache)]
    assert main(["train", "dflash", *argv, "--features-only", "--topk", "32"]) == 0  # 32 = the whole vocabulary
    runs = {loss: train(config(setup, f"loss-{loss}", features=str(cache), loss=loss), progress=False, device="cpu")
            for loss in ("ce", "kl", "ce+kl")}
    for loss, result in runs.items():
        window = result.summary["last_window"]
        assert window["loss"] > 0 and math.isfinite(window["loss"]), loss
    fc = {loss: r.drafter.state_dict()["fc.weight"] for loss, r in runs.items()}
    assert not torch.allclose(fc["ce"], fc["kl"]) and not torch.allclose(fc["kl"], fc["ce+kl"])
    from exitspec.models import load_model_and_tokenizer
    from exitspec.train.dflash_loss import target_features
    from exitspec.train.features import FeatureStore
    from exitspec.train.rollouts import load_rollouts

    target = load_model_and_tokenizer(setup / "target")[0]
    layers = runs["kl"].drafter.config.target_layer_ids
    store = FeatureStore(cache, layers, str((setup / "target").resolve()))
    r = load_rollouts(setup / "rollouts")[3]
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    lengths = torch.tensor([ids.shape[1]])
    with torch.no_grad():
        probs, top_ids = target(ids).logits.softmax(-1).topk(32, dim=-1)  # [1, L, 32]
    cached_p, cached_i = store.soft_targets([r.id], lengths, "cpu")
    assert torch.equal(cached_i, top_ids)
    torch.testing.assert_close(cached_p, probs, atol=1e-3, rtol=1e-3)  # stored in fp16
    features = store.batch([r.id], lengths, "cpu", torch.float32)
    torch.testing.assert_close(features, target_features(target, ids, lengths, layers), atol=1e-2, rtol=1e-3)
    small = train(config(setup, "kl-vocab", features=str(cache), loss="kl", draft_vocab=12), progress=False,
                  device="cpu")  # a draft vocabulary of the 12 most frequent response tokens
    assert small.drafter.draft_vocab.numel() == 12 and math.isfinite(small.summary["last_window"]["loss"])
    counts = torch.bincount(torch.tensor([t for r in load_rollouts(setup / "rollouts") for t in r.response_ids]))
    assert int(counts.argmax()) in small.drafter.draft_vocab.tolist()
    with pytest.raises(ValueError, match="needs --features DIR"):
        config(setup, "nope", loss="kl")
    plain = [*argv[:-1], str(setup / "features-plain")]
    assert main(["train", "dflash", *plain, "--features-only"]) == 0  # no --topk: features alone
    assert main(["train", "dflash", *plain, "--run-dir", str(setup / "r"), "--steps", "1", "--loss", "kl"]) == 2
    assert "holds no top-k probabilities" in capsys.readouterr().err


def test_held_out_check_is_logged_every_n_steps(setup, tmp_path):
    """--eval-every N: the target answers the held-out prompts once (cached), and the log gets τ at T = 0 and
    top-1 accuracy per depth on them every N steps and at the end."""
    from tiny_models import save_word_tokenizer

    from exitspec.train.curve import read_curve
    from exitspec.train.rollouts import load_rollouts

    save_tiny_llama(tmp_path / "target")
    save_word_tokenizer(tmp_path / "target")
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("w1 w2 w3", "w4 w5", "w6 w7 w8 w9")))
    cfg = config(setup, "eval", target=str(tmp_path / "target"), steps=5, eval_every=3,
                 eval_dir=str(tmp_path / "heldout"), eval_datasets=(str(held),), eval_prompts=2)
    train(cfg, progress=False)
    rows = [r for r in map(json.loads, (setup / "eval" / "log.jsonl").read_text().splitlines()) if "heldout" in r]
    assert [r["step"] for r in rows] == [3, 5]
    result = rows[-1]["heldout"]["held"]
    assert result["anchors"] > 0 and 1.0 <= result["tau"] <= 4.0 and len(result["acc_k"]) == 3
    assert [r.id for r in load_rollouts(tmp_path / "heldout" / "held")] == ["held/0", "held/1"]
    curve = read_curve(setup / "eval")  # `exitspec train curve`: the same checks against tokens trained on
    assert [p["step"] for p in curve] == [3, 5] and 0 < curve[0]["tokens"] < curve[1]["tokens"]
    assert curve[1]["heldout"] == rows[-1]["heldout"]
    assert main(["train", "curve", str(setup / "eval"), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert main(["train", "curve", str(tmp_path)]) == 2  # no log.jsonl there: one line, exit code 2


def test_online_training_answers_fresh_prompts_and_resumes_exactly(tmp_path):
    """--online C: the target answers C prompts at a time as training reaches them, chunks alternating greedy
    and T = 1, the prompt list wrapping around with a new sampling seed; a chunk is a function of its index
    (remade identically), so a stopped and resumed run ends where an uninterrupted one does."""
    import shutil

    from tiny_models import save_word_tokenizer

    from exitspec.train.rollouts import load_rollouts

    save_tiny_llama(tmp_path / "target")
    save_word_tokenizer(tmp_path / "target")
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    questions = [f"w{i} w{i + 1} w{i + 2}" for i in range(4, 11)]  # 7 prompts
    with (tmp_path / "data" / "gsm8k" / "train.jsonl").open("w") as f:
        f.writelines(json.dumps({"question": q}) + "\n" for q in questions)
    online = {"online": 4, "gsm8k": -1, "sharegpt": 0, "max_new_tokens": 6, "data_dir": str(tmp_path / "data"),
              "target": str(tmp_path / "target"), "rollouts": str(tmp_path / "unused"), "batch_size": 2}
    whole = train(config(tmp_path, "whole", **online), progress=False)  # 6 steps of 2: 3 chunks of 4 prompts
    chunks = sorted((tmp_path / "whole" / "online").iterdir())
    assert [c.name for c in chunks] == ["chunk-00000", "chunk-00001", "chunk-00002"]
    ids = [[r.id.removeprefix("rank-0/gsm8k-train/") for r in load_rollouts(c)] for c in chunks]
    assert ids == [["0", "1", "2", "3"], ["0@1", "4", "5", "6"], ["1@1", "2@1", "3@1", "4@1"]]  # the list wraps
    temperatures = [json.loads((c / "rank-0" / "meta.json").read_text())["temperature"] for c in chunks]
    assert temperatures == [0.0, 1.0, 0.0]
    assert all(1 <= len(r.response_ids) <= 6 for c in chunks for r in load_rollouts(c))

    split = config(tmp_path, "split", **online)
    train(split, stop_at=3, progress=False)  # mid chunk 1
    shutil.rmtree(tmp_path / "split" / "online" / "chunk-00001")  # lost: remade from its index alone
    resumed = train(split, progress=False)
    assert resumed.summary["step"] == 6
    for a, b in zip(chunks, sorted((tmp_path / "split" / "online").iterdir()), strict=True):
        assert load_rollouts(a) == load_rollouts(b)
    for name, tensor in weights(tmp_path / "whole" / "final").items():
        torch.testing.assert_close(weights(tmp_path / "split" / "final")[name], tensor, rtol=0, atol=0)
    assert whole.summary["step"] == 6
    with pytest.raises(ValueError, match="--online makes its rollouts"):
        config(tmp_path, "bad", **online, features=str(tmp_path / "features"))
    argv = ["--target", str(tmp_path / "target"), "--data-dir", str(tmp_path / "data"), "--gsm8k", "-1", "--sharegpt",
            "0", "--max-new-tokens", "6", "--online", "4", "--online-temperatures", "1", "--run-dir",
            str(tmp_path / "exit"), "--steps", "2", "--batch-size", "2", "--anchors", "2", "--block-size", "4",
            "--budget", "4", "--no-progress", "--device", "cpu"]
    assert main(["train", "exit", *argv]) == 0  # ExitTrain online (issue 19's setting), from the command line
    meta = json.loads((tmp_path / "exit" / "online" / "chunk-00000" / "rank-0" / "meta.json").read_text())
    assert meta["temperature"] == 1.0 and (tmp_path / "exit" / "final").is_dir()
