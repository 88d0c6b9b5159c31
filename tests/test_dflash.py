"""DFlash drafter: released checkpoint layout, block attention semantics, draft cache, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from exitspec.drafters.base import Drafter
from exitspec.drafters.dflash import DFlashDrafter, DFlashProposal
from exitspec.drafters.dflash_model import DFlashConfig, DFlashModel, build_target_layer_ids
from exitspec.tree import DraftTree

VOCAB, HIDDEN, TARGET_LAYERS, BLOCK = 32, 32, 4, 5
MASK_ID = 31


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (72,), generator=torch.Generator().manual_seed(1))


def target_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """[L, F]: outputs of target decoder layers `layer_ids` (HF hidden_states[i+1]), concatenated."""
    with torch.no_grad():
        hidden = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1)


def released_shapes(hidden=HIDDEN, layers=2, heads=4, kv_heads=2, head_dim=16, inter=48, n_ids=2) -> dict:
    """Key -> shape of a z-lab DFlash model.safetensors (DFlashDraftModel state dict)."""
    shapes = {"fc.weight": (hidden, n_ids * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def write_released(
    folder, hidden=HIDDEN, vocab=VOCAB, ids=(0, 2), drop=(), extra=None, reshape=None, dflash_extra=None
) -> dict:
    """A tiny checkpoint in the released format (bf16 tensors, as published); returns its tensors."""
    g = torch.Generator().manual_seed(2)
    tensors = {}
    for key, shape in released_shapes(hidden=hidden, n_ids=len(ids)).items():
        if reshape and key in reshape:
            shape = reshape[key]
        base = torch.ones(shape) if len(shape) == 1 else torch.zeros(shape)
        tensors[key] = (base + 0.2 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    for key in drop:
        del tensors[key]
    tensors |= extra or {}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(ids)} | (dflash_extra or {}),
        "head_dim": 16, "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": 48,
        "layer_types": ["full_attention"] * 2, "max_position_embeddings": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": TARGET_LAYERS,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 5000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": vocab,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.fixture()
def released(tmp_path, target):
    write_released(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def fresh_drafter(target, num_layers=2) -> DFlashDrafter:
    torch.manual_seed(3)
    model = DFlashModel.for_target(target.config, num_layers=num_layers, block_size=BLOCK)
    return DFlashDrafter(model, target.get_input_embeddings(), target.get_output_embeddings())


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_target, num_draft, expected",
    [(36, 5, [1, 9, 17, 25, 33]), (52, 5, [1, 13, 25, 37, 49]), (30, 1, [15]), (28, 1, [14]),
     (32, 3, [1, 15, 29]), (7, 3, [1, 2, 4]), (9, 3, [1, 4, 6]), (4, 2, [1, 1])],
)
def test_default_layer_ids_follow_reference(num_target, num_draft, expected):
    assert build_target_layer_ids(num_target, num_draft) == expected
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=num_target, num_attention_heads=4)
    assert list(DFlashModel.for_target(config, num_layers=num_draft).config.target_layer_ids) == expected


def test_rescaled_fc_gives_every_feature_dim_unit_scale(target):
    """A massive-activation dim (1000× the others) dominates a random fc; rescale_fc divides it out."""
    model = DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK, target_layer_ids=(0, 1))
    g = torch.Generator().manual_seed(0)
    features = torch.randn(500, model.config.feature_size, generator=g) * torch.linspace(0.5, 2, 2 * HIDDEN)
    features[:, 3] = 1000 + torch.randn(500, generator=g)  # a near-constant massive dim
    before = model.fc.weight.clone()
    random_fused = F.normalize(features @ before.T, dim=-1)
    assert (random_fused @ random_fused.T).abs().mean() > 0.9  # every row points along the massive dim
    model.rescale_fc(features)
    rms = features.pow(2).mean(dim=0).sqrt()
    torch.testing.assert_close(model.fc(features), (features / rms) @ before.T)
    fused = F.normalize(model.fc(features), dim=-1)
    assert (fused @ fused.T).abs().mean() < 0.3  # rows no longer share one direction


def test_released_checkpoint_loads_and_drafts(released, target, tokens):
    drafter = DFlashDrafter.from_pretrained(released, target)
    assert isinstance(drafter, Drafter)
    assert drafter.feature_layers == (0, 2) and drafter.block_size == BLOCK
    assert {k: tuple(v.shape) for k, v in drafter.model.state_dict().items()} == released_shapes()
    assert drafter.model.fc.weight.dtype == torch.float32  # the target's dtype

    prompt = tokens[:9]
    drafter.begin(prompt, target_features(target, prompt, drafter.feature_layers)[:-1])
    proposal = drafter.propose(prompt.tolist(), max_depth=10)
    logits = proposal.marginals
    assert logits.shape == (BLOCK - 1, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(drafter.marginals(prompt, max_depth=2), logits[:2])
    assert drafter.marginals(prompt, max_depth=0).shape == (0, VOCAB)
    assert drafter.propose(prompt.tolist(), max_depth=10, cheap=True).marginals is None  # no block forward

    tree = drafter.build(proposal, int(prompt[-1]), budget=6)
    assert isinstance(tree, DraftTree) and tree.num_nodes == 6 and tree.depth <= BLOCK - 1
    assert len(tree.scores) == 7 and list(tree.scores) == sorted(tree.scores, reverse=True)
    model_only = DFlashDrafter.from_pretrained(released, target, suffix_source=False)
    model_only.begin(prompt, target_features(target, prompt, drafter.feature_layers)[:-1])
    assert model_only.propose(prompt.tolist(), max_depth=10).suffix is None
    assert int(model_only.build(DFlashProposal(logits, None), int(prompt[-1]), 6).tokens[1]) == int(logits[0].argmax())
    assert model_only.build(DFlashProposal(logits[:0], None), 7, budget=6).num_nodes == 0


def reference_logits(tensors: dict, target, block_ids: torch.Tensor, ctx_features: torch.Tensor) -> torch.Tensor:
    """The reference DFlash forward, written out eagerly with transformers' RMSNorm and RoPE (Qwen3 shares
    Llama's): context keys/values are each layer's k/v projections of hidden_norm(fc(features)), concatenated
    before the block's, k-normed, and rotated at positions 0..C-1 then C..C+T-1; no mask."""
    w = {k: v.float() for k, v in tensors.items()}
    heads, kv_heads, head_dim = 4, 2, 16
    rope_cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, rope_theta=5000.0, max_position_embeddings=128)

    def norm(x, key):
        module = LlamaRMSNorm(w[key].shape[0], eps=1e-6)
        module.weight.data = w[key]
        return module(x)

    noise = target.get_input_embeddings()(block_ids)[None]  # [1, T, D]
    ctx = norm(F.linear(ctx_features[None], w["fc.weight"]), "hidden_norm.weight")  # [1, C, D]
    c, t = ctx.shape[1], noise.shape[1]
    cos, sin = LlamaRotaryEmbedding(rope_cfg)(noise, torch.arange(c + t)[None])  # [1, C+T, hd]
    cos, sin = cos[:, None], sin[:, None]
    h = noise
    for i in range(2):
        p = f"layers.{i}."
        x = norm(h, p + "input_layernorm.weight")
        wq, wk, wv = (w[p + f"self_attn.{name}_proj.weight"] for name in "qkv")
        q = norm(F.linear(x, wq).view(1, t, heads, head_dim), p + "self_attn.q_norm.weight")
        k = torch.cat([F.linear(ctx, wk), F.linear(x, wk)], 1)  # context keys first, then the block's
        v = torch.cat([F.linear(ctx, wv), F.linear(x, wv)], 1)
        k = norm(k.view(1, c + t, kv_heads, head_dim), p + "self_attn.k_norm.weight").transpose(1, 2)
        v = v.view(1, c + t, kv_heads, head_dim).transpose(1, 2)
        q = q.transpose(1, 2)
        q = q * cos[..., -t:, :] + rotate_half(q) * sin[..., -t:, :]
        k = k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5, dim=-1) @ v  # [1, H, T, hd]
        h = h + F.linear(attn.transpose(1, 2).reshape(1, t, heads * head_dim), w[p + "self_attn.o_proj.weight"])
        x = norm(h, p + "post_attention_layernorm.weight")
        mlp = F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"])
        h = h + F.linear(mlp, w[p + "mlp.down_proj.weight"])
    return target.lm_head(norm(h, "norm.weight"))[0, 1:]


def test_matches_reference_forward(tmp_path, target, tokens):
    tensors = write_released(tmp_path / "ckpt")
    drafter = DFlashDrafter.from_pretrained(tmp_path / "ckpt", target)
    prompt = tokens[:11]
    feats = target_features(target, prompt, drafter.feature_layers)
    drafter.begin(prompt, feats[:-1])
    block_ids = torch.tensor([int(prompt[-1])] + [MASK_ID] * (BLOCK - 1))
    with torch.no_grad():
        expected = reference_logits(tensors, target, block_ids, feats[:-1])
    torch.testing.assert_close(drafter.marginals(prompt, 16), expected, atol=1e-4, rtol=1e-4)


def test_save_load_round_trip(released, tmp_path, target, tokens):
    prompt = tokens[:8]
    for drafter, name in [(DFlashDrafter.from_pretrained(released, target), "a"), (fresh_drafter(target), "b")]:
        feats = target_features(target, prompt, drafter.feature_layers)[:-1]
        drafter.begin(prompt, feats)
        before = drafter.marginals(prompt, 16)
        out = tmp_path / "saved" / name
        drafter.model.save_pretrained(out)
        drafter.model.save_pretrained(out)  # replaces its own earlier save
        assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folders left
        config = json.loads((out / "config.json").read_text())
        keys = set(load_file(out / "model.safetensors"))
        if name == "a":
            assert config["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": MASK_ID}
            assert keys == set(released_shapes())
        else:
            assert config["dflash_config"]["mask_token_id"] is None
            assert config["dflash_config"]["mask_embedding"] == "learned"
            assert keys == set(released_shapes(inter=64, head_dim=8)) | {"mask_embedding"}
        assert config["block_size"] == BLOCK and config["num_target_layers"] == TARGET_LAYERS
        reloaded = DFlashDrafter.from_pretrained(out, target)
        reloaded.begin(prompt, feats)
        assert torch.equal(reloaded.marginals(prompt, 16), before)
    (tmp_path / "saved" / "a" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="other files"):
        drafter.model.save_pretrained(tmp_path / "saved" / "a")


def test_block_attention_semantics(target):
    """Each block sees the context strictly before its anchor and its own slots (both ways), nothing else."""
    model = fresh_drafter(target).model
    g = torch.Generator().manual_seed(4)
    c, f = 12, model.config.feature_size
    feats = torch.randn(1, c, f, generator=g)
    anchors = torch.tensor([[5, 9]])  # block n's anchor at position anchors[n]: it sees context rows < anchor
    embeds = model.block_embeddings(torch.tensor([[3, 7]]), target.get_input_embeddings())  # [1, 2*bs, D]
    positions = (anchors[..., None] + torch.arange(BLOCK)).flatten(1)  # [1, 2*bs]

    def run(feats=feats, embeds=embeds):
        with torch.no_grad():
            out = model(embeds, positions, feats, torch.arange(c)[None], anchors)
        return out[0, :BLOCK], out[0, BLOCK:]

    base0, base1 = run()

    def perturbed_feats(rows):
        out = feats.clone()
        out[0, rows] += 1.0
        return out

    same0, same1 = run(feats=perturbed_feats(slice(9, c)))  # after both anchors
    assert torch.equal(same0, base0) and torch.equal(same1, base1)
    out0, out1 = run(feats=perturbed_feats(slice(5, 9)))  # after anchor 0, before anchor 1
    assert torch.equal(out0, base0) and not torch.allclose(out1, base1)
    out0, out1 = run(feats=perturbed_feats([4]))  # before both
    assert not torch.allclose(out0, base0) and not torch.allclose(out1, base1)

    model.config.context_window = 3  # block n now sees context rows anchor−3 .. anchor−1 only
    windowed0, windowed1 = run()
    near0, near1 = run(feats=perturbed_feats([2, 3, 4, 6]))  # inside window 0; row 6 inside window 1 (6..8)
    far0, far1 = run(feats=perturbed_feats([0, 1, 5]))  # before window 0; 5 is before window 1 (6..8)
    model.config.context_window = None
    assert not torch.allclose(near0, windowed0) and not torch.allclose(near1, windowed1)
    assert torch.equal(far0, windowed0) and torch.equal(far1, windowed1)

    later_block = embeds.clone()
    later_block[0, BLOCK + 2] += 1.0
    out0, out1 = run(embeds=later_block)  # blocks do not see each other
    assert torch.equal(out0, base0) and not torch.allclose(out1, base1)

    last_slot = embeds.clone()
    last_slot[0, BLOCK - 1] += 1.0
    out0, _ = run(embeds=last_slot)  # bidirectional inside a block: the last slot reaches slot 1 and the anchor
    assert not torch.allclose(out0[0], base0[0]) and not torch.allclose(out0[1], base0[1])


@pytest.mark.parametrize("learned_mask, window", [(True, None), (False, None), (True, 5)])
def test_incremental_cache_equals_full_forward(learned_mask, window, released, target, tokens):
    """Drafting from the incremental cache equals the training-style pass, also with a context window."""
    drafter = fresh_drafter(target) if learned_mask else DFlashDrafter.from_pretrained(released, target)
    drafter.model.config.context_window = window
    model, embed = drafter.model, target.get_input_embeddings()
    feats = target_features(target, tokens, drafter.feature_layers)  # [72, F]

    def full_forward(ctx_len: int) -> torch.Tensor:
        """Training-style pass over all 72 context rows, with the block anchored at ctx_len."""
        block = model.block_embeddings(tokens[ctx_len][None, None], embed)
        positions = torch.arange(ctx_len, ctx_len + BLOCK)[None]
        with torch.no_grad():
            hidden = model(block, positions, feats[None], torch.arange(72)[None], torch.tensor([[ctx_len]]))
            return target.lm_head(hidden[0, 1:])

    drafter.begin(tokens[:3], feats[:2])
    torch.testing.assert_close(drafter.marginals(tokens[:3], 16), full_forward(2), atol=1e-5, rtol=1e-5)
    length = 3
    for step in [1, 4, 2, 3, 40, 7, 9]:  # commits: the root plus an accepted path; the cache grows past 64
        drafter.commit(tokens[length - 1 : length - 1 + step], feats[length - 1 : length - 1 + step])
        length += step
        torch.testing.assert_close(
            drafter.marginals(tokens[:length], 16), full_forward(length - 1), atol=1e-5, rtol=1e-5
        )
    assert drafter.cache.length == length - 1 == 68
    with pytest.raises(RuntimeError, match="draft cache holds 68 tokens"):
        drafter.marginals(tokens[: length + 1], 16)


def test_errors_name_the_problem(tmp_path, target, tokens):
    def load(name, **kwargs):
        write_released(tmp_path / name, **kwargs)
        return DFlashDrafter.from_pretrained(tmp_path / name, target)

    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\]"):
        load("missing", drop=["layers.1.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head.weight'\]"):
        load("unexpected", extra={"lm_head.weight": torch.zeros(VOCAB, HIDDEN)})
    with pytest.raises(ValueError, match=r"fc.weight has shape \(32, 96\), the config implies \(32, 64\)"):
        load("shape", reshape={"fc.weight": (HIDDEN, 3 * HIDDEN)})
    with pytest.raises(ValueError, match="hidden_size 48 does not match the target's hidden size 32"):
        load("hidden", hidden=48)
    with pytest.raises(ValueError, match="vocab_size 40 does not match the target's 32"):
        load("vocab", vocab=40)
    with pytest.raises(ValueError, match=r"reads target layers \[0, 5\].*only 4 decoder layers"):
        load("shallow", ids=(0, 5))
    with pytest.raises(ValueError, match=r"uses \['output_multiplier'\], which this drafter does not implement"):
        load("dflash2", dflash_extra={"output_multiplier": 0.2})
    with pytest.raises(ValueError,
                       match=f"trained on a target of 36 decoder layers .* this target has {TARGET_LAYERS}"):
        load("deeper", dflash_extra={"num_target_layers": 36})
    write_released(tmp_path / "torn")
    weights = tmp_path / "torn" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors is not a complete safetensors file"):
        DFlashDrafter.from_pretrained(tmp_path / "torn", target)

    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text((tmp_path / "missing" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        DFlashDrafter.from_pretrained(tmp_path / "pickle", target)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DFlashDrafter.from_pretrained(tmp_path / "nothing", target)

    drafter = fresh_drafter(target)
    with pytest.raises(ValueError, match=r"needs features \[4, 64\]"):
        drafter.begin(tokens[:5], torch.zeros(4, 32))
    with pytest.raises(ValueError, match="needs features"):
        drafter.begin(tokens[:5], None)


def test_dflash_spec_names_the_shipped_drafter(tmp_path, monkeypatch, target):
    """'dflash' loads the drafter folder shipped in exitspec/assets, and says so when an install lacks it."""
    from exitspec import drafters

    monkeypatch.setitem(drafters.SHIPPED, "dflash", tmp_path / "shipped")
    with pytest.raises(ValueError, match="shipped drafter 'dflash' is missing"):
        drafters.load_drafter("dflash", target)
    DFlashModel.for_target(target.config, num_layers=1, block_size=BLOCK).save_pretrained(tmp_path / "shipped")
    monkeypatch.setattr(drafters, "SHIPPED_LOOKUP", tmp_path / "lookup.safetensors")
    drafters.NgramTable.from_sequences([[1, 2, 3]], vocab_size=VOCAB).save(tmp_path / "lookup.safetensors")
    drafter = drafters.load_drafter("dflash", target)
    assert isinstance(drafter, DFlashDrafter) and drafter.block_size == BLOCK
    assert drafter.lookup.next_tokens([2]) == [(3, 0.5)]  # the shipped table comes with a shipped drafter
    assert drafters.load_drafter("dflash", target, lookup="none").lookup is None
    assert drafters.drafter_folder("dflash") == tmp_path / "shipped" and drafters.drafter_folder("ngram") is None


def test_the_shipped_drafter_fits_the_default_model():
    """The one committed drafter folder is safetensors of at most 40 MB and a README with the commands that trained
    it, made for SmolLM2-135M-Instruct's sizes (hidden 576, vocabulary 49152, 30 layers);
    `generate` picks dflash for the default model only."""
    from exitspec import drafters

    assert list(drafters.SHIPPED) == ["dflash"]
    folder = drafters.SHIPPED["dflash"]
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    assert (folder / "model.safetensors").stat().st_size <= 40 * 2**20
    DFlashConfig.load(folder).check_target(hidden_size=576, vocab_size=49152, num_layers=30)
    assert drafters.default_drafter(None) == "dflash" and drafters.default_drafter("some/llama") == "ngram"


def test_a_checkpoint_folder_brings_its_lookup_table(released, target, tmp_path):
    """--lookup auto reads a checkpoint folder's lookup.safetensors when it has one; a table for another
    vocabulary is refused with one line."""
    from exitspec import drafters

    assert drafters.load_drafter(str(released), target).lookup is None
    drafters.NgramTable.from_sequences([[4, 5]], vocab_size=VOCAB).save(released / "lookup.safetensors")
    assert drafters.load_drafter(str(released), target).lookup.next_tokens([4]) == [(5, 0.5)]
    drafters.NgramTable.from_sequences([[4, 5]], vocab_size=7).save(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="vocabulary of 7 tokens, but the target has"):
        drafters.load_drafter(str(released), target, lookup=tmp_path / "other.safetensors")
