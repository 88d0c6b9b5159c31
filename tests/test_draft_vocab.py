"""Draft vocabulary: the restricted head equals the full one on its tokens, trees never leave it, checkpoints
keep it, and the training losses treat tokens outside it as the rest."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_models import tiny_llama

from exitspec import lean
from exitspec.drafters.dflash import DFlashDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.drafters.vocab import DraftHead, frequent_tokens
from exitspec.lean import Panels
from exitspec.train.dflash_loss import DFlashObjective, target_features

BLOCK = 4
VOCAB_IDS = [1, 2, 3, 5, 8, 13, 21, 30, 31]  # of the tiny target's 32


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def drafter_pair(target) -> tuple[DFlashDrafter, DFlashDrafter]:
    """The same drafter weights over the whole vocabulary and over VOCAB_IDS."""
    torch.manual_seed(0)
    model = DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK, std=0.3)
    small = DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK, std=0.3)
    small.load_state_dict(model.state_dict())
    small.use_draft_vocab(torch.tensor(VOCAB_IDS))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    return (DFlashDrafter(model, embed, head, suffix_source=False),
            DFlashDrafter(small, embed, head, suffix_source=False))


def begun(drafter: DFlashDrafter, target, prompt: torch.Tensor) -> DFlashDrafter:
    feats = target_features(target, prompt[None], torch.tensor([prompt.numel()]), drafter.feature_layers)[0]
    drafter.begin(prompt, feats[:-1])
    return drafter


def test_frequent_tokens_ranks_by_count_and_keeps_end_tokens():
    responses = [[5, 5, 5, 7, 7, 9], [7, 2, 2, 2, 2]]  # counts: 2:4, 5:3, 7:3, 9:1
    assert frequent_tokens(responses, 3, 16).tolist() == [2, 5, 7]  # ties (5, 7) by id
    assert frequent_tokens(responses, 3, 16, always=[15]).tolist() == [2, 5, 15]
    assert frequent_tokens(responses, 6, 16).tolist() == [0, 1, 2, 5, 7, 9]  # then the lowest unused ids
    prompts = [[11, 11, 12, 13, 13, 13, 13]]  # a response token counts 10 times, a prompt token once
    assert frequent_tokens(responses, 5, 16, prompts=prompts).tolist() == [2, 5, 7, 9, 13]
    assert frequent_tokens(responses, 6, 16, prompts=prompts).tolist() == [2, 5, 7, 9, 11, 13]
    with pytest.raises(ValueError, match=r"needs 1..16 tokens"):
        frequent_tokens(responses, 17, 16)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 16\)"):
        frequent_tokens(responses, 3, 16, always=[16])


def test_marginals_equal_the_full_head_on_the_vocabulary(target, monkeypatch):
    full, small = drafter_pair(target)
    prompt = torch.tensor([3, 9, 4, 1, 7, 2, 6])
    a = begun(full, target, prompt).marginals(prompt, 8)  # [H, V]
    b = begun(small, target, prompt).marginals(prompt, 8)
    monkeypatch.setattr(lean, "PANEL_ROWS", 4)
    small.head.panels = Panels(small.head.weight)  # what the drafter sets where panels pay (lean.Panels)
    torch.testing.assert_close(begun(small, target, prompt).marginals(prompt, 8), b)
    inside = torch.zeros(32, dtype=torch.bool)
    inside[VOCAB_IDS] = True
    torch.testing.assert_close(b[:, inside], a[:, inside])
    assert bool(b[:, ~inside].isneginf().all())
    tree = small.build(small.propose(prompt.tolist(), 8), int(prompt[-1]), 40)
    assert tree.size > 1 and set(tree.tokens[1:].tolist()) <= set(VOCAB_IDS)


def test_checkpoint_round_trip_and_bad_vocabularies(tmp_path, target):
    _, small = drafter_pair(target)
    small.model.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dflash_config"]["draft_vocab_size"] == len(VOCAB_IDS)
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert tensors["draft_vocab"].tolist() == VOCAB_IDS
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", target, suffix_source=False)
    prompt = torch.tensor([3, 9, 4, 1, 7, 2, 6])
    assert torch.equal(begun(loaded, target, prompt).marginals(prompt, 8),
                       begun(small, target, prompt).marginals(prompt, 8))

    def broken(vocab, match):
        save_file(tensors | {"draft_vocab": torch.tensor(vocab)}, tmp_path / "d" / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            DFlashDrafter.from_pretrained(tmp_path / "d", target)

    broken([1, 2, 3, 5, 8, 13, 21, 31, 30], "strictly ascending")
    broken([1, 2, 3, 5, 8, 13, 21, 30, 32], r"outside the vocabulary \[0, 32\)")
    broken([1, 2, 3], r"draft_vocab has shape \(3,\), the config implies \(9,\)")
    config["dflash_config"]["draft_vocab_size"] = 40
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, vocab_size=32\], got 40"):
        DFlashDrafter.from_pretrained(tmp_path / "d", target)


def test_block_loss_skips_tokens_outside_and_kl_lumps_their_mass(target):
    torch.manual_seed(1)
    drafter = DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK, std=0.3)
    drafter.use_draft_vocab(torch.tensor(VOCAB_IDS))
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), 2.0, "kl")
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([VOCAB_IDS * 2])[:, :14]  # every token inside ...
    ids[0, 9] = 4  # ... but one
    lengths = torch.tensor([14])
    features = target_features(target, ids, lengths, drafter.config.target_layer_ids)
    anchors, keep = torch.tensor([[3, 6, 8]]), torch.ones(1, 3, dtype=torch.bool)
    probs = torch.softmax(torch.randn(1, 14, 32, generator=g), dim=-1)  # the target's p at every position
    top_p, top_ids = probs.topk(5, dim=-1)
    with torch.no_grad():
        out = objective(ids, features, lengths, anchors, keep, (top_p, top_ids))
    assert out.logits.shape == (1, 3, BLOCK - 1, len(VOCAB_IDS))
    # token 9 (= 4) is slot 3 of anchor 6 and slot 1 of anchor 8: no loss there, never correct
    assert out.weights[0, 1, 2] == 0 and out.weights[0, 2, 0] == 0 and not out.correct[0, 1, 2]
    assert (out.weights[0, 0] > 0).all()
    head = DraftHead(target.get_output_embeddings(), torch.tensor(VOCAB_IDS))
    inside = torch.zeros(32, dtype=torch.bool)
    inside[VOCAB_IDS] = True
    num = den = 0.0
    for j, a in enumerate(anchors[0].tolist()):
        for k in range(1, BLOCK):
            w = float(out.weights[0, j, k - 1])
            if not w:
                continue
            q = torch.zeros(32)
            q[inside] = out.logits[0, j, k - 1].softmax(-1)
            p = torch.zeros(32).scatter(0, top_ids[0, a + k - 1], top_p[0, a + k - 1]) * inside  # top-k, inside
            top = p > 0
            expected = -(p[top] * q[top].log()).sum() - (1 - p.sum()) * torch.log(1 - q[top].sum())
            num, den = num + w * float(expected), den + w
            ce = F.cross_entropy(out.logits[0, j, k - 1], head.columns(ids[0, a + k]))
            assert out.ce[0, j, k - 1].item() == pytest.approx(ce.item(), rel=1e-5)
    assert out.loss.item() == pytest.approx(num / den, rel=1e-4)
