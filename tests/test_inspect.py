"""`exitspec inspect` on a tiny Llama with token-id prompts: the exit law per round, decoding unchanged, the plot."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import save_tiny_llama, tiny_llama

from exitspec.cli import main
from exitspec.decode import SpeculativeDecoder
from exitspec.drafters import load_drafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.exits import best_tree, tree_layout
from exitspec.flow import tree_flow
from exitspec.models import load_model_and_tokenizer
from exitspec.sampling import SamplingParams
from exitspec.target import TargetModel
from exitspec.tree import DraftTree

PROMPT = "5 6 7 8 5 6 7 8 5 6"
ROUNDS, BUDGET, TEMPERATURE, SEED = 8, 6, 0.8, 1
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    model = save_tiny_llama(root / "model")
    torch.manual_seed(0)
    DFlashModel.for_target(model.config, num_layers=1, block_size=5, std=0.2).save_pretrained(root / "drafter")
    return root


def test_json_report_follows_the_exit_law_and_leaves_decoding_unchanged(folders, capsys):
    png = folders / "dflash.png"
    argv = [PROMPT, "--ids", "--model", str(folders / "model"), "--drafter", str(folders / "drafter"), "--rounds",
            str(ROUNDS), "--budget", str(BUDGET), "--temperature", str(TEMPERATURE), "--seed", str(SEED), "--top", "3",
            "--plot", str(png), "--dtype", "float32", "--json"]  # fmt: skip  (the fp32 model the checks reload)
    assert main(["inspect", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.read_bytes().startswith(PNG_MAGIC) and out["plot"] == str(png)
    rounds = out["rounds"]
    assert len(rounds) == ROUNDS and out["text"] is not None and any(r["accepted"] for r in rounds)

    model, _ = load_model_and_tokenizer(folders / "model")
    context = [int(t) for t in PROMPT.split()]
    assert out["prompt_ids"] == context
    for r in rounds:
        tree = DraftTree.from_parents(r["tree"]["parents"], r["tree"]["tokens"])
        path = r["tree"]["accepted_path"]
        assert r["tree_size"] == tree.num_nodes == BUDGET and r["tau"] == r["accepted"] + 1 == len(path) + 1
        assert int(tree.tokens[0]) == context[-1]
        # the exit law from separate causal forwards over context + root-to-node path
        with torch.no_grad():
            logits = torch.stack(
                [model(input_ids=torch.tensor([context + tree.tokens[tree.path(u)].tolist()])).logits[0, -1]
                 for u in range(tree.size)]
            )  # fmt: skip
        flow = tree_flow(tree, torch.softmax(logits.double() / TEMPERATURE, dim=-1))
        w = torch.tensor(r["tree"]["w"], dtype=torch.float64)
        torch.testing.assert_close(w, flow.exit, atol=1e-5, rtol=0)
        assert r["coverage"] == pytest.approx(float(flow.coverage), abs=1e-5)
        assert r["exit_root"] == r["exit_by_depth"][0] == float(w[0])
        assert sum(r["exit_by_depth"]) == pytest.approx(1.0, abs=1e-6)
        top = r["top_exits"]
        assert [e["w"] for e in top] == sorted(w.tolist(), reverse=True)[:3]
        for e in top:
            assert e["tokens"] == tree.tokens[tree.path(e["node"])].tolist() and e["depth"] == len(e["tokens"])
            assert e["accepted"] == (e["node"] == 0 or e["node"] in path)
        context += tree.tokens[path].tolist() + [r["bonus"]]
    assert context[len(out["prompt_ids"]) :] == out["token_ids"]

    drafter = load_drafter(folders / "drafter", model)
    plain = SpeculativeDecoder(TargetModel(model, None, drafter.feature_layers), drafter).generate(
        out["prompt_ids"], max_new_tokens=ROUNDS * (BUDGET + 1) + 1, temperature=TEMPERATURE, budget=BUDGET, seed=SEED
    )
    assert plain.tokens[: len(out["token_ids"])] == out["token_ids"]
    assert [s.accepted for s in plain.rounds[:ROUNDS]] == [r["accepted"] for r in rounds]


def test_text_report_and_plot_with_the_ngram_drafter(folders, capsys):
    png = folders / "ngram.png"
    argv = [PROMPT, "--ids", "--model", str(folders / "model"), "--drafter", "ngram", "--rounds", "3", "--budget",
            "8", "--plot", str(png), "--plot-round", "1"]  # fmt: skip
    assert main(["inspect", *argv]) == 0
    out = capsys.readouterr().out
    assert "round 0: N=" in out and "round 2: N=" in out and "(root)" in out and "mean τ" in out
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_best_tree_holds_the_most_probable_sequences(folders):
    """Optimality, checked independently: every node's P(u) from separate causal forwards, and no sequence left
    out has a larger P than the least node kept (P falls along paths, so checking the tree's children suffices)."""
    model, _ = load_model_and_tokenizer(folders / "model")
    target, params = TargetModel(model), SamplingParams(TEMPERATURE)
    context = [int(t) for t in PROMPT.split()]
    target.prefill(torch.tensor(context[:-1]))
    tree = best_tree(target, context[-1], 7, params)
    assert tree.num_nodes == 7 and target.cache_len == len(context) - 1
    reach = list(tree.scores)
    assert reach[1:] == sorted(reach[1:], reverse=True)
    with torch.no_grad():
        probs = torch.stack([
            torch.softmax(model(input_ids=torch.tensor([context[:-1] + tree.tokens[[0, *tree.path(u)]].tolist()]))
                          .logits[0, -1].double() / TEMPERATURE, dim=-1)
            for u in range(tree.size)
        ])  # fmt: skip  # [N+1, V]: p_u
    for u in range(1, tree.size):
        parent = tree.parent_list[u]
        assert reach[u] == pytest.approx(reach[parent] * float(probs[parent, tree.token_list[u]]), rel=1e-4)
    left_out = [reach[u] * float(probs[u, x]) for u in range(tree.size) for x in range(probs.shape[1])
                if x not in [tree.token_list[c] for c in tree.children[u]]]  # fmt: skip
    assert max(left_out) <= min(reach[1:]) * (1 + 1e-4)


def test_best_tree_stays_inside_the_context():
    for context, depth in [(64, 4), (12, 2)]:  # a peaked warp: without the limit the best tree is 4 deep
        target = TargetModel(tiny_llama(max_position_embeddings=context))
        target.prefill(torch.arange(1, 10))  # 9 cached tokens: in 12 positions, a root and 2 levels fit
        tree = best_tree(target, 10, 6, SamplingParams(0.15))
        assert tree.num_nodes == 6 and tree.depth == depth


def test_oracle_report_bounds_every_round(folders, capsys):
    argv = [PROMPT, "--ids", "--model", str(folders / "model"), "--drafter", "ngram", "--rounds", "4", "--budget",
            "6", "--temperature", str(TEMPERATURE), "--oracle", "--plot", "", "--dtype", "float32",
            "--json"]  # fmt: skip
    assert main(["inspect", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    for r in out["rounds"]:
        assert r["coverage"] <= r["best_coverage_same_size"] + 1e-5 <= r["best_coverage"] + 2e-5
    summary = out["summary"]
    assert summary["best_speedup"] > 0 and len(summary["best_sizes"]) == len(out["rounds"])
    # each round's bound is the best tree after that round's own context (the cache advanced correctly)
    model, _ = load_model_and_tokenizer(folders / "model")
    target, context = TargetModel(model), out["prompt_ids"] + out["token_ids"]
    emitted = [r["accepted"] + 1 for r in out["rounds"]]
    for r, rnd in enumerate(out["rounds"]):
        target.reset()
        end = len(out["prompt_ids"]) + sum(emitted[:r])
        target.prefill(torch.tensor(context[: end - 1]))
        tree = best_tree(target, context[end - 1], 6, SamplingParams(TEMPERATURE))
        assert rnd["best_coverage"] == pytest.approx(sum(tree.scores[1:]), rel=1e-4)


def test_errors_are_clear(folders, capsys):
    model = ["--model", str(folders / "model"), "--plot", ""]
    assert main(["inspect", "hello", *model]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["inspect", PROMPT, "--ids", "--rounds", "2", "--plot-round", "5", *model]) == 2
    assert "--plot-round 5" in capsys.readouterr().err


def test_tree_layout_puts_parents_between_their_children():
    tree = DraftTree.from_parents([-1, 0, 0, 1, 1, 2], [9, 1, 2, 3, 4, 5])
    xy = tree_layout(tree)
    assert xy[:, 0].tolist() == [0, 1, 1, 2, 2, 2]
    assert xy[[3, 4, 5], 1].tolist() == [0, 1, 2]  # leaves in depth-first sibling order
    assert xy[1, 1] == 0.5 and xy[2, 1] == 2 and xy[0, 1] == 1.25
