"""The benchmark loop: speculative runs and their baselines, measured side by side, one JSONL row at a time.

For every dataset sample, temperature, repeat and turn (in that nesting, so a turn follows the answers
to the turns before it):

    baseline row   once, shared by every drafter/budget/verifier   exitspec's autoregressive loop and
                                                                   transformers' model.generate, timed
    spec rows      one per Config (drafter, budget, verifier)      SpeculativeDecoder.generate, timed;
                                                                   SR against the baseline row

Like with like: a spec row and its baseline row share the prompt ids, max_new_tokens, temperature, top-p,
top-k, seed and stop tokens, and all three runs get the prompt as token ids (no tokenisation timed).
A context turn (data.Sample.context_turns: mtbench-revise's first turn) has a baseline row only, for the
answer the measured turn follows; peers and the report skip it.
SR = baseline seconds / speculative seconds for the same number of tokens (total seconds of each generate
call, prefill included, per generated token; at temperature 0 both runs emit the same tokens and it is the
plain ratio of seconds). Each kind of run is warmed up once (8 tokens) before its first timed call.

Rows (rows.py: EnvRow, BaselineRow, SpecRow) are appended to one JSONL file, flushed and fsynced as they are
measured; a rerun with the same file skips every row already there (key: kind, dataset, prompt id, turn,
repeat, seed, sampling settings, max_new_tokens and, for spec rows, the config), so a killed run loses nothing
it had measured. The file starts with an "env" row per session; a rerun refuses a file measured with another
model, dtype, device or thread count. Repeats alternate the order (Plan.steps): even ones time the baseline
first, odd ones the first spec config, so `--repeats 2` pairs every prompt's runs both ways round.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import platform
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from exitspec.bench.rows import ARRun, BaselineRow, EnvRow, HFRun, PeerRow, Row, SpecRow, dump_row, load_row
from exitspec.budget import CostModel
from exitspec.data import Sample
from exitspec.decode import GenerationResult, SpeculativeDecoder, default_stop_tokens, encode_prompt
from exitspec.drafters import drafter_folder
from exitspec.drafters.chain import CHAIN_PREFIX
from exitspec.models import default_model_dir
from exitspec.sampling import SamplingParams
from exitspec.settings import budget_cap, cpu_name, parse_budget
from exitspec.timing import StageTimer
from exitspec.verify import check_verifier

BASELINE_KEY = ("dataset", "prompt_id", "turn", "repeat", "seed", "temperature", "top_p", "top_k", "max_new_tokens")
SPEC_KEY = (*BASELINE_KEY, "drafter", "budget", "verifier")
PEER_KEY = (*BASELINE_KEY, "peer")
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Config:
    """One speculative setting; with a dataset and a temperature it is one column of the report."""

    drafter: str  # "dflash", "ngram", a DFlash folder, or "chain:<drafter>" (see ChainDrafter)
    budget: int | str  # B, or "auto:B" (budget.py)
    verifier: str


def configs(drafters: list[str], budgets: list[int], verifiers: list[str], chain: bool) -> list[Config]:
    """Drafters x budgets x verifiers, preceded by each drafter's chain at the largest budget if `chain`."""
    largest = max(budget_cap(b) for b in budgets)
    chains = [Config(CHAIN_PREFIX + d, largest, v) for d in drafters for v in verifiers] if chain else []
    return chains + [Config(d, b, v) for d in drafters for b in budgets for v in verifiers]


@dataclass(frozen=True)
class Step:
    """One row to measure: the baselines of a turn (config None) or one config's speculative run."""

    dataset: str
    sample: Sample
    temperature: float
    repeat: int
    turn: int
    config: Config | None


@dataclass
class Plan:
    """What to measure: datasets x temperatures x configs, each sample `repeats` times (seed + repeat)."""

    datasets: dict[str, list[Sample]]
    configs: list[Config]
    temperatures: list[float]
    max_new_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    repeats: int = 1
    seed: int = 0

    def __post_init__(self):
        self.temperatures = [float(t) for t in self.temperatures]
        if self.max_new_tokens < 1 or self.repeats < 1:
            raise ValueError("max_new_tokens and repeats must be >= 1")
        for t in self.temperatures:
            SamplingParams(t, self.top_k, self.top_p)  # raises on a bad setting
        for c in self.configs:
            check_verifier(c.verifier, SamplingParams(0.0))  # raises on an unknown name
            parse_budget(c.budget)  # raises on a bad budget
        if not any(self.configs_at(t) for t in self.temperatures):
            raise ValueError("no valid (drafter, budget, verifier, temperature) combination to run")

    def configs_at(self, temperature: float) -> list[Config]:
        """The configs valid at `temperature`: the greedy verifier is exact only at 0."""
        return [c for c in self.configs if c.verifier != "greedy" or temperature == 0]

    def steps(self) -> Iterator[Step]:
        """Every row in run order, after the turns before it. Repeats alternate which runs first: an even repeat
        times the baseline, then the spec configs; an odd one the first spec config, then the baseline (measured
        within that spec step, `_measure`), then the rest. So `--repeats 2` pairs A S with S A."""
        for name, samples in self.datasets.items():
            for sample in samples:
                for temperature in self.temperatures:
                    configs = self.configs_at(temperature)
                    for repeat in range(self.repeats):
                        order = (None, *configs) if repeat % 2 == 0 or not configs else (configs[0], None, *configs[1:])
                        for turn in range(sample.num_turns):
                            measured = turn >= sample.context_turns  # a context turn needs only its AR answer
                            for config in order if measured else (None,):
                                yield Step(name, sample, temperature, repeat, turn, config)

    def ends_measured_turn(self, step: Step) -> bool:
        """Whether `step` is the last row of a turn that is measured (not a context turn)."""
        configs = self.configs_at(step.temperature)
        last = configs[-1] if configs else None
        return step.turn >= step.sample.context_turns and step.config == last

    def key(self, step: Step) -> dict:
        """The fields that name the row of `step` (kind included)."""
        key = {
            "kind": "baseline" if step.config is None else "spec",
            "dataset": step.dataset,
            "prompt_id": step.sample.id,
            "turn": step.turn,
            "repeat": step.repeat,
            "seed": self.seed + step.repeat,
            "temperature": step.temperature,
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_new_tokens": self.max_new_tokens,
        }
        return key if step.config is None else {**key, **asdict(step.config)}


def row_key(row: BaselineRow | SpecRow | PeerRow | dict) -> tuple:
    """The identity of a result row (or of a Plan.key dict): its kind and key fields."""
    get = row.get if isinstance(row, dict) else lambda f: getattr(row, f)
    fields = {"spec": SPEC_KEY, "peer": PEER_KEY}.get(get("kind"), BASELINE_KEY)
    return (get("kind"), *(get(f) for f in fields))


@contextmanager
def results_lock(folder: Path) -> Iterator[None]:
    """Holds `folder`/.lock while one bench writes the folder: a second bench there gets a one-line error naming the
    holder. The lock is the kernel's (flock), so a run that was killed held nothing, and the next one just takes it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(f"{folder} is being written by another bench ({holder}); wait for it to finish, or give "
                             "this one another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                f"{datetime.datetime.now().isoformat(timespec='seconds')}\n")
        f.flush()
        yield


class ResultsFile:
    """An append-only JSONL of result rows, indexed by row_key; each append is flushed and fsynced.

    A kill can tear the last line; reading ignores such a tail and the first append cuts it off, so appends
    start on a clean line (a reader never writes).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.envs: list[EnvRow] = []
        self._rows: dict[tuple, BaselineRow | SpecRow] = {}
        self._complete: int | None = None  # bytes of whole lines, when a torn tail follows them
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):
            self._complete = len(complete)
        for n, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = load_row(line)
            except ValueError as e:  # json.JSONDecodeError is one
                raise ValueError(f"{self.path}, line {n}: {e}; is this a results file?") from e
            if isinstance(row, EnvRow):
                self.envs.append(row)
            else:
                self._rows[row_key(row)] = row

    @property
    def rows(self) -> list[BaselineRow | SpecRow]:
        return list(self._rows.values())

    def get(self, key: dict) -> BaselineRow | SpecRow | None:
        return self._rows.get(row_key(key))

    def append(self, row: Row) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._complete is not None:
            with self.path.open("r+b") as f:
                f.truncate(self._complete)
            self._complete = None
        with self.path.open("a", encoding="utf-8") as f:
            f.write(dump_row(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if isinstance(row, EnvRow):
            self.envs.append(row)
        else:
            self._rows[row_key(row)] = row

    def start_session(self, env: EnvRow) -> None:
        """Checks that `env` matches the file's first session (model, dtype, device, threads, drafters), then
        logs it: a spec row may be timed against a baseline of an earlier session, so conditions must agree."""
        if self.envs:
            first = self.envs[0]
            for what in ("model_sha", "dtype", "device", "device_name", "threads"):
                if getattr(first, what) != getattr(env, what):
                    raise ValueError(
                        f"{self.path} holds results measured with {what} {getattr(first, what)!r}, this run has "
                        f"{getattr(env, what)!r}; use another --out folder or delete the file"
                    )
            for spec, sha in env.drafters.items():
                old = next((e.drafters[spec] for e in self.envs if spec in e.drafters), sha)
                if old != sha:
                    raise ValueError(f"drafter {spec!r} changed since {self.path} was written (hash {old} -> {sha})")
        self.append(env)


def speedup(base_seconds: float, base_tokens: int, spec_seconds: float, spec_tokens: int) -> float | None:
    """SR: baseline seconds over speculative seconds for the same number of tokens (None without tokens)."""
    if min(base_tokens, spec_tokens) == 0 or spec_seconds <= 0:
        return None
    return (base_seconds / base_tokens) / (spec_seconds / spec_tokens)


def hf_generate(model, prompt_ids: list[int], stop_tokens: set[int], max_new_tokens: int, temperature: float,
                top_p: float, top_k: int, seed: int, **options) -> list[int]:
    """transformers' own model.generate on one prompt (sampling seeded through torch's global generator);
    `options` go to generate as they are (prompt_lookup_num_tokens: its prompt lookup)."""
    ids = torch.tensor([prompt_ids], device=model.device)  # [1, L]
    stops = sorted(stop_tokens)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k} if temperature > 0 else {}
    torch.manual_seed(seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
        do_sample=temperature > 0, eos_token_id=stops or None, pad_token_id=stops[0] if stops else None,
        **sampling, **options,
    )  # [1, L + n]
    return out[0, len(prompt_ids) :].tolist()


class Runner:
    """One target model and its drafters, and the three timed ways to generate with them."""

    def __init__(self, decoders: dict[str, SpeculativeDecoder]):
        """decoders: app.load_decoders' result, one per drafter spec, sharing the target's weights."""
        self.first = next(iter(decoders.values()))  # its `autoregressive` is the baseline
        self.target = self.first.target
        self.hf_model = self.target.model
        self.decoders = decoders
        self.stops = default_stop_tokens(self.target)
        self._warm: set = set()

    def adopt(self, cost: CostModel) -> None:
        """Runs every decoder by `cost` (a grid measured before, on the same weights), row plan and all: a resumed
        results file times its spec rows against its first session's baselines, so it runs as that session did."""
        for decoder in self.decoders.values():
            decoder.calibrate(cost.sizes[-1], cost=cost)

    def encode(self, prompt) -> list[int]:
        return encode_prompt(self.target.tokenizer, prompt)

    def baseline(self, prompt_ids: list[int], gen: dict) -> dict:
        """The AR loop and transformers' generate on prompt_ids: the fields `ar` and `hf` of a BaselineRow.
        gen: max_new_tokens, temperature, top_p, top_k, seed."""
        self._warm_up("baseline", lambda g: (self._ar(prompt_ids, g), self._hf(prompt_ids, g)), gen)
        ar = self._ar(prompt_ids, gen)
        hf_tokens, hf_seconds = self._hf(prompt_ids, gen)
        summary = ar.summary()
        kept = ("new_tokens", "total_seconds", "prefill_seconds", "tokens_per_second", "stage_seconds", "stopped_by",
                "forward")
        return {
            "ar": ARRun(tokens=ar.tokens, text=ar.text, **{k: summary[k] for k in kept}),
            "hf": HFRun(tokens=hf_tokens, new_tokens=len(hf_tokens), total_seconds=hf_seconds,
                        tokens_per_second=len(hf_tokens) / hf_seconds if hf_seconds > 0 else 0.0),
        }

    def speculative(self, config: Config, prompt_ids: list[int], gen: dict) -> GenerationResult:
        """One speculative run of `config` (warmed up the first time)."""
        decoder = self.decoders[config.drafter]
        settings = dict(gen, budget=config.budget, verifier=config.verifier, stop_tokens=self.stops)
        self._warm_up(config, lambda g: decoder.generate(prompt_ids, **dict(settings, **g), learn=False), gen)
        return decoder.generate(prompt_ids, **settings)

    @staticmethod
    def paired(config: Config, result: GenerationResult, baseline: BaselineRow) -> dict:
        """A spec row's fields: `result` of `config` with its SRs against `baseline` (a baseline row)."""
        if baseline.ar.forward and result.forward_config != baseline.ar.forward:
            raise ValueError(f"{config.drafter} ran forward configuration {result.forward_config}, its baseline row "
                             f"{baseline.ar.forward}: SR would compare unlike runs; use another --out folder")
        stats = result.summary()
        del stats["coverage_per_round"]  # mean_coverage is what the report uses
        ar, hf = baseline.ar, baseline.hf
        n, seconds = len(result.tokens), result.total_seconds
        return {
            "tokens": result.tokens,
            **stats,
            "sr_ar": speedup(ar.total_seconds, ar.new_tokens, seconds, n),
            "sr_hf": speedup(hf.total_seconds, hf.new_tokens, seconds, n),
            "ar_seconds": ar.total_seconds,
            "ar_tokens": ar.new_tokens,
            "hf_seconds": hf.total_seconds,
            "hf_tokens": hf.new_tokens,
            "matches_ar": result.tokens == ar.tokens,
        }

    def _ar(self, prompt_ids, gen):
        return self.first.autoregressive(prompt_ids, stop_tokens=self.stops, **gen)

    def _hf(self, prompt_ids, gen) -> tuple[list[int], float]:
        timer = StageTimer(self.target.device)
        tokens = hf_generate(self.hf_model, prompt_ids, self.stops, **gen)
        return tokens, timer.elapsed()

    def _warm_up(self, what, run: Callable[[dict], object], gen: dict) -> None:
        """Runs `run` once on a few tokens the first time `what` is measured, so one-time costs stay untimed."""
        if what not in self._warm:
            run(dict(gen, max_new_tokens=min(WARMUP_TOKENS, gen["max_new_tokens"])))
            self._warm.add(what)


@dataclass
class _Live:
    """Running totals over this session's spec rows, for the progress line."""

    accepted: int = 0
    rounds: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"spec": 0.0, "ar": 0.0})
    tokens: dict[str, int] = field(default_factory=lambda: {"spec": 0, "ar": 0})

    def add(self, row: SpecRow) -> str:
        self.accepted += sum(row.accepted_lengths)
        self.rounds += row.rounds
        runs = (("spec", row.total_seconds, row.new_tokens), ("ar", row.ar_seconds, row.ar_tokens))
        for kind, seconds, tokens in runs:
            self.seconds[kind] += seconds
            self.tokens[kind] += tokens
        sr = speedup(self.seconds["ar"], self.tokens["ar"], self.seconds["spec"], self.tokens["spec"])
        return f"τ {(self.accepted + self.rounds) / max(self.rounds, 1):.2f} · SR {sr or 0:.2f}×"


def run_plan(plan: Plan, runner: Runner, results: ResultsFile, limit: int | None = None, progress: bool = True,
             after_turn: Callable[[dict, list[int]], int] | None = None) -> int:
    """Measures every row of `plan` missing from `results` (at most `limit` new rows); returns how many it added.
    `after_turn(baseline key, prompt ids)`, run after the last row of each measured turn once that turn's baseline
    row is in `results`, measures the interleaved peers of that prompt and returns how many rows it added."""
    live, added = _Live(), 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[live]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        steps = list(plan.steps())
        done = sum(results.get(plan.key(s)) is not None for s in steps)
        task = bar.add_task("bench", total=len(steps), completed=done, live="")
        for step, key, prompt_ids in _prompts(plan, runner, results):
            if results.get(key) is None:
                if limit is not None and added >= limit:
                    break
                bar.update(task, description=f"{step.dataset} {step.sample.id} T={step.temperature:g}")
                row = _measure(plan, runner, results, step, key, prompt_ids)
                results.append(row)
                added += 1
                bar.update(task, advance=1, **({"live": live.add(row)} if step.config else {}))
            base = plan.key(replace(step, config=None))
            if after_turn and plan.ends_measured_turn(step) and results.get(base) is not None:
                added += after_turn(base, prompt_ids)
    return added


def baseline_prompts(plan: Plan, results: ResultsFile, runner: Runner) -> list[tuple[dict, list[int]]]:
    """(key, prompt ids) of every measured turn's baseline row of `plan` that `results` holds: what the peers
    decode."""
    return [(key, ids) for step, key, ids in _prompts(plan, runner, results)
            if step.config is None and step.turn >= step.sample.context_turns and results.get(key) is not None]


def _prompts(plan: Plan, runner: Runner, results: ResultsFile) -> Iterator[tuple[Step, dict, list[int]]]:
    """Every step of `plan` in order, with its row key and prompt ids; a later turn follows the autoregressive
    loop's own answers to the turns before it, so it is known once their baseline rows are in `results`."""
    answers: dict[tuple, list[str]] = {}  # (dataset, sample id, temperature, repeat) -> AR answers to earlier turns
    for step in plan.steps():
        key = plan.key(step)
        conversation = answers.setdefault((step.dataset, step.sample.id, step.temperature, step.repeat), [])
        yield step, key, runner.encode(step.sample.prompt(step.turn, conversation))
        row = results.get(key)
        if step.config is None and row is not None:
            conversation.append(row.ar.text or "")


def _measure(plan: Plan, runner: Runner, results: ResultsFile, step: Step, key: dict, prompt_ids: list[int]
             ) -> BaselineRow | SpecRow:
    """The row of one step: the baselines, or a spec run against the recorded baselines of the same prompt. A spec
    step whose baseline is not measured yet (an odd repeat, Plan.steps) runs first, then measures the baseline and
    appends its row: a pair timed S then A."""
    prompt = {"prompt_tokens": len(prompt_ids), "prompt_sha": _sha(json.dumps(prompt_ids).encode())}
    gen = {"max_new_tokens": plan.max_new_tokens, "temperature": step.temperature, "top_p": plan.top_p,
           "top_k": plan.top_k, "seed": key["seed"]}
    fields = {k: v for k, v in key.items() if k != "kind"}
    base_key = plan.key(replace(step, config=None))
    if step.config is None:
        return BaselineRow(**fields, **prompt, **runner.baseline(prompt_ids, gen))
    baseline = results.get(base_key)
    result = runner.speculative(step.config, prompt_ids, gen)
    if baseline is None:
        baseline = BaselineRow(**{k: v for k, v in base_key.items() if k != "kind"}, **prompt,
                               **runner.baseline(prompt_ids, gen))
        results.append(baseline)
    if baseline.prompt_sha != prompt["prompt_sha"]:
        raise ValueError(f"the prompt of {step.dataset}/{step.sample.id} turn {step.turn} is not the one its recorded "
                         "baseline was measured on; use another --out folder")
    return SpecRow(**fields, **prompt, **runner.paired(step.config, result, baseline))


def environment(model: str | Path | None, runner: Runner, drafters: list[str], lookup: str = "auto") -> EnvRow:
    """The header row of a session: where and with what the numbers were measured."""
    device = runner.target.device
    model_dir = default_model_dir() if model is None else Path(model)
    return EnvRow(
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        device=device.type,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        dtype=str(runner.hf_model.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        model=str(model_dir),
        model_sha=folder_sha(model_dir),
        drafters={spec: drafter_sha(spec) for spec in drafters},
        lookup=str(lookup),
        forward=runner.target.forward_config(),
        warm_start=runner.first.warm_start,
        cost=runner.first.costs[max(runner.first.costs)].to_dict() if runner.first.costs else {},
    )


def drafter_sha(spec: str) -> str:
    """The drafter's name for training-free ones, else the hash of its checkpoint folder."""
    folder = drafter_folder(spec)
    return spec if folder is None else folder_sha(folder)


def folder_sha(folder: Path) -> str:
    """SHA-256 (16 hex digits) of a model folder's safetensors files, names and contents, in name order."""
    digest = hashlib.sha256()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return "no-safetensors"
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
