"""The target model: a Hugging Face causal LM with a KV cache for one sequence, verifying whole draft trees.

Cache convention: the KV cache holds every committed token except the last one. The last committed token is
the root of the next draft tree (DraftTree.tokens[0]). One round is

    out = target.forward_tree(tree)    # one forward over root + N draft nodes; their K/V are appended
    target.commit(tree, path)          # keep root + accepted path in the cache, drop the other tree entries

after which the cache has grown by 1 + len(path) tokens and the bonus token becomes the next root.

Tree attention goes through transformers' own attention with an additive float 4D mask
[1, 1, N+1, cache_len+N+1], which transformers 5 passes to every layer untouched. The model must run
sdpa or eager attention (flash-attention kernels ignore such masks) and have full-attention layers only
(sliding-window layers would need the window folded into the mask and their own cache compaction).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from exitspec.models import load_model_and_tokenizer
from exitspec.tree import DraftTree


@dataclass(frozen=True)
class TreeForward:
    logits: Tensor  # [n, V] float32, one row per input token (tree node)
    features: Tensor | None  # [n, F] concatenated hidden states of the feature layers, None without any


class TargetModel:
    """A causal LM plus the KV cache of one sequence (batch 1): prefill, tree verification, cache compaction.

    Features are taps of the residual stream: feature layer i is transformers' hidden_states[i+1], the output
    of decoder layer i (for the last layer transformers returns it after the final norm), concatenated.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        feature_layers: tuple[int, ...] = (),
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config(decoder=True)
        n_layers = self.config.num_hidden_layers
        self.feature_layers = tuple(int(i) for i in feature_layers)
        bad = [i for i in self.feature_layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"feature layers {bad} out of range: the model has decoder layers 0..{n_layers - 1}")
        attn = model.config._attn_implementation
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"tree attention needs 'sdpa' or 'eager' attention, the model uses {attn!r}")
        # transformers 5.24 renamed past_key_values to cache (the old name is deprecated); accept either.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.reset()
        kinds = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if kinds:
            raise ValueError(f"only full-attention models are supported; this one has cache layers {sorted(kinds)}")

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        feature_layers: tuple[int, ...] = (),
    ) -> TargetModel:
        """Loads a local HF causal-LM folder (None: the default SmolLM2-135M-Instruct)."""
        model, tokenizer = load_model_and_tokenizer(path, device, dtype)
        return cls(model, tokenizer, feature_layers)

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
        self.cache = DynamicCache(config=self.model.config)
        self._len = 0
        self._pending: DraftTree | None = None  # a tree whose K/V sit in the cache, awaiting commit

    @torch.inference_mode()
    def prefill(self, ids: Tensor) -> Tensor | None:
        """Appends ids [L] to the cache; returns their features [L, F], or None without feature layers."""
        ids = self._check_ids(ids)
        if ids.numel() == 0:
            return None if not self.feature_layers else torch.empty(0, self.feature_dim, device=self.device)
        return self._forward_causal(ids, logits_to_keep=1).features  # no [L, V] logits for a long prompt

    @torch.inference_mode()
    def forward_tokens(self, ids: Tensor) -> TreeForward:
        """Plain causal step(s): appends ids [n] to the cache; logits [n, V] and features [n, F] | None."""
        ids = self._check_ids(ids)
        if ids.numel() == 0:
            raise ValueError("forward_tokens needs at least one token")
        return self._forward_causal(ids, check="token")

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree) -> TreeForward:
        """One forward over all N+1 tree nodes; node u sees the whole cache and its ancestors-or-self.

        Node u sits at position cache_len + depth[u]. Logits row u is the target's next-token distribution
        after prefix + root-to-u path. The tree's K/V are appended to the cache until `commit`.
        """
        self._check_idle()
        tree.validate(self.vocab_size)
        self._check_room(tree.depth + 1, f"a tree of depth {tree.depth}")
        tree = tree.to(self.device)
        n, L = tree.size, self._len
        dtype = self.model.dtype
        visible = torch.ones(n, L + n, dtype=torch.bool, device=self.device)  # [n, L+n]
        visible[:, L:] = tree.visibility_mask()
        mask = torch.zeros(n, L + n, dtype=dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        out = self._run(tree.tokens, tree.position_ids(L), mask[None, None], check="node")  # mask [1, 1, n, L+n]
        self._pending = tree
        return out

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
        parents = tree.parents.tolist()
        for prev, u in zip([0, *path], path):
            if not 0 < u < tree.size or parents[u] != prev:
                raise ValueError(f"path {path} is not a root-to-node chain of the tree (at node {u})")
        L, m = self._len, len(path)
        src = torch.tensor(path, dtype=torch.long, device=self.device) + L  # cache slots of the path nodes
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                kv = getattr(layer, name)  # [1, H_kv, L+N+1, D]
                kv[:, :, L + 1 : L + 1 + m] = kv.index_select(2, src)
                setattr(layer, name, kv[:, :, : L + 1 + m])
        self._len = L + 1 + m
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
        self, ids: Tensor, pos: Tensor, mask: Tensor | None, logits_to_keep: int = 0, check: str | None = None
    ) -> TreeForward:
        """Forward of ids [n] at positions pos [n] with the cache; mask None means causal.

        Logits are kept for the last `logits_to_keep` tokens (0: all). With `check` (what a row is called in
        the error), non-finite logits roll the cache back and raise.
        """
        out = self.model(
            input_ids=ids[None],
            position_ids=pos[None],
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=bool(self.feature_layers),
            **{self._cache_arg: self.cache},
        )
        logits = out.logits[0].float()  # [n, V], or [logits_to_keep, V]
        if check is not None:
            bad = ~torch.isfinite(logits).all(dim=-1)  # [n]
            if bool(bad.any()):
                self._crop(self._len)
                raise ValueError(f"target produced non-finite logits at {check} {int(torch.nonzero(bad)[0])}")
        features = None
        if self.feature_layers:
            features = torch.cat([out.hidden_states[i + 1][0] for i in self.feature_layers], dim=-1)  # [n, F]
        return TreeForward(logits, features)

    def _crop(self, length: int) -> None:
        """Cuts every layer of the cache back to `length` entries."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    def _check_ids(self, ids: Tensor) -> Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D [n] (one sequence), got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
        return ids

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise ValueError("a verified tree is still in the cache: call commit(tree, path) first")

    def _check_room(self, n: int, what: str) -> None:
        if self._len + n > self.max_context:
            raise ValueError(
                f"{what} at cache length {self._len} needs {self._len + n} positions, which exceeds the model's "
                f"context of {self.max_context} tokens"
            )
