"""The target model: a Hugging Face causal LM with a KV cache for one sequence, verifying whole draft trees.

Cache convention: the KV cache holds every committed token except the last one. The last committed token is
the root of the next draft tree (DraftTree.tokens[0]). One round is

    out = target.forward_tree(tree)    # one forward over root + N draft nodes; their K/V are appended
    target.commit(tree, path)          # keep root + accepted path in the cache, drop the other tree entries

after which the cache has grown by 1 + len(path) tokens and the bonus token becomes the next root.

Two forwards do the work behind one small interface (reset, forward, keep, crop, kv):

- `LeanLlama` (lean.py), for Llama-family models: a direct forward with a static KV cache, the default
  wherever `lean.supports(model)`;
- `TransformersForward`, for any other causal LM: the model's own forward with a DynamicCache and an
  additive float 4D mask [1, 1, N+1, cache_len+N+1], which transformers 5 passes to every layer untouched.
  The model must run sdpa or eager attention (flash-attention kernels ignore such masks) and have
  full-attention layers only (sliding-window layers would need the window folded into the mask and their
  own cache compaction). Its cache compaction is the one place that edits transformers' cache layers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from exitspec.lean import LeanLlama, additive_mask, supports
from exitspec.quant import QuantLlama
from exitspec.sampling import finite_rows
from exitspec.tree import DraftTree


@dataclass(frozen=True)
class TreeForward:
    logits: Tensor  # [n, V] float32, one row per input token (tree node)
    taps: tuple[Tensor, ...]  # [n, D] each: the hidden states of the feature layers

    @cached_property
    def features(self) -> Tensor | None:
        """[n, F] the taps concatenated, None without feature layers; built on first read only, so that a caller
        that reads none (the autoregressive loop) pays for no copy."""
        return torch.cat(self.taps, dim=-1) if self.taps else None


def cache_argument(model: PreTrainedModel) -> str:
    """The name of a transformers model's KV-cache argument: transformers 5.24 renamed past_key_values to cache
    (the old name is deprecated); either is accepted."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Cuts a DynamicCache back to its first `length` positions (its crop takes only negative counts since
    transformers 5.24)."""
    cache.crop(-(cache.get_seq_length() - length))


class TransformersForward:
    """The model's own forward over a DynamicCache: the backend for architectures the lean forward lacks."""

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...]):
        self.model, self.feature_layers = model, feature_layers
        self._cache_arg = cache_argument(model)
        self.reset()
        kinds = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if kinds:
            raise ValueError(f"only full-attention models are supported; this one has cache layers {sorted(kinds)}")

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    def forward(
        self, ids: Tensor, positions: Tensor, visible: Tensor | None, logits_to_keep: int = 0
    ) -> tuple[Tensor, list[Tensor]]:
        """As LeanLlama.forward: logits [r, V] and the feature taps [n, D] of ids [n] appended to the cache."""
        mask = None
        if visible is not None:
            dtype = self.model.dtype
            mask = additive_mask(visible, self.length, dtype, torch.finfo(dtype).min)[None, None]  # [1, 1, n, L+n]
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=bool(self.feature_layers),
            **{self._cache_arg: self.cache},
        )
        self.length += ids.numel()
        taps = [out.hidden_states[i + 1][0] for i in self.feature_layers] if self.feature_layers else []
        return out.logits[0].float(), taps

    def keep(self, start: int, slots: Tensor) -> None:
        """Moves cache entries `slots` [m] to start..start+m-1 in every layer and drops everything after.

        transformers has no public call that reorders positions within one sequence (reorder_cache works on
        the batch), so this and `kv` are exitspec's only reads and writes of a cache layer's `keys` and
        `values`; test_target checks them and `crop` against a plain forward on every transformers it runs on."""
        m = slots.numel()
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                kv = getattr(layer, name)  # [1, H_kv, length, D]
                kv[:, :, start : start + m] = kv.index_select(2, slots)
                setattr(layer, name, kv[:, :, : start + m])
        self.length = start + m

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)
        crop_cache(self.cache, self.length)

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The cached keys and values of one layer, [Hkv, length, hd] each."""
        entry = self.cache.layers[layer]
        return entry.keys[0, :, : self.length], entry.values[0, :, : self.length]


class TargetModel:
    """A causal LM plus the KV cache of one sequence (batch 1): prefill, tree verification, cache compaction.

    Features are taps of the residual stream: feature layer i is transformers' hidden_states[i+1], the output
    of decoder layer i (for the last layer transformers returns it after the final norm), concatenated.
    `backend` is "lean" (LeanLlama), "transformers" or "auto" (lean where it supports the model).

    How the weight products run is explicit state: `row_plan` (set by `budget.calibrate`). `forward_config()`
    names everything that decides a forward's speed, so that a baseline and a speculative run can be checked to
    run the same way. `weight_copies`: the row plan may lay the weights out again where that is faster (Panels,
    Packed: each a full copy of the weights); off, the target runs on the model's own weights alone (a model the
    caller loaded and keeps using, `SpeculativeDecoder.from_model`). `precision`: a quantized forward's weights
    (quant.QuantLlama: q8_0, q4_1, bf16, f32 or gguf:PATH); under backend "auto" by default the ones the model was
    loaded for (`models.load_model_and_tokenizer` with a quantized --dtype); None: the torch forward in the model's
    dtype.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        feature_layers: tuple[int, ...] = (),
        backend: Literal["auto", "lean", "transformers"] = "auto",
        weight_copies: bool = True,
        precision: str | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config(decoder=True)
        n_layers = self.config.num_hidden_layers
        self.feature_layers = tuple(int(i) for i in feature_layers)
        bad = [i for i in self.feature_layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"feature layers {bad} out of range: the model has decoder layers 0..{n_layers - 1}")
        if backend not in ("auto", "lean", "transformers"):
            raise ValueError(f"unknown target backend {backend!r}; choose auto, lean or transformers")
        lean = backend == "lean" or (backend == "auto" and supports(model) is None)
        attn = model.config._attn_implementation
        if not lean and attn not in ("sdpa", "eager"):  # the lean forward runs its own sdpa whatever the model's
            raise ValueError(f"tree attention needs 'sdpa' or 'eager' attention, the model uses {attn!r}")
        self.weight_copies = weight_copies
        # the quantized forward where the model was loaded for it (models.load_model_and_tokenizer)
        if backend == "auto":
            precision = precision or getattr(model, "exitspec_precision", None)
        if precision is not None:
            self.backend = QuantLlama(model, precision, self.feature_layers)
        elif lean:
            self.backend = LeanLlama(model, self.feature_layers)
        else:
            self.backend = TransformersForward(model, self.feature_layers)
        self.reset()

    @property
    def row_plan(self) -> dict[int, tuple[int, str]]:
        """{rows: (rows run on, layout)} of the lean backend's weight products (`use_row_plan`); {} elsewhere."""
        return dict(self.backend.row_plan) if isinstance(self.backend, LeanLlama) else {}

    @property
    def attention(self) -> str:
        """Which attention trees and steps run: "sdpa", or the batch-invariant kernel's version (attention.py)."""
        return getattr(self.backend, "attention", "sdpa")

    def forward_config(self) -> dict:
        """What decides how fast a forward runs: backend, device, dtype, threads, attention (sdpa or the kernel's
        version) and the row plan."""
        return {
            "backend": type(self.backend).__name__,
            "device": str(self.device),
            "dtype": self.precision,
            "threads": torch.get_num_threads(),
            "attention": self.attention,
            "row_plan": {str(rows): list(how) for rows, how in sorted(self.row_plan.items())},
        }

    @property
    def precision(self) -> str:
        """The weights' precision as the forward runs them: the model's dtype, or the quantized forward's weights."""
        return getattr(self.backend, "precision", None) or str(self.model.dtype).removeprefix("torch.")

    @property
    def vocab_size(self) -> int:
        """Width of the logits."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cache_len(self) -> int:
        """Committed tokens in the KV cache."""
        return self._len

    @property
    def feature_dim(self) -> int:
        return self.config.hidden_size * len(self.feature_layers)

    def reset(self) -> None:
        """Empties the cache (a new sequence)."""
        self.backend.reset()
        self._len = 0
        self._pending: DraftTree | None = None  # a tree whose K/V sit in the cache, awaiting commit

    def use_row_plan(self, plan: dict[int, tuple[int, str]]) -> bool:
        """Runs the weight products of n rows as plan[n] = (rows, layout) says, where it names n (the lean
        backend's `LeanLlama.linear`). Logits and features are unchanged but for rounding. False where the
        backend has no such choice (transformers' forward), which then ignores the plan."""
        if isinstance(self.backend, LeanLlama):
            self.backend.use_row_plan(plan)
            return True
        return False

    def truncate(self, length: int) -> None:
        """Drops the committed tokens after the first `length` (a rollback; a pending tree must be committed)."""
        self._check_idle()
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot truncate a cache of {self._len} tokens to {length}")
        self.backend.crop(length)
        self._len = length

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s committed keys and values, [Hkv, cache_len, hd] each (for tests and diagnostics)."""
        keys, values = self.backend.kv(layer)
        return keys[:, : self._len], values[:, : self._len]

    @torch.inference_mode()
    def prefill(self, ids: Tensor) -> Tensor | None:
        """Appends ids [L] to the cache; returns their features [L, F], or None without feature layers."""
        ids = self._check_ids(ids)
        if ids.numel() == 0:
            return None if not self.feature_layers else torch.empty(0, self.feature_dim, device=self.device)
        return self._forward_causal(ids, logits_to_keep=1).features  # no [L, V] logits for a long prompt

    @torch.inference_mode()
    def forward_tokens(self, ids: Tensor, logits_to_keep: int = 0, check: bool = True) -> TreeForward:
        """Plain causal step(s): appends ids [n] to the cache; logits [n, V] (of the last `logits_to_keep` tokens
        only, where that is not 0) and features [n, F] | None. `check` screens the logits (a host read); the
        autoregressive loop screens them in its step's one read instead (`reject` with `appended`)."""
        ids = self._check_ids(ids)
        if ids.numel() == 0:
            raise ValueError("forward_tokens needs at least one token")
        return self._forward_causal(ids, logits_to_keep, check="token" if check else None)

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree, check: bool = True, logits_to_keep: int = 0) -> TreeForward:
        """One forward over all N+1 tree nodes; node u sees the whole cache and its ancestors-or-self.

        Node u sits at position cache_len + depth[u]. Logits row u is the target's next-token distribution
        after prefix + root-to-u path (rows of the last `logits_to_keep` nodes only, where that is not 0). The
        tree's K/V are appended to the cache until `commit` (or `discard`). `check` screens the logits (a host
        read); the decode loop screens them in its round's one read instead (`reject`).
        """
        self._check_idle()
        tree.validate(self.vocab_size)
        self._check_room(tree.depth + 1, f"a tree of depth {tree.depth}")
        tree = tree.to(self.device)
        visible = tree.visibility_mask() if tree.size > 1 else None  # [N+1, N+1]; one row needs no mask
        out = self._run(tree.tokens, tree.position_ids(self._len), visible, logits_to_keep, "node" if check else None)
        self._pending = tree
        return out

    def discard(self) -> None:
        """Drops a pending tree's K/V from the cache, keeping none of it (a draft model's look-ahead)."""
        self.backend.crop(self._len)
        self._pending = None

    @torch.inference_mode()
    def commit(self, tree: DraftTree, path: list[int]) -> None:
        """Keeps the root and the accepted `path` (tree indices, root excluded, root-to-leaf order) in the cache.

        The kept entries move to slots cache_len, cache_len+1, ...; all other tree entries are dropped in every
        layer. Afterwards cache_len has grown by 1 + len(path).
        """
        if self._pending is None:
            raise ValueError("commit without a pending tree: call forward_tree first")
        if tree.size != self._pending.size:
            raise ValueError(f"commit got a tree of {tree.size} nodes, but the pending tree has {self._pending.size}")
        path = [int(u) for u in path]
        parents = tree.parent_list
        for prev, u in zip([0, *path], path):
            if not 0 < u < tree.size or parents[u] != prev:
                raise ValueError(f"path {path} is not a root-to-node chain of the tree (at node {u})")
        L = self._len
        if path != list(range(1, len(path) + 1)):  # a path already in slots L+1.. (a chain's prefix) stays put
            self.backend.keep(L + 1, torch.tensor(path, dtype=torch.long, device=self.device) + L)
        self.backend.crop(L + 1 + len(path))
        self._len = L + 1 + len(path)
        self._pending = None

    def _forward_causal(self, ids: Tensor, logits_to_keep: int = 0, check: str | None = None) -> TreeForward:
        self._check_idle()
        self._check_room(ids.numel(), f"{ids.numel()} more tokens")
        L = self._len
        pos = torch.arange(L, L + ids.numel(), device=self.device)
        out = self._run(ids, pos, None, logits_to_keep, check)
        self._len += ids.numel()
        return out

    def _run(
        self, ids: Tensor, pos: Tensor, visible: Tensor | None, logits_to_keep: int = 0, check: str | None = None
    ) -> TreeForward:
        """Forward of ids [n] at positions pos [n] after the cache; visible [n, n] (None: causal).

        Logits are kept for the last `logits_to_keep` tokens (0: all). With `check` (what a row is called in
        the error), non-finite logits roll the cache back and raise.
        """
        logits, taps = self.backend.forward(ids, pos, visible, logits_to_keep)  # [n, V] float32, [n, D] each
        if check is not None and not bool(finite_rows(logits).all()):
            self.reject(logits, check)
        return TreeForward(logits, tuple(taps))

    def reject(self, logits: Tensor, what: str, appended: int = 0) -> None:
        """Rolls back the forward that made non-finite `logits` [n, V] (a pending tree, or the `appended` tokens
        of an unchecked forward_tokens) and raises ValueError naming the first bad row (a `what`: node or token)."""
        bad = ~finite_rows(logits)  # [n]
        self._len -= appended
        self.discard()
        raise ValueError(f"target produced non-finite logits at {what} {int(torch.nonzero(bad)[0])}")

    def _check_ids(self, ids: Tensor) -> Tensor:
        """ids [n] on the target's device, checked where they are: ids from the host cost no device read."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D [n] (one sequence), got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
        return ids.to(self.device)

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise ValueError("a verified tree is still in the cache: call commit(tree, path) first")

    def _check_room(self, n: int, what: str) -> None:
        if self._len + n > self.max_context:
            raise ValueError(
                f"{what} at cache length {self._len} needs {self._len + n} positions, which exceeds the model's "
                f"context of {self.max_context} tokens"
            )
