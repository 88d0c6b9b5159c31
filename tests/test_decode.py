"""End to end on a tiny random Llama: exact output law, greedy equality, stopping, streaming, bad input."""

import pytest
import torch
from tiny_models import tiny_llama

from exitspec.budget import CostModel
from exitspec.build import build_ddtree
from exitspec.check import g_test_pvalue
from exitspec.decode import SpeculativeDecoder, generate_autoregressive
from exitspec.drafters import DFlashDrafter, NgramDrafter, SuffixDrafter
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.drafters.lookup import NgramTable
from exitspec.settings import budget_cap, parse_budget
from exitspec.target import TargetModel
from exitspec.tree import DraftTree

VOCAB = 8
PROMPT = [2, 5, 3, 7, 2, 5]
DRAWS = 2500


class RandomTreeDrafter:
    """A drafter that knows nothing: random per-depth marginals, DDTree-built. Exactness must not care."""

    feature_layers = ()

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def estimate_for(self, setting):
        pass

    def identity(self):
        return "random"

    def estimates_state(self):
        return {}

    def load_estimates(self, state):
        pass

    def begin(self, prompt_ids, features):
        pass

    def propose(self, context_ids, max_depth, cheap=False):
        return 2.0 * torch.randn(max_depth, self.vocab, generator=self.gen)  # [H, V]

    def build(self, proposal, root_token, budget):
        return build_ddtree(proposal, root_token, budget)

    def observe(self, tree, reach):
        pass

    def commit(self, committed_ids, features):
        pass

    def learn(self, answer):
        pass

    def memory(self):
        return None


def exact_first_tokens_law(model, prompt: list[int], n: int = 3) -> torch.Tensor:
    """[V]*n joint probabilities of the first n generated tokens, enumerated with full causal forwards."""
    law = torch.ones(())
    prefixes = torch.tensor([prompt])  # [1, L]
    for _ in range(n):
        with torch.no_grad():
            probs = torch.softmax(model(prefixes).logits[:, -1].double(), dim=-1)  # [V^k, V]
        law = (law.reshape(-1, 1) * probs).reshape(*([VOCAB] * (law.dim() + 1)))
        prefixes = torch.cat(
            [prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1
        )
    return law


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def first_tokens_counts(model):
    """verifier → counts [V, V, V] of the first 3 tokens over DRAWS seeded speculative runs at temperature 1."""
    cache = {}

    def counts(verifier: str, budget: int | str = 6, drafter: str = "random") -> torch.Tensor:
        if (verifier, budget, drafter) not in cache:
            # "suffix": suffix trees over the prompt and every earlier draw's answer (the decoder learns)
            trees = RandomTreeDrafter(VOCAB, seed=1) if drafter == "random" else SuffixDrafter(VOCAB)
            decoder = SpeculativeDecoder(TargetModel(model), trees, warm_start=False)
            if isinstance(budget, str):
                varied_cost(decoder, budget_cap(parse_budget(budget)))
            counts = cache[verifier, budget, drafter] = torch.zeros((VOCAB,) * 3, dtype=torch.float64)
            for seed in range(DRAWS):
                out = decoder.generate(PROMPT, 3, 1.0, budget=budget, verifier=verifier, seed=seed, stop_tokens=())
                counts[tuple(out.tokens)] += 1
        return cache[verifier, budget, drafter]

    return counts


@pytest.mark.parametrize("verifier", ["predraw", "sequential", "tev"])
def test_first_three_tokens_follow_the_target_law(model, first_tokens_counts, verifier):
    assert g_test_pvalue(first_tokens_counts(verifier), exact_first_tokens_law(model, PROMPT)) > 1e-3


@pytest.mark.parametrize("verifier", ["predraw", "tev"])
def test_suffix_trees_that_learn_from_earlier_draws_keep_the_target_law(model, first_tokens_counts, verifier):
    """Each draw's trees come from the prompt and every earlier draw's answer; the law stays exact."""
    assert g_test_pvalue(first_tokens_counts(verifier, 6, "suffix"), exact_first_tokens_law(model, PROMPT)) > 1e-3


@pytest.mark.parametrize("verifier", ["predraw", "tev"])
def test_auto_budget_keeps_the_target_law(model, first_tokens_counts, verifier):
    """Tree sizes chosen from the drafter's estimated P(u) and past rounds leave the output law exact."""
    assert g_test_pvalue(first_tokens_counts(verifier, "auto:6"), exact_first_tokens_law(model, PROMPT)) > 1e-3


def test_wrong_target_law_is_detected(first_tokens_counts):
    """The same counts against a different model's law must fail: the check has power."""
    other = tiny_llama(vocab_size=VOCAB, seed=4)
    assert g_test_pvalue(first_tokens_counts("tev"), exact_first_tokens_law(other, PROMPT)) < 1e-3


def varied_cost(decoder: SpeculativeDecoder, cap: int) -> None:
    """A cost model under which the best tree size depends on the drafter's scores (the tiny model's own
    timings are flat in N, so `auto` would always fill the cap): each node costs a tenth of a step."""
    decoder.costs[cap] = CostModel([0, cap], [1.0, 1.0 + 0.1 * cap])


@pytest.mark.parametrize("verifier", ["greedy", "predraw", "sequential", "tev"])
@pytest.mark.parametrize("budget", [0, 1, 8, 32, "auto", "auto:8"])
def test_greedy_equals_transformers_generate(model, verifier, budget):
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    cap = budget_cap(parse_budget(budget))
    for drafter in (RandomTreeDrafter(VOCAB), NgramDrafter(), SuffixDrafter(VOCAB)):
        decoder = SpeculativeDecoder(TargetModel(model), drafter)
        if isinstance(budget, str):
            varied_cost(decoder, cap)
        out = decoder.generate(PROMPT, 40, temperature=0.0, budget=budget, verifier=verifier, stop_tokens=())
        assert out.tokens == expected[0, len(PROMPT) :].tolist()
        assert all(r.tree_size <= cap for r in out.rounds)


@pytest.mark.parametrize("verifier", ["greedy", "tev"])
@pytest.mark.parametrize("draft_vocab", [None, [0, 2, 5, 6]])
def test_greedy_with_a_dflash_drafter_equals_generate(model, verifier, draft_vocab):
    """An untrained DFlash drafter reads target features through the whole loop; the output stays exact, also
    when it drafts over a few tokens only (a draft vocabulary)."""
    torch.manual_seed(0)
    draft = DFlashModel.for_target(model.config, num_layers=1, block_size=6, std=0.5)
    if draft_vocab is not None:
        draft.use_draft_vocab(torch.tensor(draft_vocab))
    drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings())
    decoder = SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter)
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    out = decoder.generate(PROMPT, 40, temperature=0.0, budget=8, verifier=verifier, stop_tokens=())
    assert out.tokens == expected[0, len(PROMPT) :].tolist()
    assert max(r.tree_size for r in out.rounds) == 8
    varied_cost(decoder, 8)
    auto = decoder.generate(PROMPT, 40, temperature=0.0, budget="auto:8", verifier=verifier, stop_tokens=())
    assert auto.tokens == out.tokens and auto.summary()["tree_sizes"] == [r.tree_size for r in auto.rounds]


def test_greedy_with_corpus_lookup_equals_generate_and_accepts_its_tokens(model):
    """A DFlash drafter with a lookup table of the target's own greedy answer: the output stays exact, and the
    table's candidates are what the target accepts (an untrained model alone accepts far less)."""
    torch.manual_seed(0)
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None)[0]
    table = NgramTable.from_sequences([expected.tolist()], vocab_size=VOCAB, orders=3)
    taus = {}
    for lookup in (None, table):
        draft = DFlashModel.for_target(model.config, num_layers=1, block_size=6, std=0.5)
        drafter = DFlashDrafter(draft, model.get_input_embeddings(), model.get_output_embeddings(), lookup=lookup)
        decoder = SpeculativeDecoder(TargetModel(model, feature_layers=drafter.feature_layers), drafter)
        out = decoder.generate(PROMPT, 40, temperature=0.0, budget=8, verifier="tev", stop_tokens=())
        assert out.tokens == expected[len(PROMPT) :].tolist()
        taus[lookup is not None] = out.tau
    assert taus[True] > 3 and taus[True] > taus[False] + 1


def test_autoregressive_baseline_equals_generate(model):
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    out = generate_autoregressive(TargetModel(model), PROMPT, 30, temperature=0.0, stop_tokens=())
    assert out.tokens == expected[0, len(PROMPT) :].tolist() and out.tau == 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_autoregressive_steps_refuse_non_finite_logits_in_their_one_read(temperature):
    """The step's one host read carries the logits' finiteness with the token: NaN logits end the run with one
    error naming the token row, and the step is rolled back out of the cache."""
    broken = tiny_llama(VOCAB)
    broken.lm_head.weight[3, 0] = float("nan")
    target = TargetModel(broken)
    with pytest.raises(ValueError, match="non-finite logits at token 0"):
        generate_autoregressive(target, PROMPT, 5, temperature=temperature, stop_tokens=())
    assert target.cache_len == len(PROMPT) - 1 and target.backend.length == len(PROMPT) - 1


def test_stats_are_consistent(model):
    decoder = SpeculativeDecoder(TargetModel(model), RandomTreeDrafter(VOCAB))
    out = decoder.generate(PROMPT, 50, temperature=1.0, budget=8, seed=0, stop_tokens=())
    s = out.summary()
    assert s["new_tokens"] == 50 == sum(r.emitted for r in out.rounds)
    assert s["tau"] == pytest.approx(sum(a + 1 for a in s["accepted_lengths"]) / s["rounds"])
    assert all(0 <= c <= 8 for c in s["coverage_per_round"])
    assert set(s["stage_seconds"]) == {"draft", "build", "target", "verify", "commit"}
    assert s["tokens_per_second"] > 0 and s["stopped_by"] == "max_new_tokens"


def test_stops_after_a_stop_token(model):
    decoder = SpeculativeDecoder(TargetModel(model), RandomTreeDrafter(VOCAB))
    full = decoder.generate(PROMPT, 40, temperature=0.0, budget=8, stop_tokens=())
    stop = full.tokens[10]
    out = decoder.generate(PROMPT, 40, temperature=0.0, budget=8, stop_tokens=[stop])
    assert out.tokens == full.tokens[: full.tokens.index(stop) + 1] and out.stopped_by == "stop_token"


def test_stops_at_the_context_limit():
    small = tiny_llama(vocab_size=VOCAB, max_position_embeddings=16)
    decoder = SpeculativeDecoder(TargetModel(small), RandomTreeDrafter(VOCAB))
    out = decoder.generate(PROMPT, 100, temperature=0.0, budget=8, stop_tokens=())
    assert len(PROMPT) + len(out.tokens) == 16 and out.stopped_by == "context"
    expected = small.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert out.tokens == expected[0, len(PROMPT) :].tolist()


def test_bad_input_gets_clear_errors(model):
    decoder = SpeculativeDecoder(TargetModel(model), RandomTreeDrafter(VOCAB))
    with pytest.raises(ValueError, match="budget must be >= 0"):
        decoder.generate(PROMPT, 5, budget=-1)
    with pytest.raises(ValueError, match="budget must be a number of draft tokens, 'auto' or 'auto:B'"):
        decoder.generate(PROMPT, 5, budget="fast")
    with pytest.raises(ValueError, match="prompt is empty"):
        decoder.generate([], 5)
    with pytest.raises(ValueError, match="does not fit the model's context of 128"):
        decoder.generate([2] * 128, 5)
    with pytest.raises(ValueError, match="unknown verifier 'fast'"):
        decoder.generate(PROMPT, 5, verifier="fast")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        decoder.generate([2, 99], 5)
    with pytest.raises(ValueError, match="no tokenizer"):
        decoder.generate("text needs a tokenizer", 5)


def test_a_drafter_that_breaks_the_budget_is_refused(model):
    class Greedy(RandomTreeDrafter):
        def build(self, proposal, root_token, budget):
            return build_ddtree(proposal, root_token, budget + 3)

    with pytest.raises(RuntimeError, match="expected at most 4 nodes"):
        SpeculativeDecoder(TargetModel(model), Greedy(VOCAB)).generate(PROMPT, 10, budget=4)


def test_an_invalid_tree_is_refused(model):
    class Broken(RandomTreeDrafter):
        def build(self, proposal, root_token, budget):
            return DraftTree(torch.tensor([-1, 0, 0]), torch.tensor([root_token, 3, 3]), torch.tensor([0, 1, 1]))

    with pytest.raises(ValueError, match="same token 3"):
        SpeculativeDecoder(TargetModel(model), Broken(VOCAB)).generate(PROMPT, 10, budget=4)


def test_max_rounds_and_the_round_hook(model):
    traces = []
    decoder = SpeculativeDecoder(TargetModel(model), RandomTreeDrafter(VOCAB))
    out = decoder.generate(PROMPT, 100, temperature=1.0, budget=5, max_rounds=4, on_round=traces.append, stop_tokens=())
    assert len(out.rounds) == 4 == len(traces) and out.stopped_by == "max_rounds"
    emitted = [tok for t in traces for tok in t.verdict.output_tokens(t.tree)]
    assert emitted == out.tokens and all(t.probs.shape == (t.tree.size, VOCAB) for t in traces)
