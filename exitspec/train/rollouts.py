"""Rollouts: the target's own responses to training prompts, cached on disk as JSONL shards.

A rollout folder holds

    meta.json           the generation settings; a folder is only ever extended with the same settings
    shard-00000.jsonl   one record per line: {"id": str, "prompt_ids": [int], "response_ids": [int]}
    shard-00001.jsonl   ...

Each shard is written to a temporary file and renamed into place, so a shard is either complete or absent:
a killed job restarts by skipping every prompt id already present in some shard. A response ends with the
first end-of-sequence token (kept: the drafter learns to propose it), after max_new_tokens, or, with
`loop_repeats` R > 0, once some span of 4–64 tokens has come R times back to back: generation stops there
and the response keeps the first R − 1 copies (a small model's repetition loops would otherwise fill a third
of the data). Such records carry "looped": true.

A training folder may hold several rollout folders (say greedy/ and t1/, made with different settings):
`load_rollouts` reads every shard below it, and `RolloutData` deals the sequences out to the trainer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from exitspec.atomic import write_atomic
from exitspec.jsonfiles import read_json, read_jsonl
from exitspec.train.generate import LOOP_SPANS, generate_responses

META_NAME = "meta.json"
SHARD_GLOB = "shard-*.jsonl"


@dataclass(frozen=True)
class GenerationSettings:
    model: str  # the target's name or folder, to keep rollouts of different targets apart
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # with the prompt id, seeds that prompt's sampling (generate.py)
    loop_repeats: int = 0  # > 0: stop a response at the R-th back-to-back copy of a span (see loop_start)


@dataclass(frozen=True)
class Rollout:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]


class RolloutData:
    """Training sequences (prompt + response, cut to max_len) dealt out in a seeded, length-bucketed order.

    The data is one endless stream: position g is sequence order_e[g mod N] of epoch e = g // N. order_e is a
    permutation seeded by (seed, e), cut into buckets of `bucket_steps` global batches (`step_size` positions
    each); a bucket is sorted by length, split back into batches and those are shuffled. So one step's
    sequences have similar lengths (little padding), while the batches still come in random order. A step
    consumes `step_size` = world × batch_size positions, process r taking the r-th slice, so the data
    position of a run is a single integer.
    """

    def __init__(self, rollouts: list[Rollout], max_len: int, seed: int, step_size: int = 1, bucket_steps: int = 16):
        kept = [r for r in rollouts if len(r.prompt_ids) + 2 <= min(max_len, len(r.prompt_ids) + len(r.response_ids))]
        self.seqs = [((r.prompt_ids + r.response_ids)[:max_len], len(r.prompt_ids)) for r in kept]
        self.keys = [r.id for r in kept]  # rollout ids, aligned with seqs
        self.dropped = len(rollouts) - len(self.seqs)
        if not self.seqs:
            raise ValueError("no rollout has a response of two tokens or more within max_len")
        self.seed, self.step_size, self.bucket_steps = seed, step_size, bucket_steps
        self.lengths = torch.tensor([len(ids) for ids, _ in self.seqs])  # [N]
        self._order: tuple[int, Tensor] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def epoch_order(self, epoch: int) -> Tensor:
        """[N] sequence indices of epoch `epoch` in stream order."""
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(len(self), generator=gen)
        batches = []
        for bucket in perm.split(self.step_size * self.bucket_steps):
            by_length = bucket[self.lengths[bucket].argsort(stable=True)]
            batches += by_length.split(self.step_size)
        return torch.cat([batches[i] for i in torch.randperm(len(batches), generator=gen)])

    def indices(self, position: int, count: int) -> list[int]:
        """Sequence indices at stream positions position .. position+count−1."""
        out = []
        for g in range(position, position + count):
            epoch = g // len(self)
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, self.epoch_order(epoch))
            out.append(int(self._order[1][g % len(self)]))
        return out

    def keys_at(self, position: int, rank: int, batch_size: int) -> list[str]:
        """The rollout ids of `batch`'s rows, in its order."""
        return [self.keys[i] for i in self.indices(position + rank * batch_size, batch_size)]

    def batch(self, position: int, rank: int, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Process `rank`'s share of the step at `position`: ids [B, L] right-padded with 0, starts [B] (first
        response token), lengths [B]."""
        seqs = [self.seqs[i] for i in self.indices(position + rank * batch_size, batch_size)]
        ids = pad_sequence([torch.tensor(seq) for seq, _ in seqs], batch_first=True)  # [B, L]
        return ids, torch.tensor([s for _, s in seqs]), torch.tensor([len(seq) for seq, _ in seqs])


def load_rollouts(folder: str | Path) -> list[Rollout]:
    """Every rollout of every complete shard in or below `folder`, sorted by (sub-folder, id): a deterministic
    order, whatever the shard layout. Ids are prefixed with their sub-folder ("t1/gsm8k-train/3")."""
    folder = Path(folder)
    shards = sorted(folder.rglob(SHARD_GLOB))
    if not shards:
        raise FileNotFoundError(
            f"no rollout shards in {folder}; make them with `exitspec train dflash --rollouts-only`"
        )
    rollouts = {}
    for shard in shards:
        prefix = shard.parent.relative_to(folder).as_posix()
        for r in read_jsonl(shard):
            key = r["id"] if prefix == "." else f"{prefix}/{r['id']}"
            rollouts[key] = Rollout(key, r["prompt_ids"], r["response_ids"])
    return [rollouts[k] for k in sorted(rollouts)]


def summarize_rollouts(folder: str | Path) -> dict:
    """Over every shard in or below `folder`: rollouts, response tokens, responses stopped in a loop, and
    `loop_tokens_cut`: what those would have added had they run to max_new_tokens (an upper bound on the
    tokens the loop cut removed; a small model's loops mostly do run to the cap)."""
    counts = {"rollouts": 0, "response_tokens": 0, "looped": 0, "loop_tokens_cut": 0}
    for meta in Path(folder).rglob(META_NAME):  # one rollout folder each, with its own cap
        cap = read_json(meta)["max_new_tokens"]
        for shard in meta.parent.glob(SHARD_GLOB):
            for r in read_jsonl(shard):
                counts["rollouts"] += 1
                counts["response_tokens"] += len(r["response_ids"])
                counts["looped"] += bool(r.get("looped"))
                counts["loop_tokens_cut"] += cap - len(r["response_ids"]) if r.get("looped") else 0
    return counts


def done_ids(folder: str | Path) -> set[str]:
    """Ids of the prompts that already have a rollout in `folder`."""
    ids = set()
    for shard in Path(folder).glob(SHARD_GLOB):
        ids.update(r["id"] for r in read_jsonl(shard))
    return ids


def make_rollouts(
    model: PreTrainedModel,
    prompts: Sequence[tuple[str, list[int]]],
    folder: str | Path,
    settings: GenerationSettings,
    eos_ids: Sequence[int],
    pad_id: int,
    batch_size: int = 64,
    shard_size: int = 64,
    progress: bool = True,
) -> int:
    """Generates and stores the rollouts of the (id, prompt ids) pairs not yet in `folder`; returns how many.

    Prompts are taken in order, `batch_size` at a time in flight (generate.py); shard k holds prompts
    k·shard_size .. (k+1)·shard_size − 1 of the ones to do and is written as soon as all of them are done.
    """
    folder = Path(folder)
    _check_meta(folder, settings)
    done = done_ids(folder)
    todo = list({pid: ids for pid, ids in prompts if pid not in done}.items())  # also drops repeated ids
    first_shard = 1 + max((int(p.stem.split("-")[1]) for p in folder.glob(SHARD_GLOB)), default=-1)
    pending: dict[int, dict[int, dict]] = {}  # shard -> {prompt index: record}
    bar = tqdm(total=len(todo), desc="rollouts", unit="prompt", disable=not progress)
    tokens, start = 0, time.perf_counter()
    responses = generate_responses(model, todo, settings.max_new_tokens, settings.temperature, settings.seed,
                                   settings.loop_repeats, eos_ids, pad_id, batch_size)
    for index, response in responses:
        pid, ids = todo[index]
        cut = loop_start(response, settings.loop_repeats)
        loop = {} if cut is None else {"looped": True}
        shard = pending.setdefault(index // shard_size, {})
        shard[index] = {"id": pid, "prompt_ids": ids, "response_ids": response[:cut], **loop}
        if len(shard) == min(shard_size, len(todo) - index // shard_size * shard_size):
            records = [shard[i] for i in sorted(shard)]
            write_atomic(folder / f"shard-{first_shard + index // shard_size:05d}.jsonl",
                          "".join(json.dumps(r) + "\n" for r in records))
            del pending[index // shard_size]
        tokens += len(response)
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    bar.close()
    return len(todo)


def loop_start(tokens: list[int], repeats: int, spans: range = LOOP_SPANS) -> int | None:
    """Where to cut a response that loops, or None: at the first token where some span has come `repeats`
    times back to back (the place generation stops), the start of that span's last copy. Cutting there keeps
    repeats − 1 copies: a text quoted twice survives, a loop does not."""
    if repeats < 2:
        return None
    runs = dict.fromkeys(spans, 0)  # per span: how many tokens in a row equal the token `span` before them
    for j in range(len(tokens)):
        starts = []
        for span in spans:
            if j >= span:
                runs[span] = runs[span] + 1 if tokens[j] == tokens[j - span] else 0
                if runs[span] >= (repeats - 1) * span:  # tokens[j - repeats*span + 1 .. j]: `repeats` copies
                    starts.append(j - span + 1)
        if starts:
            return min(starts)
    return None


def end_tokens(model, tokenizer=None) -> list[int]:
    """The end-of-sequence ids of a model: its generation config's, else its tokenizer's (maybe none)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [eos] if isinstance(eos, int) else list(eos)


def stop_and_pad(model, tokenizer) -> tuple[list[int], int]:
    """The end-of-sequence ids that end a rollout, and the id that pads a batch."""
    eos = end_tokens(model, tokenizer)
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def _check_meta(folder: Path, settings: GenerationSettings) -> None:
    """Writes meta.json in a new folder; in an existing one, refuses other settings than those it was made with."""
    defaults = {f.name: f.default for f in fields(GenerationSettings) if f.default is not MISSING}
    check_folder_meta(folder, asdict(settings), "rollouts", defaults)


def check_folder_meta(folder: Path, meta: dict, what: str, defaults: dict | None = None) -> None:
    """A cache folder's meta.json: written in a new folder; in an existing one, anything but `meta` is refused
    (a field added since the folder was made counts as its value in `defaults`)."""
    path = folder / META_NAME
    if path.is_file():
        old = (defaults or {}) | json.loads(path.read_text())
        if old != meta:
            raise ValueError(f"{folder} holds {what} made with {old}, not {meta}; use another folder")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(meta, indent=2) + "\n")

