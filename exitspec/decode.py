"""The decode loop: draft → build → one target forward over the tree → verify → commit, round after round.

    context ids ─ drafter.propose ─▶ proposal ─ drafter.build ─▶ DraftTree (≤ B nodes, made on the host)
        ─ target.forward_tree ─▶ logits [N+1, V] (+ features) ─ WarpedRows: p_v, warped as a verifier reads it
        ─ verifier ─▶ Decision (on the device) ─ _read: the round's one host read ─▶ Verdict(path, bonus)
        ─ target.commit(path), drafter.commit(...) ─▶ stream tokens

The host keeps the context's token ids and every tree's structure, so nothing else in a round waits for the
device (bench/rounds.py counts it). The target's KV cache holds every committed token but the last, which
roots the next tree. Each round
emits the accepted draft tokens plus one bonus token, so a round never emits less than autoregressive
decoding does. `generate_autoregressive` is the plain one-token-per-step loop on the same backend: the
baseline for the speedup ratio (SR). Both time themselves with timing.StageTimer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from exitspec.budget import DENSE, AutoBudget, CostModel, calibrate
from exitspec.drafters import Drafter, default_drafter, load_drafter
from exitspec.flow import frontier, observed_reach
from exitspec.models import check_loaded, load_model_and_tokenizer
from exitspec.sampling import SamplingParams, WarpedRows, finite_rows
from exitspec.settings import budget_cap, parse_budget
from exitspec.target import TargetModel
from exitspec.timing import StageTimer
from exitspec.tree import DraftTree
from exitspec.verify import DECIDERS, Decision, Verdict, check_verifier
from exitspec.warm import WarmStart

STAGES = ("draft", "build", "target", "verify", "commit")
Prompt = str | Sequence[dict] | Sequence[int] | Tensor


@dataclass
class RoundStats:
    tree_size: int  # N, draft tokens in the tree
    accepted: int  # draft tokens accepted (the bonus token excluded)
    emitted: int  # tokens this round added to the output (accepted + bonus, cut at a stop or the limit)
    coverage: float  # C_p(T), the expected accepted length of a saturated verifier on this tree


@dataclass(frozen=True)
class RoundTrace:
    """One round as the verifier saw it, handed to `generate(on_round=...)` for diagnostics."""

    tree: DraftTree
    probs: Tensor  # [N+1, V] the warped target distribution at every node
    verdict: Verdict
    emitted: int  # tokens of the block that reached the output (a stop token or the limit may cut it)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    rounds: list[RoundStats]
    stage_seconds: dict[str, float]
    prefill_seconds: float
    total_seconds: float  # prefill included
    stopped_by: str  # "stop_token", "max_new_tokens", "max_rounds", "context" or "cancelled"
    forward_config: dict = field(default_factory=dict)  # TargetModel.forward_config() of the run's target

    @property
    def tau(self) -> float:
        """τ: mean output-block length per round (accepted draft tokens + the bonus token)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def mean_coverage(self) -> float:
        return sum(r.coverage for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.total_seconds if self.total_seconds > 0 else 0.0

    def summary(self) -> dict:
        return {
            "new_tokens": len(self.tokens),
            "rounds": len(self.rounds),
            "tau": self.tau,
            "mean_coverage": self.mean_coverage,
            "tree_sizes": [r.tree_size for r in self.rounds],
            "accepted_lengths": [r.accepted for r in self.rounds],
            "coverage_per_round": [r.coverage for r in self.rounds],
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "total_seconds": self.total_seconds,
            "stage_seconds": {s: self.stage_seconds.get(s, 0.0) for s in STAGES},
            "stopped_by": self.stopped_by,
            "forward": self.forward_config,
        }


class TextStream:
    """Turns a growing token list into text increments, holding back an unfinished multi-byte character."""

    def __init__(self, tokenizer, sink: Callable[[str], None]):
        self.tokenizer, self.sink = tokenizer, sink
        self.tokens: list[int] = []
        self.printed = 0

    def push(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.sink(text[self.printed :])
        self.printed = len(text)


def encode_prompt(tokenizer, prompt: Prompt, chat: bool = True) -> list[int]:
    """Token ids for a prompt: a string or a list of chat messages goes through the chat template."""
    if isinstance(prompt, Tensor):
        ids = prompt.flatten().tolist()
    elif isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer; pass token ids instead of text")
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError("the prompt is empty")
        if chat and tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    return list(ids)


def default_stop_tokens(target: TargetModel) -> set[int]:
    """The model's end-of-sequence ids (generation config first, then the tokenizer)."""
    eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    if eos is None and target.tokenizer is not None:
        eos = target.tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


@dataclass
class _Run:
    """Bookkeeping shared by the speculative and the autoregressive loops."""

    max_new_tokens: int
    stop_tokens: set[int]
    stream: TextStream | None
    tokens: list[int] = field(default_factory=list)
    stopped_by: str = "max_new_tokens"

    def emit(self, block: list[int]) -> int:
        """Appends a block, cut after a stop token or at the limit; returns how many tokens it kept."""
        block = block[: self.max_new_tokens - len(self.tokens)]
        for i, tok in enumerate(block):
            if tok in self.stop_tokens:
                block, self.stopped_by = block[: i + 1], "stop_token"
                break
        self.tokens.extend(block)
        if self.stream is not None:
            self.stream.push(block)
        return len(block)

    @property
    def done(self) -> bool:
        return self.stopped_by == "stop_token" or len(self.tokens) >= self.max_new_tokens


class SpeculativeDecoder:
    """Exact tree speculative decoding of `target` with proposals from `drafter`."""

    def __init__(self, target: TargetModel, drafter: Drafter, warm_start: bool = True, learn: bool = True):
        if drafter.feature_layers and tuple(drafter.feature_layers) != tuple(target.feature_layers):
            raise ValueError(
                f"the drafter reads target layers {list(drafter.feature_layers)} but the target taps "
                f"{list(target.feature_layers)}; build the target with feature_layers=drafter.feature_layers"
            )
        self.target, self.drafter = target, drafter
        self.costs: dict[int, CostModel] = {}  # per cap: the target stage's cost against N (`--budget auto`)
        self._auto: dict[tuple[int, SamplingParams], AutoBudget] = {}  # per cap and sampling settings
        self.warm_start = warm_start  # start from what earlier processes learned, and save what runs learn
        self.learn = learn  # each finished answer goes into the drafter's suffix memory (drafter.learn)
        self._warm = WarmStart(target, drafter)

    def keep_memory_in(self, path: Path) -> None:
        """The drafter's suffix memory is read from `path` before the first run (where it exists) and written there
        after each, instead of exitspec's cache (warm.py): `bench --learn` keeps it beside its results."""
        self._warm.memory_file = Path(path)

    def calibrate(self, cap: int = DENSE, refresh: bool = False, cost: CostModel | None = None) -> CostModel:
        """The target's cost against tree size up to `cap` (`budget.calibrate`: measured, or read from the cache
        and spot-checked; or `cost`, another decoder's over the same weights) and the row plan it implies, set
        on the target: every later forward, speculative or autoregressive (`autoregressive`), runs by it.
        `app.load_decoders` calls it at load."""
        if cap not in self.costs or refresh or cost is not None:
            self.costs[cap] = calibrate(self.target, cap, refresh, cost)
        return self.costs[cap]

    def auto_budget(self, cap: int, params: SamplingParams) -> AutoBudget:
        """`--budget auto:cap`'s running rates under these sampling settings (what a round is worth depends on
        them), over the cap's cost model (`calibrate`, where load did not already)."""
        if (cap, params) not in self._auto:
            self._auto[cap, params] = AutoBudget(self.calibrate(cap), cap)
        return self._auto[cap, params]

    def autoregressive(self, prompt: Prompt, **settings) -> GenerationResult:
        """The SR baseline: `generate_autoregressive` on this decoder's own target, so it runs with exactly the
        weights, backend and row plan that the speculative rounds run with (result.forward_config says so)."""
        return generate_autoregressive(self.target, prompt, **settings)

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        drafter: str | Path | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "auto",
        threads: int | None = None,
        lookup: str | Path = "auto",
        warm_start: bool = True,
        learn: bool = True,
    ) -> SpeculativeDecoder:
        """A local HF model folder (None: the default SmolLM2-135M-Instruct) and a drafter (see load_drafter;
        None: the shipped DFlash drafter for the default model, n-gram for any other) with its corpus-lookup table
        (auto, none or a path), calibrated (`from_model`, the row plan free to lay the weights out again).
        `warm_start`: runs start from what earlier processes learned under the same settings, and save what they
        learn (warm.py). `learn`: each finished answer goes into the drafter's suffix memory, which later
        requests draft from (drafters/suffix.py). Several drafters over one target: `app.load_decoders`."""
        hf_model, tokenizer = load_model_and_tokenizer(model, device, dtype)
        return cls.from_model(hf_model, tokenizer, drafter or default_drafter(model), lookup, threads, warm_start,
                              learn, weight_copies=True)

    @classmethod
    def from_model(
        cls,
        model,
        tokenizer=None,
        drafter: str | Path | None = None,
        lookup: str | Path = "auto",
        threads: int | None = None,
        warm_start: bool = True,
        learn: bool = True,
        weight_copies: bool = False,
        cap: int | None = DENSE,
        cost: CostModel | None = None,
    ) -> SpeculativeDecoder:
        """A decoder over a loaded transformers model (PreTrainedModel) and its tokenizer, on the model's device
        and in its dtype, using its weights in place: `model.generate` keeps working on the same storage.
        `weight_copies=True` lets the row plan lay the weights out again where that is faster (each layout a
        full copy; TargetModel). Calibrated for trees of up to `cap` draft tokens (`calibrate`, with `cost`
        where another decoder over the same weights measured it; None: not calibrated). The rest as in
        `from_pretrained`."""
        if threads:
            torch.set_num_threads(threads)
        model = check_loaded(model)
        spec = str(drafter or default_drafter(model))
        loaded = load_drafter(spec, model, lookup, weight_copies)
        target = TargetModel(model, tokenizer, loaded.feature_layers, weight_copies=weight_copies)
        decoder = cls(target, loaded, warm_start, learn)
        if cap is not None:
            decoder.calibrate(cap, cost=cost)
        return decoder

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        budget: int | str = "auto",
        verifier: str = "tev",
        seed: int = 0,
        stop_tokens: Iterable[int] | None = None,
        stream: Callable[[str], None] | None = None,
        chat: bool = True,
        max_rounds: int | None = None,
        on_round: Callable[[RoundTrace], None] | None = None,
        learn: bool = True,
        cancel: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Generates up to max_new_tokens (and at most max_rounds rounds); the output has exactly the (warped)
        target distribution. `budget` is B (at most B draft tokens per tree, always filled if the drafter can),
        "auto" or "auto:B" (each round the tree size up to B, default 32, with the most expected tokens per
        second; see budget.py). `on_round` sees every round's tree, target distribution and verdict. `learn=False`
        keeps this answer out of the suffix memory even where the decoder learns (a warm-up run). `cancel` is asked
        before every round; True ends the run there (stopped_by "cancelled", not learned): a server's client left."""
        params = SamplingParams(temperature, top_k, top_p)
        check_verifier(verifier, params)
        budget = parse_budget(budget)
        cap = budget_cap(budget)
        auto = self.auto_budget(cap, params) if isinstance(budget, str) and cap > 0 else None  # measured before timing
        rules = _Rules(params, verifier, cap, auto, torch.Generator(device=self.target.device).manual_seed(seed))
        self.drafter.estimate_for(params)
        if self.warm_start:
            self._warm.load(params, auto, self.learn)  # once per settings in this process (warm.py)
        run, prompt_ids, timer = _start_run(self.target, prompt, max_new_tokens, stop_tokens, stream, chat)
        features = self.target.prefill(torch.tensor(prompt_ids[:-1], device=self.target.device))
        self.drafter.begin(torch.tensor(prompt_ids, device=self.target.device), features)
        prefill_seconds = timer.elapsed()  # a sync, once a sequence: the prefill's own time, not the first round's
        context, rounds = list(prompt_ids), []  # the token ids so far, on the host; its last one roots the next tree
        while not run.done:
            if cancel is not None and cancel():
                run.stopped_by = "cancelled"
                break
            with timer.round():
                stats = self._round(run, context, rules, timer, on_round)
            if stats is None:
                break
            rounds.append(stats)
            if max_rounds is not None and len(rounds) >= max_rounds and not run.done:
                run.stopped_by = "max_rounds"
                break
        result = _finish_run(self.target, run, prompt_ids, rounds, timer, prefill_seconds)
        learned = self.learn and learn and run.stopped_by != "cancelled"
        if learned:
            self.drafter.learn(run.tokens)
        if self.warm_start:
            self._warm.save(params, auto, learned)  # the memory file is written only when this run added to it
        return result

    def _round(self, run: _Run, context: list[int], rules: _Rules, timer: StageTimer, on_round) -> RoundStats | None:
        """One round: draft and build a tree, one target forward over it, verify, commit. None when the context
        is full. The device is read once, after the verifier (`_read`); with TEV and greedy nothing else is."""
        target, drafter, auto = self.target, self.drafter, rules.auto
        room = target.max_context - target.cache_len - 1  # positions left after the root
        if room <= 0:
            run.stopped_by = "context"
            return None
        cheap = auto is not None and auto.cheap_round()
        drafted, tree = self._draft(context, min(run.max_new_tokens - len(run.tokens) - 1, room - 1), cheap, rules,
                                    timer)
        with timer("target"):
            forward = target.forward_tree(tree, check=False)  # screened in `_read`
        with timer("verify"):
            rows = WarpedRows(forward.logits, rules.params, check=False)  # p_v, warped where a verifier reads it
            cut = frontier(drafted, tree.size)  # nodes `auto` dropped whose parent it kept: their edges are seen too
            rows.also_read([drafted.parent_list[u] for u in cut], [drafted.token_list[u] for u in cut])
            decision = DECIDERS[rules.verifier](tree, rows, rules.generator)
            verdict, coverage, reach = _read(target, forward, tree, drafted, rows, decision, rules.generator)
        with timer("commit"):
            target.commit(tree, verdict.path)
            kept = [0, *verdict.path]
            if kept == list(range(len(kept))):  # the root and a chain prefix: a view, not a gather
                kept = slice(len(kept))
            drafter.commit(tree.tokens[kept], forward.features[kept] if forward.features is not None else None)
        if drafted.num_nodes:
            drafter.observe(drafted, reach)
        if auto is not None:
            stage = timer.last
            auto.record(cheap, tree.num_nodes, stage["draft"] + stage["build"],
                        stage["target"] + stage["verify"] + stage["commit"], coverage)
        block = verdict.output_tokens(tree)
        emitted = run.emit(block)
        context.extend(block)
        if on_round is not None:
            on_round(RoundTrace(tree, rows.all(), verdict, emitted))
        return RoundStats(tree.num_nodes, len(verdict.path), emitted, coverage)

    def _draft(self, context: list[int], max_depth: int, cheap: bool, rules: _Rules, timer: StageTimer):
        """(the tree the drafter built, the head of it that this round verifies, on the target's device)."""
        root, cap, device = context[-1], rules.cap, self.target.device
        if cap == 0 or max_depth <= 0:
            tree = DraftTree.root_only(root, device)
            return tree, tree
        with timer("draft"):
            proposal = self.drafter.propose(context, max_depth, cheap=cheap)
        with timer("build"):
            drafted = self.drafter.build(proposal, root, cap)
            if drafted.num_nodes > cap or drafted.depth > max_depth or drafted.token_list[0] != root:
                raise RuntimeError(
                    f"drafter returned a tree of {drafted.num_nodes} nodes, depth {drafted.depth}, root "
                    f"{drafted.token_list[0]}; expected at most {cap} nodes, depth {max_depth}, root {root}"
                )
            tree = rules.auto.choose(drafted, cheap) if rules.auto is not None else drafted  # its best head
        return drafted, tree.to(device)


@dataclass(frozen=True)
class _Rules:
    """What a generate call fixes for all its rounds."""

    params: SamplingParams
    verifier: str
    cap: int  # at most this many draft tokens a tree
    auto: AutoBudget | None  # `--budget auto`'s choices, or None for a fixed budget
    generator: torch.Generator


def _read(target: TargetModel, forward, tree: DraftTree, drafted: DraftTree, rows: WarpedRows, decision: Decision,
          generator) -> tuple[Verdict, float, list[float]]:
    """The round's one host read: the exit node and bonus, whether the logits are finite, C_p (Eq. 5), and the
    realised P(u) of the drafted tree's nodes as far as this forward shows them (flow.observed_reach), which
    the drafter's estimates learns from. Non-finite logits roll the cache back and raise."""
    flow = decision.flow
    finite = finite_rows(forward.logits).all().view(1)
    numbers = torch.cat([decision.scalars(), finite, flow.reach, rows.extra_edges()])
    numbers = numbers.tolist()  # float32: token ids below 2^24 are exact
    (node, bonus, drawable, ok), numbers = numbers[:4], numbers[4:]
    coverage = sum(numbers[1 : tree.size])  # C_p = Σ_{u≠root} P(u) (Eq. 5)
    if not ok:
        target.reject(forward.logits, "node")
    verdict = decision.verdict(tree, rows, generator, int(node), int(bonus), bool(drawable))
    return verdict, coverage, observed_reach(drafted, tree.size, numbers[: tree.size], numbers[tree.size :])


def generate_autoregressive(
    target: TargetModel,
    prompt: Prompt,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_tokens: Iterable[int] | None = None,
    stream: Callable[[str], None] | None = None,
    chat: bool = True,
) -> GenerationResult:
    """The SR baseline: one target forward and one draw per token, on the same backend and cache."""
    params = SamplingParams(temperature, top_k, top_p)
    run, prompt_ids, timer = _start_run(target, prompt, max_new_tokens, stop_tokens, stream, chat)
    target.prefill(torch.tensor(prompt_ids[:-1], device=target.device))
    prefill_seconds = timer.elapsed()
    generator = torch.Generator(device=target.device).manual_seed(seed)
    token, rounds = prompt_ids[-1], []
    while not run.done:
        if target.cache_len + 1 >= target.max_context:
            run.stopped_by = "context"
            break
        with timer("target"):  # the token goes over from the host, checked there; the logits are screened below
            logits = target.forward_tokens(torch.tensor([token]), check=False).logits  # [1, V]
        with timer("verify"):
            token = _draw_screened(target, logits, params, generator)
        rounds.append(RoundStats(0, 0, run.emit([token]), 0.0))
    return _finish_run(target, run, prompt_ids, rounds, timer, prefill_seconds)


def _draw_screened(target: TargetModel, logits: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """An autoregressive step's token drawn from logits [1, V], read to the host together with the logits'
    finiteness: the step's one host read. Non-finite logits roll the step back and raise."""
    drawn = WarpedRows(logits, params, check=False).draw(0, generator)  # [] on the device
    token, finite = torch.stack([drawn, finite_rows(logits).all().long()]).tolist()
    if not finite:
        target.reject(logits, "token", appended=1)
    return token


def _start_run(target: TargetModel, prompt, max_new_tokens, stop_tokens, stream, chat):
    timer = StageTimer(target.device)  # a run's time starts before its prompt is encoded
    prompt_ids = encode_prompt(target.tokenizer, prompt, chat)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(prompt_ids) >= target.max_context:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens, which does not fit the model's context of "
            f"{target.max_context} tokens with room to generate"
        )
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token {bad[0]} is outside the model's vocabulary of {target.vocab_size}")
    stops = default_stop_tokens(target) if stop_tokens is None else {int(t) for t in stop_tokens}
    text_stream = TextStream(target.tokenizer, stream) if stream and target.tokenizer is not None else None
    target.reset()
    return _Run(max_new_tokens, stops, text_stream), prompt_ids, timer


def _finish_run(target, run, prompt_ids, rounds, timer, prefill_seconds) -> GenerationResult:
    total = timer.elapsed()  # a sync: the last round's commit may still be queued
    text = target.tokenizer.decode(run.tokens, skip_special_tokens=True) if target.tokenizer is not None else None
    return GenerationResult(
        prompt_ids, run.tokens, text, rounds, dict(timer.seconds), prefill_seconds, total, run.stopped_by,
        target.forward_config(),
    )

