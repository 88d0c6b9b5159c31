"""JSON and JSONL files, read with errors that name the file and the line (a checkpoint's config, prompts,
rollouts, training state): one way to read what exitspec and its users store."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_json(path: str | Path) -> Any:
    """The value in a JSON file; ValueError naming the file, line and column where it is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def read_jsonl(path: str | Path, opener: Callable = open) -> list:
    """One value per non-blank line of a JSONL file (`opener`: e.g. gzip.open); ValueError naming the file and
    the line that is not JSON."""
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno})") from None
    return rows
