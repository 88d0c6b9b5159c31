"""Warm start (exitspec.warm): learned estimators and `--budget auto` rates saved by one decoder and picked
up by the next, and files that cannot be trusted ignored with one warning."""

import json
import math
import warnings

import pytest
import torch
from tiny_models import tiny_llama

from exitspec import warm
from exitspec.budget import AutoBudget
from exitspec.decode import SpeculativeDecoder, generate_autoregressive
from exitspec.drafters import ChainDrafter, DFlashDrafter, NgramDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.drafters.suffix import SuffixMemory
from exitspec.estimates import model_estimator
from exitspec.sampling import SamplingParams
from exitspec.target import TargetModel

VOCAB = 32
PROMPT = [2, 5, 3, 7, 2, 5, 3, 7, 9]
GREEDY = SamplingParams(0.0)
CAP = 8


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, seed=3)


@pytest.fixture(autouse=True)
def folder(tmp_path, monkeypatch):
    """exitspec's cache in the test's own folder; the warm-start files go to its warm/."""
    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    return tmp_path / "warm"


def new_decoder(model, warm_start: bool = True) -> SpeculativeDecoder:
    """A fresh decoder with a fresh DFlash drafter; every call makes the same weights, so the same identity."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = DFlashModel.for_target(model.config, num_layers=1, block_size=6, std=0.5)
    drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings())
    return SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter, warm_start)


def run(decoder: SpeculativeDecoder, tokens: int = 30, temperature: float = 0.0, budget="auto:8"):
    """`tokens` = 0 runs no round: the decoder only loads (and saves) its state."""
    return decoder.generate(PROMPT, tokens, temperature=temperature, budget=budget, stop_tokens=())


def cold_state(model) -> dict:
    return new_decoder(model, warm_start=False).drafter.estimates_state()


def warm_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "warm-start" in str(w.message)]


def learned(state: dict) -> bool:
    return any(count for source in state.values() for count in source["count"])


def test_estimator_state_round_trips_and_refuses_what_does_not_fit():
    estimator = model_estimator()
    estimator.observe([0, 3, 3, 7], [1.0, 0.25, 0.5, 0.0])
    restored = model_estimator()
    restored.load_state(json.loads(json.dumps(estimator.state())))
    assert restored.table() == estimator.table() and restored.state() == estimator.state()
    bins = len(estimator.mass)
    for bad in ({"mass": [0.0] * bins}, {"mass": [0.0] * (bins - 1), "count": [0.0] * (bins - 1)},
                {"mass": [math.nan] * bins, "count": [1.0] * bins}, {"mass": [0.0] * bins, "count": [-1.0] * bins},
                [0.0] * bins):
        with pytest.raises(ValueError):
            restored.load_state(bad)
        assert restored.state() == estimator.state()  # a refused state changes nothing


def test_auto_budget_state_round_trips_and_refuses_what_does_not_fit():
    auto = AutoBudget(None, CAP)  # the cost model is not part of the state
    auto.draft_seconds, auto.rate = {False: 0.01, True: 0.002}, {False: 40.0, True: None}
    auto.rounds, auto.explore_every, auto.next_explore = 37, 32, 60
    restored = AutoBudget(None, CAP)
    restored.restore(json.loads(json.dumps(auto.state())))
    assert restored == auto
    for field, value in (("rounds", -1), ("explore_every", 3), ("rate", {"full": math.inf, "cheap": None}),
                         ("draft_seconds", {"full": 0.1}), ("next_explore", 2.5)):
        with pytest.raises(ValueError):
            restored.restore(auto.state() | {field: value})
        assert restored == auto
    with pytest.raises(ValueError):
        restored.restore({"rate": {"full": 1.0, "cheap": 1.0}})


def test_drafters_hand_over_the_estimates_of_the_current_setting(model):
    decoder = new_decoder(model)
    run(decoder, temperature=1.0, budget=CAP)
    state = decoder.drafter.estimates_state()
    assert learned(state) and set(state) == {"model", "lookup", "request", "memory"}
    other = new_decoder(model).drafter
    other.estimate_for(SamplingParams(1.0))
    ChainDrafter(other).load_estimates(json.loads(json.dumps(state)))  # a chain hands it to its drafter
    assert other.estimates_state() == state and ChainDrafter(other).estimates_state() == state
    other.estimate_for(GREEDY)
    assert other.estimates_state() == cold_state(model)  # another setting keeps its own
    with pytest.raises(ValueError):
        NgramDrafter().load_estimates(state)  # DFlash's sources are not prompt lookup's alone
    assert new_decoder(model).drafter.identity() == other.identity() != ChainDrafter(other).identity()


def test_a_new_decoder_starts_from_the_saved_state(model, folder):
    first = new_decoder(model)
    run(first)
    assert learned(first.drafter.estimates_state())
    assert sorted(p.name.split("-")[0] for p in folder.iterdir()) == ["auto", "estimates", "suffix"]
    second = new_decoder(model)
    run(second, tokens=0)
    assert second.drafter.estimates_state() == first.drafter.estimates_state()
    assert second.auto_budget(CAP, GREEDY).state() == first.auto_budget(CAP, GREEDY).state()
    assert list(second.drafter.memory().answers) == list(first.drafter.memory().answers)  # the first's answer
    for file in folder.iterdir():  # read once per process: later runs go on from memory
        file.write_text("{")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(second, tokens=5)
    assert warm_warnings(caught) == []


def test_warm_start_off_neither_reads_nor_writes(model, folder):
    run(new_decoder(model, warm_start=False))
    assert not folder.exists()
    run(new_decoder(model))
    saved = {p: p.read_bytes() for p in folder.iterdir()}
    cold = new_decoder(model, warm_start=False)
    run(cold, tokens=0)
    assert cold.drafter.estimates_state() == cold_state(model)
    run(cold)
    assert {p: p.read_bytes() for p in folder.iterdir()} == saved


def damage(file, how: str) -> None:
    data = json.loads(file.read_text())
    if how == "not json":
        file.write_text('{"version": 1, "key"')
    elif how == "short bins":
        data["state"]["model"]["mass"].pop()
        file.write_text(json.dumps(data))
    elif how == "other version":
        file.write_text(json.dumps(data | {"version": 0}))
    elif how == "other model":
        file.write_text(json.dumps(data | {"key": data["key"] | {"model": "0" * 16}}))


@pytest.mark.parametrize("how", ["not json", "short bins", "other version", "other model", "other settings"])
def test_a_damaged_or_foreign_file_warns_once_and_is_replaced(model, folder, how):
    """Each file is checked against the key it should hold; one made under other sampling settings (copied over
    this one) is as foreign as one for another model."""
    run(new_decoder(model), budget=CAP)
    (file,) = folder.glob("*.json")
    if how == "other settings":
        run(new_decoder(model), temperature=1.0, budget=CAP)
        (other,) = set(folder.glob("*.json")) - {file}
        other.replace(file)
    else:
        damage(file, how)
    decoder = new_decoder(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(decoder, tokens=0, budget=CAP)
    (message,) = warm_warnings(caught)
    assert message.startswith(f"{file}: ignoring a warm-start file")
    assert decoder.drafter.estimates_state() == cold_state(model)
    data = json.loads(file.read_text())  # written back whole, for this key
    assert data["key"] == warm.key("estimates", decoder.target, decoder.drafter, GREEDY) and data["version"] == 1


def test_greedy_output_from_a_warm_start_equals_autoregressive(model):
    first = run(new_decoder(model), tokens=40)
    decoder = new_decoder(model)
    out = run(decoder, tokens=40)
    assert out.tokens == generate_autoregressive(TargetModel(model), PROMPT, 40, temperature=0.0, stop_tokens=()).tokens
    assert decoder.auto_budget(CAP, GREEDY).rounds == len(first.rounds) + len(out.rounds)  # it went on from there


def test_a_foreign_suffix_memory_warns_and_is_replaced(model, folder):
    """A memory file of another tokenizer (here: another vocabulary) is not trusted: one warning, an empty
    memory, and the file replaced by this target's after the run."""
    decoder = new_decoder(model)
    foreign = SuffixMemory(VOCAB + 7)
    foreign.add([1, 2, 3, 4])
    foreign.save(warm.memory_path(decoder.target.model.config), "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(decoder, tokens=10)
    (message,) = [str(w.message) for w in caught if "suffix memory" in str(w.message)]
    assert message.startswith("ignoring a suffix memory")
    assert [len(a) for _, a in decoder.drafter.memory().answers] == [10]  # its own answer only
    fresh = SuffixMemory(VOCAB)
    fresh.restore(warm.memory_path(decoder.target.model.config), "none")
    assert [a for _, a in fresh.answers] == [a for _, a in decoder.drafter.memory().answers]


def test_a_suffix_memory_is_shared_by_entry_points_with_and_without_a_tokenizer(model, folder):
    """transformers' generate may run without a tokenizer (digest "none"), the CLI with one: each reads what the
    other wrote, and a run without a tokenizer keeps the file's digest when it writes it back."""
    path = warm.memory_path(model.config)
    known = SuffixMemory(VOCAB)
    known.add([4, 5, 6, 7])
    known.save(path, "0123456789abcdef")
    decoder = new_decoder(model)  # TargetModel without a tokenizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(decoder, tokens=10)
    assert not [w for w in caught if "suffix memory" in str(w.message)]
    assert [4, 5, 6, 7] in [a for _, a in decoder.drafter.memory().answers]
    back = SuffixMemory(VOCAB)
    assert back.restore(path, "0123456789abcdef") == "0123456789abcdef"  # the digest survived the write
    assert len(back.answers) == 2
