"""Suffix drafting (drafters/suffix.py): arctic-inference's suffix trees as candidate trees, the memory of
earlier answers (bounded, saved and restored, refused for another tokenizer), and decoders that learn from
use without losing exactness."""

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.decode import SpeculativeDecoder, generate_autoregressive
from exitspec.drafters import DFlashDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.drafters.suffix import MAX_NODES, SuffixMemory, SuffixSource, tokenizer_digest
from exitspec.target import TargetModel

VOCAB = 32


def test_the_request_tree_proposes_what_followed_the_context_tail_best_first():
    source = SuffixSource()
    context = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2]
    source.begin(context)
    proposal = source.propose(context, max_depth=3)
    tree = source.trees(proposal, root_token=2)["request"]
    assert tree.tokens[1] == 3 and tree.depth <= 3  # "1 2" was always followed by 3
    assert tree.scores[1] == 1.0  # the tail's own occurrence at the end, with nothing after it, does not count
    assert list(tree.scores) == sorted(tree.scores, reverse=True)  # best first, so every head is a tree
    assert tree.scores[1] > max(tree.scores[2:])  # then 4 (twice) and 5 (once) split the mass
    children = {int(tree.tokens[u]) for u in tree.children[1]}
    assert children <= {4, 5} and 4 in children
    assert set(source.propose(context, 3).drafts) == {"request"}  # no memory: one source


def test_the_request_tree_follows_the_answer_as_it_grows():
    source = SuffixSource()
    source.begin([7, 8])
    assert source.propose([7, 8], 4).drafts == {}
    grown = [7, 8, 10, 11, 12, 7, 8]  # the answer so far repeats the prompt's start
    tree = source.trees(source.propose(grown, 4), 8)["request"]
    assert tree.tokens[1:4].tolist() == [10, 11, 12]


def test_the_memory_drops_the_oldest_answers_beyond_its_bound():
    memory = SuffixMemory(VOCAB, max_tokens=10)
    for start in range(4):
        memory.add([start, start + 10, start + 20, start + 1])
    assert memory.stored <= 10 and [a[0] for _, a in memory.answers] == [2, 3]
    source = SuffixSource(memory)
    source.begin([30])
    assert "memory" not in source.propose([0, 10], 4).drafts  # evicted from the tree too
    assert source.trees(source.propose([3, 23], 4), 23)["memory"].tokens[1] == 4
    memory.add([1])  # too short to teach anything
    with pytest.raises(ValueError, match="vocabulary"):
        memory.add([1, VOCAB])


def test_the_memory_says_whether_it_holds_an_answer():
    memory = SuffixMemory(100)
    memory.add(list(range(40)))
    assert memory.holds(list(range(5, 30))) and memory.holds([7, 8, 9])
    assert not memory.holds([7, 9, 8]) and not memory.holds([]) and not SuffixMemory(100).holds([1, 2])


def test_the_memory_saves_and_restores_and_refuses_other_files(tmp_path):
    memory = SuffixMemory(VOCAB)
    memory.add([1, 2, 3, 4])
    memory.add([5, 6, 7])
    memory.save(tmp_path / "m.safetensors", "tok-a")
    restored = SuffixMemory(VOCAB)
    restored.restore(tmp_path / "m.safetensors", "tok-a")
    assert [a for _, a in restored.answers] == [[1, 2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="another tokenizer"):
        SuffixMemory(VOCAB).restore(tmp_path / "m.safetensors", "tok-b")
    with pytest.raises(ValueError, match="another tokenizer"):
        SuffixMemory(VOCAB + 1).restore(tmp_path / "m.safetensors", "tok-a")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    fresh = SuffixMemory(VOCAB)
    with pytest.raises(ValueError, match="not an exitspec suffix memory"):
        fresh.restore(tmp_path / "bad.safetensors", "tok-a")
    assert not fresh.answers  # nothing added from a bad file
    assert tokenizer_digest(None) == "none"


def test_a_speculation_never_exceeds_its_bounds():
    source = SuffixSource()
    context = list(range(20)) * 4
    source.begin(context)
    for depth in (1, 5, 40):
        tree = source.trees(source.propose(context, depth), context[-1])["request"]
        assert tree.depth <= depth and tree.num_nodes <= MAX_NODES


def _decoder(model, learn: bool) -> SpeculativeDecoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = DFlashModel.for_target(model.config, num_layers=1, block_size=6, std=0.5)
    drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings())
    return SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter, False, learn)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_decoder_learns_from_its_answers_and_stays_exact(temperature):
    model = tiny_llama(vocab_size=VOCAB, seed=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    learner, forgetful = _decoder(model, learn=True), _decoder(model, learn=False)
    for prompt in prompts:
        first = learner.generate(prompt, 24, temperature=temperature, budget=8, stop_tokens=(), seed=1)
        again = learner.generate(prompt, 24, temperature=temperature, budget=8, stop_tokens=(), seed=1)
        plain = forgetful.generate(prompt, 24, temperature=temperature, budget=8, stop_tokens=(), seed=1)
        if temperature == 0:  # exact: the target's greedy output, whatever the memory proposes
            target = TargetModel(model)
            expected = generate_autoregressive(target, prompt, 24, stop_tokens=()).tokens
            assert first.tokens == again.tokens == plain.tokens == expected
        assert again.tau >= plain.tau  # its own earlier answer is in the memory now
    assert len(learner.drafter.memory().answers) == 4 and not forgetful.drafter.memory().answers


@pytest.mark.slow
def test_latency_reports_the_suffix_costs(tmp_path, capsys):
    """`exitspec latency --stage suffix` on the default tokenizer and ShareGPT text: a row per memory size."""
    import json

    from exitspec.cli import main

    assert main(["latency", "--stage", "suffix", "--sizes", "3000", "--out", str(tmp_path / "s.json")]) == 0
    (row,) = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert 2000 < row["stored"] <= 3000 and row["answers"] > 1 and row["memory_mib"] > 0
    assert 0 < row["update_us"] < row["lookup_us"] and row["learn_us_per_token"] > 0
    assert "Suffix drafting per round" in capsys.readouterr().out
