"""Rollouts: the target's own responses to training prompts, cached on disk as JSONL shards.

A rollout folder holds

    meta.json           the generation settings; a folder is only ever extended with the same settings
    shard-00000.jsonl   one record per line: {"id": str, "prompt_ids": [int], "response_ids": [int]}
    shard-00001.jsonl   ...

Each shard is written to a temporary file and renamed into place, so a shard is either complete or absent:
a killed job restarts by skipping every prompt id already present in some shard. A response ends with the
first end-of-sequence token (kept: the drafter learns to propose it) or after max_new_tokens.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

META_NAME = "meta.json"
SHARD_GLOB = "shard-*.jsonl"


@dataclass(frozen=True)
class GenerationSettings:
    model: str  # the target's name or folder, to keep rollouts of different targets apart
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sampling seed of shard i is seed + i


@dataclass(frozen=True)
class Rollout:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]


def load_rollouts(folder: str | Path) -> list[Rollout]:
    """Every rollout of every complete shard, sorted by id (a deterministic order, whatever the shard layout)."""
    shards = sorted(Path(folder).glob(SHARD_GLOB))
    if not shards:
        raise FileNotFoundError(
            f"no rollout shards in {folder}; make them with `exitspec train dflash --rollouts-only`"
        )
    rollouts = {}
    for shard in shards:
        with shard.open(encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                rollouts[r["id"]] = Rollout(r["id"], r["prompt_ids"], r["response_ids"])
    return [rollouts[k] for k in sorted(rollouts)]


def done_ids(folder: str | Path) -> set[str]:
    """Ids of the prompts that already have a rollout in `folder`."""
    ids = set()
    for shard in Path(folder).glob(SHARD_GLOB):
        with shard.open(encoding="utf-8") as f:
            ids.update(json.loads(line)["id"] for line in f)
    return ids


def make_rollouts(
    model: PreTrainedModel,
    prompts: Sequence[tuple[str, list[int]]],
    folder: str | Path,
    settings: GenerationSettings,
    eos_ids: Sequence[int],
    pad_id: int,
    batch_size: int = 16,
    shard_size: int = 64,
    progress: bool = True,
) -> int:
    """Generates and stores the rollouts of the (id, prompt ids) pairs not yet in `folder`; returns how many.

    Prompts are taken in order, `shard_size` per shard; inside a shard they are batched by length.
    """
    folder = Path(folder)
    _check_meta(folder, settings)
    done = done_ids(folder)
    todo = list({pid: ids for pid, ids in prompts if pid not in done}.items())  # also drops repeated ids
    shard_no = 1 + max((int(p.stem.split("-")[1]) for p in folder.glob(SHARD_GLOB)), default=-1)
    bar = tqdm(total=len(todo), desc="rollouts", unit="prompt", disable=not progress)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(todo), shard_size):
        shard = sorted(todo[i : i + shard_size], key=lambda p: len(p[1]))
        records = []
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            torch.manual_seed(settings.seed + shard_no)
            for j in range(0, len(shard), batch_size):
                batch = shard[j : j + batch_size]
                responses = generate(model, [ids for _, ids in batch], settings, eos_ids, pad_id)
                for (pid, ids), response in zip(batch, responses, strict=True):
                    records.append({"id": pid, "prompt_ids": ids, "response_ids": response})
                tokens += sum(map(len, responses))
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
        _write_atomic(folder / f"shard-{shard_no:05d}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        shard_no += 1
    bar.close()
    return len(todo)


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    settings: GenerationSettings,
    eos_ids: Sequence[int],
    pad_id: int,
) -> list[list[int]]:
    """One left-padded batched `generate`; each response is cut after its first end-of-sequence token."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W]
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    sample = settings.temperature > 0
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sample,
        temperature=settings.temperature if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
    )
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
    responses = []
    stop = set(eos_ids)
    for row in out[:, width:].tolist():  # [B, T]
        end = next((k + 1 for k, t in enumerate(row) if t in stop), len(row))
        responses.append(row[:end])
    return responses


def _check_meta(folder: Path, settings: GenerationSettings) -> None:
    """Writes meta.json in a new folder; in an existing one, refuses other settings than those it was made with."""
    meta = folder / META_NAME
    if meta.is_file():
        old = json.loads(meta.read_text())
        if old != asdict(settings):
            raise ValueError(f"{folder} holds rollouts made with {old}, not {asdict(settings)}; use another folder")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(meta, json.dumps(asdict(settings), indent=2) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
