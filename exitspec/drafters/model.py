"""A small causal LM of the target's tokenizer as a tree drafter: dynamic trees grown best-first by the draft
model's own probabilities (SpecInfer; EAGLE-2's expand-and-rerank), verified exactly like any other tree.

One round, the draft model running on its own KV cache (a TargetModel over it: the lean forward where it
supports the model), which holds the context but its last token:

    forward_tokens(context's new tokens + root) ─▶ q_root; the cache keeps all but the root
    depth 1: the root's top-`children` tokens, scored s(u) = Π q along the path (the draft's P(u))
    depth d: the `children` best new nodes by s are expanded: one tree forward over every expanded node so far
             (the tree mask), logits of the new ones only; their top-`children` tokens join the candidates
    ─▶ all candidates, best first by s ─ SourceMerge: estimates of the target's P(u) by (on the draft's greedy
       path or not) × depth × s bin ─▶ tree

So a round costs `depth` draft forwards (the first also catches up on the tokens the target accepted) and the
candidates number up to `children` + (depth − 1)·children². At T > 0 the draft's probabilities are warped
by the round's temperature; at T = 0 they stay at T = 1 (a confidence, not a draw). `--budget auto` weighs
their learned estimates against the target's cost, like DFlash's.

`first_layers(model, k)` makes the target's first k layers, its final norm and its LM head into a draft model
that shares the target's weights (self-speculation, LayerSkip-style, without early-exit training).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoTokenizer

from exitspec.budget import calibrate
from exitspec.build import ranked_tree
from exitspec.estimates import SourceMerge, draft_path_bins, draft_path_estimator
from exitspec.models import load_model_and_tokenizer
from exitspec.target import TargetModel
from exitspec.tree import DraftTree

CHILDREN, DEPTH = 8, 6  # top tokens per expanded node, and expansion depth (= draft forwards a round)


@dataclass
class ModelProposal:
    """Candidate nodes of one round on the host, in the order they were made (a parent before its children)."""

    parents: list[int]  # [M+1], parents[0] = -1
    tokens: list[int]  # [M+1], tokens[0] = the root
    depths: list[int]  # [M+1]
    scores: list[float]  # [M+1] the draft's prefix probability s(u), 1 at the root


class ModelDrafter:
    """Trees from a draft model's top tokens, expanded best-first (module docstring). It reads no target features."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, draft_model: nn.Module, name: str, children: int = CHILDREN, depth: int = DEPTH,
                 weight_copies: bool = True):
        """`weight_copies`: the draft's row plan may lay its weights out again where that is faster (TargetModel);
        its look-ahead trees of up to (depth − 1)·children nodes are timed once per machine (budget.calibrate)."""
        if children < 1 or depth < 1:
            raise ValueError(f"a model drafter needs children >= 1 and depth >= 1, got {children} and {depth}")
        self.draft = TargetModel(draft_model, weight_copies=weight_copies)  # its own KV cache over its weights
        calibrate(self.draft, (depth - 1) * children)
        self.name, self.children, self.depth = name, children, depth
        self.merge = SourceMerge({"model": (draft_path_estimator, draft_path_bins)})
        self.temperature = 1.0
        self._cached = 0  # context tokens in the draft's cache

    def estimate_for(self, setting: Hashable) -> None:
        self.merge.use(setting)
        temperature = getattr(setting, "temperature", 0.0)
        self.temperature = float(temperature) if temperature > 0 else 1.0

    def identity(self) -> str:
        config = self.draft.model.config.to_json_string(use_diff=False)
        digest = hashlib.sha256(config.encode()).hexdigest()[:16]
        return f"model:{self.name} config={digest} children={self.children} depth={self.depth}"

    def estimates_state(self) -> dict:
        return self.merge.state(self.merge.setting)

    def load_estimates(self, state: dict) -> None:
        self.merge.load_state(self.merge.setting, state)

    def begin(self, prompt_ids: Tensor, features: Tensor | None) -> None:
        self.draft.reset()
        self.draft.prefill(prompt_ids[:-1].to(self.draft.device))
        self._cached = prompt_ids.numel() - 1

    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_depth: int, cheap: bool = False) -> ModelProposal | None:
        """Grows the candidate tree after `context` (context[-1] is the root) to min(depth, max_depth); None for a
        cheap round (`--budget auto`'s round without the draft model)."""
        if cheap:
            return None
        device = self.draft.device
        new = torch.tensor(context[self._cached :], device=device)
        logits = self.draft.forward_tokens(new, logits_to_keep=1).logits  # [1, V]: after the root
        self.draft.truncate(len(context) - 1)  # the root is the next round's, if the target keeps it
        self._cached = len(context) - 1
        proposal = ModelProposal([-1], [int(context[-1])], [0], [1.0])
        expanded = [0]  # candidates forwarded so far, in tree order: the look-ahead tree's nodes
        frontier = [0]  # the expanded candidates whose logits are `logits`
        depth = min(self.depth, max_depth)
        for d in range(1, depth + 1):
            q = torch.softmax(logits.float() / self.temperature, dim=-1)  # [f, V]
            top = torch.topk(q, self.children, dim=-1)  # [f, k]
            values, tokens = top.values.tolist(), top.indices.tolist()  # one host read per depth
            first = len(proposal.tokens)
            for row, parent in enumerate(frontier):
                for value, token in zip(values[row], tokens[row]):
                    proposal.parents.append(parent)
                    proposal.tokens.append(token)
                    proposal.depths.append(d)
                    proposal.scores.append(proposal.scores[parent] * value)
            if d == depth:
                break
            made = range(first, len(proposal.tokens))
            frontier = sorted(made, key=lambda u: -proposal.scores[u])[: self.children]
            expanded += frontier
            logits = self._look_ahead(proposal, expanded, len(frontier))
        return proposal

    def _look_ahead(self, proposal: ModelProposal, expanded: list[int], new: int) -> Tensor:
        """Logits [new, V] after each of the last `new` expanded candidates: one tree forward over all expanded ones
        (each sees its ancestors), discarded from the draft's cache afterwards."""
        index = {u: i for i, u in enumerate(expanded)}
        parents = [-1, *(index[proposal.parents[u]] for u in expanded[1:])]
        tree = DraftTree.from_lists(parents, [proposal.tokens[u] for u in expanded],
                                    [proposal.depths[u] for u in expanded], device=self.draft.device)
        logits = self.draft.forward_tree(tree, check=False, logits_to_keep=new).logits  # [new, V]
        self.draft.discard()
        return logits

    def build(self, proposal: ModelProposal | None, root_token: int, budget: int) -> DraftTree:
        if proposal is None:
            return self.merge.build(root_token, {}, budget)
        candidates = ranked_tree(root_token, range(1, len(proposal.tokens)), proposal.parents, proposal.tokens,
                                 proposal.depths, proposal.scores)  # the root (index 0) is outside the nodes
        return self.merge.build(root_token, {"model": candidates}, budget)

    def observe(self, tree: DraftTree, reach: list[float]) -> None:
        self.merge.observe(tree, reach)

    def commit(self, committed_ids: Tensor, features: Tensor | None) -> None:
        pass  # the next propose catches the draft's cache up from the context

    def learn(self, answer: list[int]) -> None:
        pass

    def memory(self) -> None:
        return None


def first_layers(model: nn.Module, k: int) -> nn.Module:
    """A draft model made of `model`'s embedding, first k decoder layers, final norm and LM head, sharing its weights
    (no copy): a Llama-family model (`model.model.layers`) of the same class, usable by transformers too."""
    config = model.config.get_text_config(decoder=True)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to take the first layers of")
    if not 1 <= k < len(layers):
        raise ValueError(f"layers:{k}: the target has {len(layers)} decoder layers; take 1 to {len(layers) - 1}")
    config = copy.deepcopy(config)
    config.num_hidden_layers = k
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:k]
    with torch.device("meta"):
        draft = type(model)(config)
    draft.model.embed_tokens, draft.model.norm = model.model.embed_tokens, model.model.norm
    draft.model.layers = nn.ModuleList(layers[:k])
    draft.model.rotary_emb, draft.lm_head = model.model.rotary_emb, model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    meta = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"layers:{k}: {type(model).__name__} has parts first_layers does not share: {meta[:3]}")
    return draft.eval().requires_grad_(False)


def load_draft_model(folder: Path, target_model: nn.Module) -> nn.Module:
    """A draft model folder on the target's device and dtype, refused with one line when its tokenizer is not the
    target's (vocabulary size, or the token→id maps where both folders hold a tokenizer)."""
    draft, tokenizer = load_model_and_tokenizer(folder, target_model.device, target_model.dtype)
    vocab = draft.get_output_embeddings().weight.shape[0]
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    if vocab != target_vocab:
        raise ValueError(f"draft model {folder} has a vocabulary of {vocab} tokens, the target {target_vocab}: "
                         "a draft model needs the target's tokenizer")
    target_folder = Path(getattr(target_model, "name_or_path", "") or "")
    if tokenizer is not None and target_folder.is_dir():
        try:
            target_tokenizer = AutoTokenizer.from_pretrained(target_folder)
        except (OSError, ValueError):
            target_tokenizer = None
        if target_tokenizer is not None and target_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"draft model {folder} has another tokenizer than the target {target_folder}: "
                             "a draft model needs the target's tokenizer")
    return draft
