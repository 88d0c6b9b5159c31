"""Held-out acceptance: the packed, training-style measurement gives E[τ] = 1 + C_p of exactly the trees the
decode loop would build and verify at each anchor."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.cli import main
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.flow import tree_flow
from exitspec.sampling import SamplingParams, target_probs
from exitspec.target import TargetModel
from exitspec.train.acceptance import measure_acceptance
from exitspec.train.dflash_loss import DFlashObjective
from exitspec.train.heldout import GreedyCheck
from exitspec.train.rollouts import Rollout, RolloutData

VOCAB, BLOCK, BUDGET = 32, 4, 6


@pytest.fixture(scope="module")
def models():
    model = tiny_llama(VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DFlashModel.for_target(model.config, num_layers=1, block_size=BLOCK, std=0.3)
    return model, drafter.eval()


def sequences(lengths: list[int], prompt: int = 5) -> list[Rollout]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return [Rollout(str(i), seq[:prompt], seq[prompt:]) for i, seq in enumerate(ids)]


def inference_taus(model, drafter_model, rollout: Rollout, temperature: float) -> list[float]:
    """1 + C_p of the tree that generate() builds and verifies after each response prefix (every anchor), from
    the drafter's model source alone (train eval scores the drafter, not the copy candidates beside it)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    drafter = DFlashDrafter(drafter_model, embed, head, suffix_source=False)
    target = TargetModel(model, None, drafter.feature_layers)
    ids = torch.tensor(rollout.prompt_ids + rollout.response_ids)
    taus = []
    for a in range(len(rollout.prompt_ids), len(ids) - 1):
        target.reset()
        drafter.begin(ids[: a + 1], target.prefill(ids[:a]))
        tree = drafter.build(drafter.propose(ids[: a + 1].tolist(), BLOCK - 1), int(ids[a]), BUDGET)
        probs = target_probs(target.forward_tree(tree).logits, SamplingParams(temperature))
        taus.append(1.0 + float(tree_flow(tree, probs).coverage))
    return taus


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draft_vocab", [None, list(range(1, VOCAB, 2))])
def test_expected_tau_is_that_of_the_inference_trees(models, temperature, draft_vocab):
    """Also for a drafter over a draft vocabulary (half the tokens): training-side logits, expanded, build the
    trees that inference builds."""
    model, drafter = models
    if draft_vocab is not None:
        drafter = copy.deepcopy(drafter)
        drafter.use_draft_vocab(torch.tensor(draft_vocab))
    rollouts = sequences([20, 16])
    objective = DFlashObjective(drafter, model.get_input_embeddings(), model.get_output_embeddings())
    data = RolloutData(rollouts, max_len=100, seed=0)
    (result,) = measure_acceptance(objective, model, data, [BUDGET], [temperature], anchors=100, progress=False)
    by_rollout = {r.id: inference_taus(model, drafter, r, temperature) for r in rollouts}
    expected = [t for taus in by_rollout.values() for t in taus]
    assert result.trees == len(expected) == 14 + 10
    assert result.tau == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert result.tau_by_sequence == pytest.approx({k: sum(v) / len(v) for k, v in by_rollout.items()}, abs=1e-5)
    assert result.tau > 1.0  # some draft tokens are accepted, so the comparison is not vacuous
    assert sum(result.reach_by_depth[1:]) == pytest.approx(result.tau - 1.0, abs=1e-4)
    assert sum(result.exit_by_depth) == pytest.approx(1.0, abs=1e-4)
    assert result.reach_by_depth[0] == pytest.approx(1.0)


def test_batches_and_several_settings_give_the_same_numbers(models):
    """Padding two responses of different lengths into one forward, and measuring two budgets and two
    temperatures in one pass, changes nothing."""
    model, drafter = models
    objective = DFlashObjective(drafter, model.get_input_embeddings(), model.get_output_embeddings())
    data = RolloutData(sequences([20, 13, 17]), max_len=100, seed=0)
    joint = measure_acceptance(objective, model, data, [3, BUDGET], [0.0, 0.7], anchors=100, batch_size=2,
                               progress=False)
    assert [(r.budget, r.temperature) for r in joint] == [(3, 0.0), (3, 0.7), (BUDGET, 0.0), (BUDGET, 0.7)]
    for r in joint:
        (alone,) = measure_acceptance(objective, model, data, [r.budget], [r.temperature], anchors=100,
                                      progress=False)
        assert alone.trees == r.trees
        assert alone.tau == pytest.approx(r.tau, abs=1e-5)
        assert alone.reach_by_depth == pytest.approx(r.reach_by_depth, abs=1e-4)
        assert alone.tau_by_sequence == pytest.approx(r.tau_by_sequence, abs=1e-5)


def test_eval_command_refuses_a_drafter_without_logits(capsys):
    assert main(["train", "eval", "--drafters", "ngram"]) == 2
    assert "'ngram' and chains have no draft logits" in capsys.readouterr().err


@pytest.mark.parametrize("draft_vocab", [None, list(range(1, VOCAB, 2))])
def test_greedy_check_equals_the_inference_trees_on_greedy_responses(models, draft_vocab):
    """On the target's own greedy responses, GreedyCheck's τ (the tree path the response follows, no target
    forward) is the T = 0 1 + C_p of the trees decoding builds, at every anchor."""
    model, drafter = models
    if draft_vocab is not None:
        drafter = copy.deepcopy(drafter)
        drafter.use_draft_vocab(torch.tensor(draft_vocab))
    gen = torch.Generator().manual_seed(4)
    rollouts = []
    for i in range(3):
        prompt = torch.randint(2, VOCAB, (6,), generator=gen).tolist()
        response = []
        with torch.no_grad():
            for _ in range(12):
                response.append(int(model(torch.tensor([prompt + response])).logits[0, -1].argmax()))
        rollouts.append(Rollout(str(i), prompt, response))
    check = GreedyCheck(model, {"set": rollouts}, drafter.config.target_layer_ids, anchors=100)
    # a kl objective (as a Draft-OPD run's) needs no soft targets here: the check reads only the draft logits
    objective = DFlashObjective(drafter, model.get_input_embeddings(), model.get_output_embeddings(), loss="kl")
    result = check(objective, budget=BUDGET)["set"]
    expected = [t for r in rollouts for t in inference_taus(model, drafter, r, 0.0)]
    assert result["anchors"] == len(expected) == 3 * 11
    assert result["tau"] == pytest.approx(sum(expected) / len(expected), abs=1e-4)
    assert result["tau"] > 1.0
    top1 = []  # depth 1: does the drafter's argmax equal the response's next token?
    inference = DFlashDrafter(drafter, model.get_input_embeddings(), model.get_output_embeddings(), suffix_source=False)
    target = TargetModel(model, None, inference.feature_layers)
    for r in rollouts:
        ids = torch.tensor(r.prompt_ids + r.response_ids)
        for a in range(len(r.prompt_ids), len(ids) - 1):
            target.reset()
            inference.begin(ids[: a + 1], target.prefill(ids[:a]))
            top1.append(int(inference.marginals(ids[: a + 1], 1)[0].argmax()) == int(ids[a + 1]))
    assert result["acc_k"][0] == pytest.approx(sum(top1) / len(top1), abs=1e-4)
