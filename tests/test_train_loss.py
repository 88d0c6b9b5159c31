"""DFlash training objective: anchors, per-position weights, masking past the end, block isolation, accuracy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_llama

from exitspec.drafters.dflash_model import DFlashModel
from exitspec.train.dflash_loss import DFlashObjective, position_weights, sample_anchors, target_features
from exitspec.train.trainer import Window

BLOCK, GAMMA = 4, 2.0


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def objective(target) -> DFlashObjective:
    torch.manual_seed(0)
    drafter = DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK, std=0.2)
    return DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), GAMMA)


@pytest.fixture(scope="module")
def batch(target):
    """Two right-padded sequences (lengths 12 and 9, responses from 4 and 3) and their target features."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 32, (2, 12), generator=g)
    lengths, starts = torch.tensor([12, 9]), torch.tensor([4, 3])
    ids[1, 9:] = 0
    features = target_features(target, ids, lengths, [1])
    return ids, starts, lengths, features


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert torch.allclose(w, torch.tensor([math.exp(-(k - 1) / 7.0) for k in range(1, 16)]))
    assert w[0] == 1.0


def test_sample_anchors_lie_in_the_response_and_are_distinct():
    g = torch.Generator().manual_seed(0)
    starts, lengths = torch.tensor([3, 10, 5, 0]), torch.tensor([20, 12, 30, 2])
    for n in (1, 4, 50):
        anchors, keep = sample_anchors(starts, lengths, n, g)
        for b in range(4):
            kept = anchors[b][keep[b]].tolist()
            valid = int(lengths[b] - 1 - starts[b])
            assert len(kept) == min(n, valid) and len(set(kept)) == len(kept) and kept == sorted(kept)
            assert all(starts[b] <= a < lengths[b] - 1 for a in kept)
            assert (anchors[b][~keep[b]] == 0).all()
        assert anchors.shape[1] == min(n, 24)  # the most valid anchors: 5 <= a < 29
    with pytest.raises(ValueError, match="two tokens"):
        sample_anchors(torch.tensor([5]), torch.tensor([6]), 4, g)


def test_target_features_of_a_padded_batch_equal_single_sequences(target, batch):
    ids, _, lengths, features = batch
    assert features.shape == (2, 12, 32)
    for b in range(2):
        n = int(lengths[b])
        alone = target_features(target, ids[b : b + 1, :n], lengths[b : b + 1], [1])[0]
        torch.testing.assert_close(features[b, :n], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_ids", [[0], [2, 0], [3], [1, 3]])
def test_target_features_stop_early_and_equal_hidden_states(layer_ids):
    """Taps of layers before the last come from a forward cut after the deepest one; the last layer's tap is
    HF's final-normed hidden_states[L]. Either way the features are hidden_states[i+1] of a full forward."""
    model = tiny_llama(num_hidden_layers=4)
    ids = torch.randint(2, 32, (2, 10), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([10, 7])
    mask = (torch.arange(10) < lengths[:, None]).long()
    full = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    expected = torch.cat([full[i + 1] for i in layer_ids], dim=-1)
    ran = []
    handle = model.model.layers[3].register_forward_hook(lambda *_: ran.append(True))
    features = target_features(model, ids, lengths, layer_ids)
    handle.remove()
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(features[b, :n], expected[b, :n], atol=1e-5, rtol=1e-5)
    assert bool(ran) == (3 in layer_ids)  # the last layer runs only when it is tapped


def manual_block(objective, ids, features, b, a):
    """Logits [bs−1, V] of one block anchored at a, run alone on the context rows before it."""
    drafter = objective.drafter
    block = drafter.block_embeddings(ids[b : b + 1, a : a + 1], objective.embed)  # [1, bs, D]
    positions = torch.arange(a, a + BLOCK)[None]
    hidden = drafter(block, positions, features[b : b + 1, :a], torch.arange(a)[None], torch.tensor([[a]]))
    return objective.lm_head(hidden[0, 1:])


def test_loss_is_the_decayed_mean_of_per_block_cross_entropies(objective, batch):
    ids, _, lengths, features = batch
    anchors, keep = torch.tensor([[4, 7, 10], [3, 7, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        out = objective(ids, features, lengths, anchors, keep)
    num = den = 0.0
    for b in range(2):
        for j in range(3):
            if not keep[b, j]:
                assert (out.weights[b, j] == 0).all() and not out.correct[b, j].any()
                continue
            a = int(anchors[b, j])
            with torch.no_grad():
                logits = manual_block(objective, ids, features, b, a)
            for k in range(1, BLOCK):
                w = math.exp(-(k - 1) / GAMMA) if a + k < lengths[b] else 0.0  # masked past the end
                assert out.weights[b, j, k - 1].item() == pytest.approx(w)
                if w:
                    ce = F.cross_entropy(logits[k - 1], ids[b, a + k]).item()
                    assert out.ce[b, j, k - 1].item() == pytest.approx(ce, rel=1e-4, abs=1e-5)
                    assert out.correct[b, j, k - 1].item() == (logits[k - 1].argmax().item() == ids[b, a + k].item())
                    num, den = num + w * ce, den + w
    assert out.weights[0, 2].tolist() == [1.0, 0.0, 0.0]  # anchor 10 of 12: only slot 1 is inside the sequence
    assert out.loss.item() == pytest.approx(num / den, rel=1e-4)


def test_blocks_do_not_see_context_at_or_after_their_anchor(objective, batch):
    ids, _, lengths, features = batch
    anchors, keep = torch.tensor([[4, 6, 9], [3, 5, 7]]), torch.ones(2, 3, dtype=torch.bool)
    with torch.no_grad():
        base = objective(ids, features, lengths, anchors, keep)
        changed = features.clone()
        changed[:, 6:] += torch.randn_like(changed[:, 6:])  # features of positions >= 6
        out = objective(ids, changed, lengths, anchors, keep)
    torch.testing.assert_close(out.ce[:, :2], base.ce[:, :2], atol=1e-6, rtol=0)  # anchors <= 6: blind to it
    assert (out.ce[:, 2] - base.ce[:, 2]).abs().max() > 1e-3  # anchors 9 and 7 do see position 6


def test_padding_and_other_sequences_do_not_leak(objective, batch):
    ids, _, lengths, features = batch
    anchors, keep = torch.tensor([[4, 8], [3, 6]]), torch.ones(2, 2, dtype=torch.bool)
    with torch.no_grad():
        base = objective(ids, features, lengths, anchors, keep)
        ids2, features2 = ids.clone(), features.clone()
        ids2[1, 9:] = 5  # padding ids of row 1
        features2[1, 9:] = 7.0  # and its padding features
        out = objective(ids2, features2, lengths, anchors, keep)
    torch.testing.assert_close(out.ce * out.weights, base.ce * base.weights, atol=1e-6, rtol=0)


def test_only_the_drafter_gets_gradients(objective, batch):
    ids, starts, lengths, features = batch
    anchors, keep = sample_anchors(starts, lengths, 4, torch.Generator().manual_seed(0))
    objective.zero_grad(set_to_none=True)
    objective(ids, features, lengths, anchors, keep).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in objective.drafter.parameters())
    assert objective.embed.weight.grad is None and objective.lm_head.weight.grad is None
    objective.zero_grad(set_to_none=True)


def test_accuracy_is_reported_per_block_position(objective, batch):
    ids, _, lengths, features = batch
    anchors, keep = torch.tensor([[4, 10], [3, 7]]), torch.ones(2, 2, dtype=torch.bool)
    with torch.no_grad():
        out = objective(ids, features, lengths, anchors, keep)
    window = Window(BLOCK, torch.device("cpu"))
    window.add(out, tokens=21, grad_norm=torch.tensor(1.0))
    metrics = window.reduce(world=1)
    valid = out.weights > 0
    for k in range(1, BLOCK):
        expected = out.correct[..., k - 1].sum().item() / valid[..., k - 1].sum().item()
        assert metrics["acc_k"][k - 1] == pytest.approx(expected, abs=1e-5)
    assert valid[..., 2].sum() == 2  # anchors 10 of 12 and 7 of 9 have no third slot
    assert metrics["tokens"] == 21
    assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-6)


def test_soft_cross_entropy_is_the_partition_cross_entropy():
    """With the whole vocabulary in the top-k it is H(p, q); with a one-hot p it is the token cross-entropy."""
    from exitspec.train.dflash_loss import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 7, generator=g)  # [B, N, S, V]
    target = torch.softmax(torch.randn(2, 5, 7, generator=g), dim=-1)  # [B, L, V]: p at every position
    positions = torch.randint(0, 5, (2, 3, 4), generator=g)  # [B, N, S]
    p_full, i_full = target.topk(7, dim=-1)
    got = soft_cross_entropy(logits.log_softmax(-1), p_full, i_full, positions)
    p_at = target.gather(1, positions.flatten(1)[..., None].expand(-1, -1, 7)).view(2, 3, 4, 7)
    torch.testing.assert_close(got, -(p_at * logits.log_softmax(-1)).sum(-1))
    p2, i2 = target.topk(2, dim=-1)  # the rest lumped: −Σ p_i log q_i − r log(1 − Σ q_i) over the top 2
    got2 = soft_cross_entropy(logits.log_softmax(-1), p2, i2, positions)
    q = logits.softmax(-1)
    top = i2.gather(1, positions.flatten(1)[..., None].expand(-1, -1, 2)).view(2, 3, 4, 2)
    pp = p2.gather(1, positions.flatten(1)[..., None].expand(-1, -1, 2)).view(2, 3, 4, 2)
    q_top = q.gather(-1, top)
    expected = -(pp * q_top.log()).sum(-1) - (1 - pp.sum(-1)) * (1 - q_top.sum(-1)).log()
    torch.testing.assert_close(got2, expected)
    one_hot = torch.ones(2, 5, 1)  # p = 1 on token 3 everywhere: the plain cross-entropy
    ce = -logits.log_softmax(-1)[..., 3]
    soft = soft_cross_entropy(logits.log_softmax(-1), one_hot, torch.full((2, 5, 1), 3), positions)
    torch.testing.assert_close(soft, ce)
