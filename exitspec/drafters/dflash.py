"""DFlash drafting: one block-diffusion forward per round gives per-depth marginals, DDTree turns them into a tree.

One round for a context x_0..x_{L-1} whose last token (the root) is not yet in the target's cache:

    cache:  projected K/V of target features for x_0..x_{L-2}, positions 0..L-2 (committed tokens only)
    block:  [x_{L-1}, MASK × (bs−1)] at positions L-1 .. L-2+bs, bidirectional, sees the whole cache
            (or its last W rows, for a drafter with a context window W)
    output: logits of block slots 1..H = the drafter's marginals for depths 1..H, H = min(bs−1, max_depth)

The block's own keys and values never enter the cache: `commit` appends the features of the tokens the
target has just accepted (the root and the accepted path), exactly as `begin` fills it with the prompt's.

Copy candidates: suffix drafting (suffix.py) also proposes what followed the longest earlier match of the
context's tail in this request and in the target's earlier answers, and corpus lookup (lookup.py), where the
drafter has a table of its target's own responses, what followed the context's last tokens there. All
sources' nodes are ranked on one scale, their learned estimates of P(u) (estimates.py), and the tree takes
the best of the union. A `cheap` round skips the block forward and drafts from the copy sources alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from exitspec.build import build_ddtree
from exitspec.drafters.dflash_model import DFlashConfig, DFlashModel
from exitspec.drafters.lookup import LookupProposal, NgramTable
from exitspec.drafters.suffix import SOURCES, SuffixMemory, SuffixProposal, SuffixSource
from exitspec.drafters.suffix import identity as suffix_identity
from exitspec.drafters.vocab import DraftHead
from exitspec.estimates import (
    SourceMerge,
    lookup_bins,
    lookup_estimator,
    model_bins,
    model_estimator,
)
from exitspec.lean import cheaper_panels
from exitspec.tree import DraftTree


@dataclass(frozen=True)
class DFlashProposal:
    marginals: Tensor | None  # [H, V] fp32 per-depth logits; None in a cheap round
    suffix: SuffixProposal | None  # the suffix trees' candidates; None without the suffix source
    lookup: LookupProposal | None = None  # the context's tail for corpus lookup; None without a table


class DraftCache:
    """Every draft layer's context keys and values, [layers, 1, Hkv, capacity, hd] buffers grown by doubling."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0

    def clear(self) -> None:
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> None:
        """k, v [layers, 1, Hkv, n, hd]: the next n committed tokens."""
        end = self.length + k.shape[3]
        if self.k is None or end > self.k.shape[3] or self.k.dtype != k.dtype or self.k.device != k.device:
            capacity = max(end, 2 * (0 if self.k is None else self.k.shape[3]), 64)
            grown_k = k.new_empty(*k.shape[:3], capacity, k.shape[4])
            grown_v = v.new_empty(*v.shape[:3], capacity, v.shape[4])
            if self.length:
                grown_k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
                grown_v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, :, self.length : end] = k
        self.v[:, :, :, self.length : end] = v
        self.length = end

    def view(self) -> tuple[Tensor, Tensor]:
        """The cached keys and values, each [layers, 1, Hkv, length, hd] (views, no copy)."""
        return self.k[:, :, :, : self.length], self.v[:, :, :, : self.length]


class DFlashDrafter:
    """The Drafter protocol over a DFlashModel and the target's frozen input embeddings and LM head."""

    def __init__(
        self,
        model: DFlashModel,
        target_embeddings: nn.Embedding,
        target_lm_head: nn.Module,
        device=None,
        suffix_source: bool = True,
        lookup: NgramTable | None = None,
        weight_copies: bool = True,
    ):
        cfg = model.config
        vocab, hidden = target_lm_head.weight.shape
        if target_embeddings.embedding_dim != hidden:
            raise ValueError(
                f"target embeddings have width {target_embeddings.embedding_dim} but its LM head reads {hidden}"
            )
        cfg.check_target(hidden_size=hidden, vocab_size=vocab)
        if lookup is not None and lookup.vocab_size != vocab:
            raise ValueError(f"the lookup table is for a vocabulary of {lookup.vocab_size} tokens, the target has "
                             f"{vocab}")
        self.device = torch.device(device) if device is not None else target_embeddings.weight.device
        self.model = model.to(self.device).eval()
        self.embed = target_embeddings
        self.lm_head = target_lm_head
        self.head = DraftHead(target_lm_head, self.model.draft_vocab)  # W or its draft-vocabulary rows
        if weight_copies:  # the head laid out again for a block's rows, if that pays (a copy of it: lean.Panels)
            self.head.panels = cheaper_panels(self.head.weight, cfg.block_size - 1)
        self.feature_layers: tuple[int, ...] = tuple(cfg.target_layer_ids)
        self.block_size = cfg.block_size
        self.vocab_size = vocab
        self.cache = DraftCache()
        self._pending: list[Tensor] = []  # committed features [n, F] not yet projected into the cache
        self.lookup = lookup
        self.suffix = SuffixSource(SuffixMemory(vocab)) if suffix_source else None
        self._identity: str | None = None  # identity(), computed on first use
        self.reset_estimates()

    def reset_estimates(self) -> None:
        """Forgets what the estimates of P(u) learned (they persist across sequences otherwise)."""
        self.merge = SourceMerge({
            "model": (model_estimator, lambda t: model_bins(t.scores)),
            "lookup": (lookup_estimator, lookup_bins),
            **{name: (lookup_estimator, lookup_bins) for name in SOURCES},  # the suffix trees'
        })

    @classmethod
    def from_pretrained(
        cls, folder, target_hf_model, device=None, dtype: torch.dtype | None = None, suffix_source: bool = True,
        lookup: NgramTable | None = None, weight_copies: bool = True,
    ) -> DFlashDrafter:
        """Loads a checkpoint folder for an HF causal LM target, after checking that the target fits it.
        The drafter takes the target's device and embedding dtype unless told otherwise; `suffix_source`
        adds suffix-tree candidates to its trees, `lookup` corpus-lookup ones; `weight_copies` lets its head be
        laid out again where that is faster (TargetModel)."""
        tc = target_hf_model.config.get_text_config()
        embed, lm_head = target_hf_model.get_input_embeddings(), target_hf_model.get_output_embeddings()
        DFlashConfig.load(folder).check_target(tc.hidden_size, lm_head.weight.shape[0], tc.num_hidden_layers)
        model = DFlashModel.from_pretrained(folder, dtype=dtype or embed.weight.dtype)
        return cls(model, embed, lm_head, device=device, suffix_source=suffix_source, lookup=lookup,
                   weight_copies=weight_copies)

    # -- the Drafter protocol ------------------------------------------------------------------------------

    def estimate_for(self, setting: Hashable) -> None:
        self.merge.use(setting)

    def identity(self) -> str:
        """'dflash:' and a digest of the config and weights, then the lookup table's digest and the suffix trees'
        identity where those sources draft too. Computed once: the weights are frozen at inference."""
        if self._identity is None:
            digest = hashlib.sha256(json.dumps(self.model.config.to_dict(), sort_keys=True).encode())
            for name, tensor in self.model.state_dict().items():
                digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
                digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            lookup = "" if self.lookup is None else f"+lookup:{self.lookup.digest()}"
            suffix = "" if self.suffix is None else f"+{suffix_identity()}"
            self._identity = f"dflash:{digest.hexdigest()[:16]}{lookup}{suffix}"
        return self._identity

    def estimates_state(self) -> dict:
        return self.merge.state(self.merge.setting)

    def load_estimates(self, state: dict) -> None:
        self.merge.load_state(self.merge.setting, state)

    @torch.inference_mode()
    def begin(self, prompt_ids: Tensor, features: Tensor | None) -> None:
        """prompt_ids [L]; features [L-1, F] of prompt_ids[:-1]: the draft cache becomes exactly those."""
        self.cache.clear()
        self._check_features(features, prompt_ids.numel() - 1)
        self._pending = [features]
        if self.suffix is not None:
            self.suffix.begin(prompt_ids.tolist())

    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_depth: int, cheap: bool = False) -> DFlashProposal:
        """The block forward's marginals (unless `cheap`) and the lookup sources' proposals."""
        lookup = self.lookup.propose(context[-self.lookup.orders :], max_depth) if self.lookup is not None else None
        suffix = self.suffix.propose(list(context), max_depth) if self.suffix is not None else None
        return DFlashProposal(None if cheap else self.marginals(context, max_depth), suffix, lookup)

    @torch.inference_mode()
    def marginals(self, context: Sequence[int], max_depth: int) -> Tensor:
        """Per-depth logits [H, V] (fp32), H = min(block_size−1, max_depth), for the tokens after context[-1]."""
        self._flush()
        ctx_len = len(context) - 1
        if ctx_len != self.cache.length:
            raise RuntimeError(
                f"the draft cache holds {self.cache.length} tokens but the context has {ctx_len} before its root; "
                "begin/commit must hand over the features of every token the target has cached"
            )
        depth = min(self.block_size - 1, max_depth)
        if depth < 1:
            return torch.empty(0, self.vocab_size, device=self.device)
        anchor = torch.tensor([[int(context[-1])]], device=self.device)  # [1, 1]
        block = self.model.block_embeddings(anchor, self.embed).to(self._dtype)  # [1, bs, D]
        positions = range(ctx_len, ctx_len + self.block_size)  # the block's bs slots
        ctx_k, ctx_v = self.cache.view()  # [layers, 1, Hkv, ctx_len, hd]
        window = self.model.config.context_window
        if window is not None and ctx_len > window:
            ctx_k, ctx_v = ctx_k[:, :, :, -window:], ctx_v[:, :, :, -window:]
        hidden = self.model.decode(block, positions, ctx_k, ctx_v)  # [1, bs, D]
        return self.head.expand(self.head(hidden[0, 1 : 1 + depth])).float()  # [H, V]

    def build(self, proposal: DFlashProposal, root_token: int, budget: int) -> DraftTree:
        """The `budget` best nodes of the DDTree over the marginals (the most probable prefixes), the suffix
        trees' speculations and the lookup tree, ranked by their learned estimates of P(u)."""
        candidates = {}
        if proposal.marginals is not None and proposal.marginals.shape[0]:
            candidates["model"] = build_ddtree(proposal.marginals, root_token, budget)
        if proposal.lookup is not None:
            candidates["lookup"] = self.lookup.tree(proposal.lookup, root_token, budget)
        if proposal.suffix is not None:
            candidates |= self.suffix.trees(proposal.suffix, root_token)
        return self.merge.build(root_token, candidates, budget, self.device)

    def observe(self, tree: DraftTree, reach: list[float]) -> None:
        """The realised reach probabilities P(u) [N+1] (NaN: unobserved) of the last tree built (Eq. 2)
        teach its sources' estimates."""
        self.merge.observe(tree, reach)

    @torch.inference_mode()
    def commit(self, committed_ids: Tensor, features: Tensor | None) -> None:
        """committed_ids [n]: root + accepted path, now in the target cache; features [n, F] extend the draft
        cache. They are projected lazily, all at once, by the next block forward (cheap rounds skip it)."""
        self._check_features(features, committed_ids.numel())
        self._pending.append(features)

    def learn(self, answer: list[int]) -> None:
        """A finished answer goes into the suffix memory, where later requests' drafts find it."""
        if self.suffix is not None:
            self.suffix.learn(answer)

    def memory(self) -> SuffixMemory | None:
        return None if self.suffix is None else self.suffix.memory

    # -- internals -----------------------------------------------------------------------------------------

    @property
    def _dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    def _check_features(self, features: Tensor | None, expected: int) -> None:
        cfg = self.model.config
        if features is None or features.shape != (expected, cfg.feature_size):
            got = None if features is None else tuple(features.shape)
            raise ValueError(
                f"DFlash needs features [{expected}, {cfg.feature_size}] (target layers {list(self.feature_layers)} "
                f"concatenated), got {got}"
            )

    def _flush(self) -> None:
        """Projects the features committed since the last block forward into the draft cache, in one call."""
        if not self._pending:
            return
        features = torch.cat(self._pending).to(self.device, self._dtype)  # [n, F]
        self._pending = []
        if features.shape[0] == 0:
            return
        start = self.cache.length
        k, v = self.model.context_kv(features[None], range(start, start + features.shape[0]))
        self.cache.append(k, v)
