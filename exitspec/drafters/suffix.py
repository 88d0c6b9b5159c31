"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): what followed the longest earlier occurrence of the
context's tail, in this request and in every answer the target gave before.

Two suffix trees (arctic-inference's C++ `SuffixTree`, the one vLLM's `suffix` method runs):

    request  the prompt and the answer so far, extended every round (`SuffixSource.propose` syncs it)
    memory   every finished answer of this target (`SuffixMemory`), bounded, persisted, learned from use

For a context, each tree finds the longest match of its last tokens (up to MAX_MATCH of them) and grows a
speculation tree from the continuations seen after it, best first by their frequency estimate

    q(x_1..x_d) = Π_i c(match, x_<i, x_i) / c(match, x_<i)                (counts of what followed the match)

as long as the tree holds at most α · (match length) nodes and q stays above `MIN_PROBABILITY`. Unlike vLLM,
which collapses the tree to one chain, exitspec keeps both trees as candidate sources: the drafter ranks their
nodes against its other sources' on one scale of estimated P(u) (estimates.py: bins of depth × q), and the
verifier checks the merged tree exactly at any temperature.

The memory lives in a safetensors file: every answer's tokens back to back (`tokens` int32 [T]) and where
each starts (`starts` int64 [R]), with the vocabulary size and a digest of the tokenizer in its metadata,
checked on load. Beyond `max_tokens` stored tokens the oldest answers are dropped (first in, first out).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from exitspec.atomic import atomic_file
from exitspec.build import ranked_tree
from exitspec.estimates import SourceMerge, lookup_bins, lookup_estimator
from exitspec.tree import DraftTree

MAX_MATCH = 64  # the longest context tail a suffix tree matches (its depth)
SPEC_FACTOR = 4.0  # α: a tree holds at most α · (match length) nodes (SuffixDecoding's max_spec_factor)
MIN_PROBABILITY = 0.1  # nodes whose frequency estimate q falls below this are not proposed
MEMORY_TOKENS = 250_000  # default bound on a memory's stored tokens: about 75 MiB of suffix tree (291 MiB at 1M)
MIN_ANSWER = 2  # shorter answers teach nothing
MAX_NODES = 32  # a suffix tree's speculation holds at most this many nodes
SOURCES = ("request", "memory")  # the candidate sources, each with its estimator
VERSION = 2  # of how proposals are made (2: the request tree leaves out the context's last token)


def identity() -> str:
    """How the suffix trees propose, as one string: drafters' identities include it, so warm-start state learned
    under other settings or an older version is not taken for this one's (warm.py)."""
    return f"suffix{VERSION}(alpha={SPEC_FACTOR}, min_q={MIN_PROBABILITY}, nodes={MAX_NODES})"


def _suffix_tree():
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree
    except ImportError as e:  # a one-line user error (options.USER_ERRORS)
        raise ModuleNotFoundError(
            f"suffix drafting needs arctic-inference's suffix tree ({e}); install it: pip install arctic-inference"
        ) from None
    return SuffixTree(MAX_MATCH)


def tokenizer_digest(tokenizer) -> str:
    """16 hex digits of sha256 of the tokenizer's vocabulary (token → id): two tokenizers that agree on it encode
    alike, so a memory of one is good for the other. "none" for a target without a tokenizer (token ids in and
    out)."""
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SuffixProposal:
    """The candidate tree of each suffix tree that matched ("request", "memory"), as (parents, tokens, q) lists
    under the root: parents index this list, −1 the root."""

    drafts: dict[str, tuple[list[int], list[int], list[float]]]
    max_depth: int


class SuffixMemory:
    """Every finished answer of one target, in one suffix tree, oldest dropped first beyond `max_tokens`."""

    def __init__(self, vocab_size: int, max_tokens: int = MEMORY_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"a suffix memory's max_tokens must be >= 0, got {max_tokens}")
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.tree = _suffix_tree()
        self.answers: deque[tuple[int, list[int]]] = deque()  # (sequence id, tokens), oldest first
        self.stored = 0  # tokens in `answers`
        self._next_id = 0

    def holds(self, answer: Sequence[int], span: int = 16) -> bool:
        """Whether a stored answer contains the first `span` tokens of `answer`: a measurement that drafts from
        this memory would find that answer's start already there."""
        head = array("q", answer[:span]).tobytes()
        return bool(head) and any(head in array("q", tokens).tobytes() for _, tokens in self.answers)

    def add(self, tokens: Sequence[int]) -> None:
        """Stores one finished answer (drops the oldest ones while the memory holds more than max_tokens)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < MIN_ANSWER or len(tokens) > self.max_tokens:
            return
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"an answer holds token ids outside the target's vocabulary of {self.vocab_size}")
        self.tree.extend(self._next_id, tokens)
        self.answers.append((self._next_id, tokens))
        self._next_id += 1
        self.stored += len(tokens)
        while self.stored > self.max_tokens:
            seq, old = self.answers.popleft()
            self.tree.remove(seq)
            self.stored -= len(old)

    def save(self, path: str | Path, tokenizer: str) -> None:
        """Writes the answers as safetensors, atomically (a temporary file renamed into place); `tokenizer` is
        its digest (tokenizer_digest), checked by `restore`."""
        flat = [t for _, tokens in self.answers for t in tokens]
        starts = [0]
        for _, tokens in self.answers:
            starts.append(starts[-1] + len(tokens))
        tensors = {"tokens": torch.tensor(flat, dtype=torch.int32),
                   "starts": torch.tensor(starts[:-1], dtype=torch.int64)}
        with atomic_file(path) as tmp:
            save_file(tensors, tmp, metadata={"vocab_size": str(self.vocab_size), "tokenizer": tokenizer})

    def restore(self, path: str | Path, tokenizer: str) -> str:
        """Adds the answers of a file written by `save` for this tokenizer and returns the file's digest; a wrong or
        damaged file is one ValueError, and nothing is added. A side that knows no tokenizer ("none": token ids
        in and out, e.g. transformers' generate without one) trusts the vocabulary size alone, since the file
        is already the same model's (warm.memory_path)."""
        path = Path(path)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                flat, starts = f.get_tensor("tokens"), f.get_tensor("starts")
            file_vocab, file_tokenizer = int(meta["vocab_size"]), meta["tokenizer"]
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path} is not an exitspec suffix memory ({type(e).__name__}: {e})") from None
        if file_vocab != self.vocab_size or (file_tokenizer != tokenizer and "none" not in (file_tokenizer, tokenizer)):
            raise ValueError(f"the suffix memory {path} belongs to another tokenizer (vocabulary {file_vocab}, digest "
                             f"{file_tokenizer}; this target's: {self.vocab_size}, {tokenizer})")
        bounds = [*starts.tolist(), flat.numel()]
        if flat.dim() != 1 or starts.dim() != 1 or any(b > e for b, e in pairwise(bounds)) or bounds[0] < 0:
            raise ValueError(f"{path} has answer tensors of inconsistent shapes")
        answers = [flat[start:end].tolist() for start, end in pairwise(bounds)]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size):
            raise ValueError(f"{path} holds token ids outside the target's vocabulary of {self.vocab_size}")
        for answer in answers:
            self.add(answer)
        return file_tokenizer


class SuffixSource:
    """Suffix-tree candidates for one decoder: a request tree, rebuilt per prompt, and an optional memory."""

    def __init__(self, memory: SuffixMemory | None = None):
        self.memory = memory
        self.request = None  # the suffix tree of the current prompt + answer so far
        self.synced = 0  # context tokens in `request`: all but the last (see sync)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.request = _suffix_tree()
        self.synced = 0
        self.sync(list(prompt_ids))

    def propose(self, context: list[int], max_depth: int) -> SuffixProposal:
        """Each tree's best-first speculation after the context's last tokens (MAX_NODES nodes at most)."""
        self.sync(context)
        tail = context[-MAX_MATCH:]
        trees = {"request": self.request}
        if self.memory is not None:
            trees["memory"] = self.memory.tree
        drafts = {}
        for name, tree in trees.items():
            draft = tree.speculate(tail, MAX_NODES, SPEC_FACTOR, 0.0, MIN_PROBABILITY, True)
            if draft.token_ids:
                drafts[name] = (list(draft.parents), list(draft.token_ids), list(draft.probs))
        return SuffixProposal(drafts, max_depth)

    def learn(self, answer: Sequence[int]) -> None:
        if self.memory is not None:
            self.memory.add(answer)

    def trees(self, proposal: SuffixProposal, root_token: int) -> dict[str, DraftTree]:
        """The proposal as candidate trees no deeper than its max_depth, best first (q never grows along a path,
        so parents come first); their `scores` are the frequency estimates q."""
        out = {}
        for name, (parents, tokens, probs) in proposal.drafts.items():
            depth = [0] * len(tokens)
            for i, p in enumerate(parents):  # arctic lists a parent before its children
                depth[i] = 1 if p < 0 else depth[p] + 1
            nodes = [i for i in range(len(tokens)) if depth[i] <= proposal.max_depth]
            if nodes:
                out[name] = ranked_tree(root_token, nodes, parents, tokens, depth, probs)
        return out

    def sync(self, context: list[int]) -> None:
        """Extends the request tree to hold the context but its last token. The tail being matched then is not
        in the tree itself: an occurrence at the very end, with nothing after it, would count in every match
        and halve the estimate of a continuation seen once (q = 1/2 where it was always followed so)."""
        end = len(context) - 1
        if end > self.synced:
            self.request.extend(0, context[self.synced : end])
            self.synced = end


class SuffixDrafter:
    """The suffix trees alone as a drafter (training-free, like prompt lookup, for any target): their candidate
    trees merged on the estimated P(u) scale. It reads no target features."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int):
        self.source = SuffixSource(SuffixMemory(vocab_size))
        self.merge = SourceMerge({name: (lookup_estimator, lookup_bins) for name in SOURCES})

    def estimate_for(self, setting: Hashable) -> None:
        self.merge.use(setting)

    def identity(self) -> str:
        return identity()

    def estimates_state(self) -> dict:
        return self.merge.state(self.merge.setting)

    def load_estimates(self, state: dict) -> None:
        self.merge.load_state(self.merge.setting, state)

    def begin(self, prompt_ids: Tensor, features: Tensor | None) -> None:
        self.source.begin(prompt_ids.tolist())

    def propose(self, context: Sequence[int], max_depth: int, cheap: bool = False) -> SuffixProposal:
        return self.source.propose(list(context), max_depth)

    def build(self, proposal: SuffixProposal, root_token: int, budget: int) -> DraftTree:
        return self.merge.build(root_token, self.source.trees(proposal, root_token), budget)

    def observe(self, tree: DraftTree, reach: list[float]) -> None:
        self.merge.observe(tree, reach)

    def commit(self, committed_ids: Tensor, features: Tensor | None) -> None:
        pass

    def learn(self, answer: list[int]) -> None:
        self.source.learn(answer)

    def memory(self) -> SuffixMemory:
        return self.source.memory
