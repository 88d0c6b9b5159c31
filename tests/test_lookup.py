"""Corpus lookup: the n-gram table of the target's responses, its best-first trees, its file and its command."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tiny_models import save_tiny_llama

from exitspec.build import build_best_first
from exitspec.cli import main
from exitspec.drafters.lookup import MAX_NODES, NgramTable


def test_estimates_are_add_one_counts_of_the_longest_known_context():
    table = NgramTable.from_sequences([[1, 2, 3, 1, 2, 4, 1, 2, 3]], vocab_size=8, orders=2, width=4)
    assert table.next_tokens([1]) == [(2, 3 / 4)]  # 1 → 2 three times: 3 / (3 + 1)
    assert table.next_tokens([1, 2]) == [(3, 2 / 4), (4, 1 / 4)]  # most frequent first
    assert table.next_tokens([7, 2]) == table.next_tokens([2])  # (7, 2) unseen: back off to (2,)
    assert table.next_tokens([5]) == [] and table.next_tokens([]) == []
    narrow = NgramTable.from_sequences([[1, 2, 3, 1, 2, 4, 1, 2, 3]], vocab_size=8, orders=2, width=1)
    assert narrow.next_tokens([1, 2]) == [(3, 2 / 4)]
    frequent = NgramTable.from_sequences([[1, 2, 3, 1, 2, 4, 1, 2, 3]], vocab_size=8, orders=2, min_count=3)
    assert {c for c, _ in frequent.items()} == {(1,), (2,), (1, 2)}  # (3,), (2, 3), ... were seen once or twice
    with pytest.raises(ValueError, match="outside the target's vocabulary of 8"):
        NgramTable.from_sequences([[1, 9]], vocab_size=8)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=2, max_size=12), min_size=1, max_size=6),
    st.integers(0, 12), st.integers(0, 4),
)
def test_best_first_keeps_the_most_probable_paths(sequences, budget, max_depth):
    """The tree's nodes are the `budget` most probable paths of at most max_depth tokens (by the product of
    their next-token estimates), each scored with its own product, best first."""
    table = NgramTable.from_sequences(sequences, vocab_size=5, orders=2, width=3)
    tail = tuple(sequences[0][-2:])
    root = tail[-1]

    def next_tokens(path):
        return table.next_tokens(tail + path)

    tree = build_best_first(root, next_tokens, budget, max_depth)
    every = {}  # path -> product, by enumeration
    frontier = [((), 1.0)]
    for _ in range(max_depth):
        frontier = [(path + (y,), q * p) for path, q in frontier for y, p in next_tokens(path)]
        every |= dict(frontier)
    best = sorted(every.values(), reverse=True)[:budget]
    assert tree.num_nodes == len(best)
    assert [round(s, 9) for s in tree.scores[1:]] == [round(s, 9) for s in best]
    for u in range(1, tree.size):
        path = tuple(tree.tokens[tree.path(u)].tolist())
        assert math.isclose(tree.scores[u], every[path], rel_tol=1e-9)
        assert tree.depths[u] <= max_depth


def test_the_table_file_round_trips_and_refuses_what_it_is_not(tmp_path):
    table = NgramTable.from_sequences([[1, 2, 3, 1, 2, 4], [5, 6, 1, 2]], vocab_size=8, orders=3, width=2)
    path = tmp_path / "sub" / "lookup.safetensors"
    table.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["lookup.safetensors"]  # no temporary left behind
    loaded = NgramTable.load(path, vocab_size=8)
    entries, loaded_entries = dict(table.items()), dict(loaded.items())
    assert loaded.orders == 3 and loaded_entries.keys() == entries.keys()
    for context, after in entries.items():
        assert [y for y, _ in loaded_entries[context]] == [y for y, _ in after]
        assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(loaded_entries[context], after))

    with pytest.raises(ValueError, match="vocabulary of 8 tokens, but the target has 9"):
        NgramTable.load(path, vocab_size=9)
    with pytest.raises(FileNotFoundError):
        NgramTable.load(tmp_path / "none.safetensors", vocab_size=8)
    (tmp_path / "junk.safetensors").write_bytes(b"not a table at all")
    with pytest.raises(ValueError, match="not an exitspec lookup table"):
        NgramTable.load(tmp_path / "junk.safetensors", vocab_size=8)
    bad = {"contexts_1": torch.tensor([[1]], dtype=torch.int32), "tokens_1": torch.tensor([[12]], dtype=torch.int32),
           "probs_1": torch.tensor([[0.5]])}
    save_file(bad, tmp_path / "bad.safetensors", metadata={"orders": "1", "vocab_size": "8"})
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        NgramTable.load(tmp_path / "bad.safetensors", vocab_size=8)


def test_a_lookup_tree_is_capped_and_respects_the_depth():
    sequences = torch.randint(0, 4, (2, 200), generator=torch.Generator().manual_seed(0)).tolist()
    table = NgramTable.from_sequences(sequences, vocab_size=4, orders=3, width=4)  # 84 paths of <= 3 tokens
    tree = table.tree(table.propose([0, 1], max_depth=3), 1, budget=64)
    assert tree.num_nodes == MAX_NODES and tree.depth <= 3
    assert table.tree(table.propose([0, 1], max_depth=3), 1, budget=5).num_nodes == 5
    assert table.tree(table.propose([0, 1], max_depth=0), 1, budget=64).num_nodes == 0


def test_train_lookup_writes_the_table_of_a_rollout_folder(tmp_path, capsys):
    save_tiny_llama(tmp_path / "model", vocab_size=32)
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    lines = [{"id": f"p{i}", "prompt_ids": [1, 2, 3], "response_ids": [4 + i, 5, 6, 7]} for i in range(3)]
    (rollouts / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "lookup.safetensors"
    args = ["train", "lookup", "--model", str(tmp_path / "model"), "--rollouts", str(rollouts), "--out", str(out)]
    assert main(args) == 0
    assert "from 3 responses (12 tokens)" in capsys.readouterr().out
    table = NgramTable.load(out, vocab_size=32)
    assert table.next_tokens([2, 3]) == [(4, 0.25), (5, 0.25), (6, 0.25)]  # the prompt's last tokens count too
    assert table.next_tokens([5, 6]) == [(7, 0.75)]
    assert main([*args, "--min-count", "5"]) == 0
    assert len(NgramTable.load(out, vocab_size=32)) == 0  # no context was seen five times
    assert main([*args[:-2], "--out", str(out), "--orders", "0"]) == 2  # a bad option: one line, exit 2


def test_train_lookup_seeds_the_suffix_memory(tmp_path, capsys):
    """--memory: the rollouts' responses go into the target's suffix memory in the (test's) cache, added to what
    it held."""
    from exitspec.drafters.suffix import SuffixMemory
    from exitspec.models import load_model_and_tokenizer
    from exitspec.warm import memory_path

    save_tiny_llama(tmp_path / "model", vocab_size=32)
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    lines = [{"id": f"p{i}", "prompt_ids": [1, 2, 3], "response_ids": [4 + i, 5, 6, 7]} for i in range(3)]
    (rollouts / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = ["train", "lookup", "--model", str(tmp_path / "model"), "--rollouts", str(rollouts),
            "--out", str(tmp_path / "lookup.safetensors"), "--memory"]
    assert main(args) == 0 and main(args) == 0  # twice: the second run adds to the first's
    assert "the suffix memory holds 6 answers (24 tokens)" in capsys.readouterr().out
    memory = SuffixMemory(32)
    loaded, _ = load_model_and_tokenizer(tmp_path / "model")  # as a decoder of that folder loads it
    memory.restore(memory_path(loaded.config), "none")  # a tiny model has no tokenizer
    assert [a for _, a in memory.answers][:3] == [line["response_ids"] for line in lines]


def test_a_lookup_path_needs_a_dflash_drafter(tmp_path):
    model = save_tiny_llama(tmp_path / "model", vocab_size=32)
    from exitspec.drafters import load_drafter

    with pytest.raises(ValueError, match="'ngram' takes none"):
        load_drafter("ngram", model, lookup=tmp_path / "lookup.safetensors")
    assert load_drafter("ngram", model, lookup="none").feature_layers == ()


def test_best_first_refuses_negative_sizes():
    with pytest.raises(ValueError, match="budget and max_depth"):
        build_best_first(0, lambda path: [], -1, 2)


def test_the_shipped_table_fits_the_default_model():
    """The committed table: at most 16 MB, for SmolLM2-135M-Instruct's vocabulary, with a README of its making."""
    from exitspec.drafters import SHIPPED_LOOKUP

    assert sorted(p.name for p in SHIPPED_LOOKUP.parent.iterdir()) == ["README.md", "lookup.safetensors"]
    assert SHIPPED_LOOKUP.stat().st_size <= 16 * 2**20
    table = NgramTable.load(SHIPPED_LOOKUP, vocab_size=49152)
    assert table.orders == 3 and len(table) > 10_000
