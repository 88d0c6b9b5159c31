"""Cached target features: the frozen target's tapped hidden states of every rollout, computed once.

A DFlash training step needs the target's hidden states at the drafter's context layers for every token of
its sequences (dflash_loss.target_features). The target is frozen, so they never change: this module runs
the target once over the rollouts and stores them, and training then reads them instead of running the
target (`exitspec train dflash --features DIR`).

    DIR/meta.json                 {"target", "layer_ids", "dtype", "feature_size", "topk"}: a folder is only
                                  extended, or read, with the same ones
    DIR/shard-00000.safetensors   per rollout, named by its id: "<id>" [L, F] features of its L tokens (prompt +
                                  response, before any max_len cut); with topk = k > 0 also "<id>#p" [L, k]
                                  and "<id>#i" [L, k]: the target's k most likely next tokens at each position
                                  and their probabilities (the soft targets of the kl loss, dflash_loss.py)

Shards are written to a temporary file and renamed into place, so a killed job resumes by skipping every
rollout already in a complete shard. fp16 halves the disk (about 1.2 GB per million tokens for one
576-wide layer) at a relative error of about 5e-4 in the features.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from exitspec.atomic import atomic_file
from exitspec.models import check_safetensors
from exitspec.train.dflash_loss import features_and_logits, target_features
from exitspec.train.rollouts import META_NAME, Rollout, check_folder_meta

SHARD_GLOB = "shard-*.safetensors"


def cache_features(
    target: PreTrainedModel,
    rollouts: Sequence[Rollout],
    folder: str | Path,
    layer_ids: Sequence[int],
    target_name: str,
    dtype: torch.dtype = torch.float16,
    topk: int = 0,
    batch_size: int = 8,
    shard_size: int = 256,
    progress: bool = True,
) -> int:
    """Stores the features of the rollouts not yet in `folder`; returns how many it added."""
    folder = Path(folder)
    meta = {"target": target_name, "layer_ids": list(layer_ids), "dtype": str(dtype).removeprefix("torch."),
            "feature_size": target.config.get_text_config().hidden_size * len(layer_ids), "topk": topk}
    check_folder_meta(folder, meta, "features")
    done = set(shard_keys(folder))
    todo = sorted((r for r in rollouts if r.id not in done), key=lambda r: len(r.prompt_ids) + len(r.response_ids))
    shard_no = len(list(folder.glob(SHARD_GLOB)))
    device = next(target.parameters()).device
    bar = tqdm(total=len(todo), desc="features", unit="rollout", disable=not progress)
    for i in range(0, len(todo), shard_size):
        tensors = {}
        for batch in _chunks(todo[i : i + shard_size], batch_size):
            seqs = [r.prompt_ids + r.response_ids for r in batch]
            lengths = torch.tensor([len(s) for s in seqs], device=device)  # [B]
            ids = pad_sequence([torch.tensor(s, device=device) for s in seqs], batch_first=True)  # [B, L] right-padded
            if topk:  # one whole forward gives both
                features, logits = features_and_logits(target, ids, lengths, layer_ids)  # [B, L, F], [B, L, V]
                top = top_probs(logits, topk)  # ([B, L, k], [B, L, k])
            else:
                features, top = target_features(target, ids, lengths, layer_ids), None  # [B, L, F]
            for row, r in enumerate(batch):
                n = len(seqs[row])
                tensors[r.id] = features[row, :n].to("cpu", dtype).contiguous()
                if top is not None:
                    tensors[f"{r.id}#p"] = top[0][row, :n].to("cpu", torch.float16).contiguous()
                    tensors[f"{r.id}#i"] = top[1][row, :n].to("cpu", torch.int32).contiguous()
            bar.update(len(batch))
        path = folder / f"shard-{shard_no:05d}.safetensors"
        with atomic_file(path) as tmp:
            save_file(tensors, tmp)
        shard_no += 1
    bar.close()
    return len(todo)


def top_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """logits [B, L, V] -> the k most likely tokens' probabilities and ids, [B, L, k] each (no softmax copy)."""
    top_logits, top_ids = logits.topk(k, dim=-1)  # [B, L, k]
    return (top_logits.float() - logits.float().logsumexp(dim=-1, keepdim=True)).exp(), top_ids


def shard_keys(folder: str | Path) -> dict[str, Path]:
    """Rollout id -> the shard that holds its features, over every complete shard of `folder`."""
    index = {}
    for shard in sorted(Path(folder).glob(SHARD_GLOB)):
        check_safetensors(shard, "delete it and rerun --features-only to remake it")
        with safe_open(shard, framework="pt") as f:
            names = f.keys()  # a safetensors handle, not a dict: it iterates only through keys()
        index.update(dict.fromkeys((name for name in names if "#" not in name), shard))
    return index


class FeatureStore:
    """Reads cached features back as a training batch, checking that they fit the run."""

    def __init__(self, folder: str | Path, layer_ids: Sequence[int], target_name: str):
        self.folder = Path(folder)
        meta_path = self.folder / META_NAME
        if not meta_path.is_file():
            raise FileNotFoundError(f"no feature cache in {self.folder}; make it with `exitspec train dflash "
                                    "--features-only --features DIR`")
        meta = json.loads(meta_path.read_text())
        if meta["layer_ids"] != list(layer_ids) or meta["target"] != target_name:
            raise ValueError(f"{self.folder} holds features of layers {meta['layer_ids']} of {meta['target']}; this "
                             f"run reads layers {list(layer_ids)} of {target_name}")
        self.index = shard_keys(self.folder)
        self.topk = meta.get("topk", 0)

    def check_covers(self, keys: Sequence[str]) -> None:
        if missing := [k for k in keys if k not in self.index]:
            raise ValueError(f"{self.folder} lacks the features of {len(missing)} rollouts (first: {missing[0]}); "
                             "rerun --features-only to add them")

    def batch(self, keys: Sequence[str], lengths: Tensor, device, dtype: torch.dtype) -> Tensor:
        """features [B, L, F] of rollouts `keys`, cut to lengths [B] and right-padded with zeros."""
        return self._stack(keys, "", lengths, dtype).to(device)

    def soft_targets(self, keys: Sequence[str], lengths: Tensor, device) -> tuple[Tensor, Tensor]:
        """The target's top-k probabilities [B, L, k] (float32) and token ids [B, L, k] (int64) of `keys`."""
        if not self.topk:
            raise ValueError(f"{self.folder} holds no top-k probabilities; remake it with --topk K")
        probs = self._stack(keys, "#p", lengths, torch.float32).to(device)
        return probs, self._stack(keys, "#i", lengths, torch.long).to(device)

    def _stack(self, keys: Sequence[str], suffix: str, lengths: Tensor, dtype: torch.dtype) -> Tensor:
        rows = []
        for key, length in zip(keys, lengths.tolist(), strict=True):
            with safe_open(self.index[key], framework="pt") as f:
                rows.append(f.get_slice(key + suffix)[:length])  # [length, ...], only these rows read from disk
        return pad_sequence(rows, batch_first=True).to(dtype)  # [B, L, ...]


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]
