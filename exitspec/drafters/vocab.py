"""The draft vocabulary: a drafter that scores only the Vd tokens its target actually writes.

A DFlash drafter reads its logits through the target's frozen LM head, h·W^T with W [V, D]. On a small
target that product is most of the draft cost (SmolLM2-135M: V = 49152 rows against 576-wide states), yet
the target's responses use a few thousand distinct tokens. With a draft vocabulary `ids` [Vd] (ascending
token ids, saved in the drafter's checkpoint) the head is W[ids] [Vd, D]: the draft logits cost Vd/V of the
full ones, at inference and in training. EAGLE-3 drafts over a reduced vocabulary the same way (its d2t
map); FR-Spec picks it by token frequency, as `frequent_tokens` does.

Exactness is untouched: a drafter only proposes, and the verifier reads the target's own distribution. A
token outside the vocabulary can never be drafted, so it costs acceptance only where the target writes it;
`frequent_tokens` keeps the tokens of the training responses and prompts, end-of-sequence tokens always.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from exitspec.lean import Panels

# Responses are what the drafter proposes, so they rank first; prompt tokens fill the rest, as responses copy
# from prompts (coverage measured in data/dflash-runs/smollm2-135m-instruct-v2/README.md).
RESPONSE_WEIGHT = 10


class DraftHead:
    """The target's frozen LM head restricted to a draft vocabulary (None: the whole head, unchanged).

    `head(hidden)` gives logits over the draft vocabulary [..., Vd]; `expand` puts them back in the target's
    token space [..., V] (−inf outside the vocabulary); `columns` maps token ids to their draft columns.
    With `panels` set (lean.Panels of `weight`), rows [n, D] are multiplied by those: the DFlash drafter sets
    them where measured cheaper for its block's rows (on a CPU, 7 rows through 16 384 head rows cost 0.37× as much)."""

    def __init__(self, lm_head: nn.Module, vocab: Tensor | None):
        self.lm_head = lm_head
        self.vocab_size = lm_head.weight.shape[0]  # V
        self.vocab = vocab  # [Vd] ascending token ids, or None
        self.weight, self.bias = lm_head.weight, getattr(lm_head, "bias", None)  # [V, D], [V] or None
        self.index = None
        self.panels: Panels | None = None
        if vocab is not None:
            vocab = vocab.to(lm_head.weight.device)
            self.vocab = vocab
            self.weight = self.weight.detach()[vocab]  # [Vd, D]
            self.bias = None if self.bias is None else self.bias.detach()[vocab]
            self.index = torch.full((self.vocab_size,), -1, dtype=torch.long, device=vocab.device)  # [V]
            self.index[vocab] = torch.arange(vocab.numel(), device=vocab.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def __call__(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] -> logits [..., Vd] (or [..., V] without a draft vocabulary), in the head's dtype."""
        hidden = hidden.to(self.dtype)
        if self.panels is not None and hidden.dim() == 2:
            return self.panels(hidden, self.bias)
        return F.linear(hidden, self.weight, self.bias)

    def expand(self, logits: Tensor) -> Tensor:
        """Draft logits [..., Vd] -> [..., V] in the target's token space, −inf outside the vocabulary."""
        if self.vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, logits)

    def columns(self, tokens: Tensor) -> Tensor:
        """Token ids (any shape) -> their columns in the draft logits, −1 for a token outside the vocabulary."""
        return tokens if self.vocab is None else self.index[tokens]


def frequent_tokens(
    responses: Iterable[Sequence[int]], size: int, vocab_size: int, always: Sequence[int] = (),
    prompts: Iterable[Sequence[int]] = (), response_weight: int = RESPONSE_WEIGHT,
) -> Tensor:
    """The draft vocabulary [size] (ascending ids): the `always` tokens, then tokens by descending count (ties
    by id), a response token counting `response_weight` times and a prompt token once, then the lowest unused
    ids if the texts hold fewer distinct tokens."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary needs 1..{vocab_size} tokens (the target's vocabulary), got {size}")
    if any(not 0 <= t < vocab_size for t in always):
        raise ValueError(f"end-of-sequence ids {list(always)} are outside the vocabulary [0, {vocab_size})")
    counts = Counter()
    for tokens in prompts:
        counts.update(tokens)
    for tokens in responses:
        counts.update({t: response_weight * n for t, n in Counter(tokens).items()})
    ranked = list(dict.fromkeys([*always, *sorted(counts, key=lambda t: (-counts[t], t)), *range(vocab_size)]))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def check_draft_vocab(vocab: Tensor, vocab_size: int, source: str) -> None:
    """Raises ValueError unless `vocab` is a 1D strictly ascending list of ids in [0, vocab_size)."""
    if vocab.dim() != 1 or vocab.dtype != torch.long or vocab.numel() == 0:
        raise ValueError(f"{source}: draft_vocab must be a non-empty 1D int64 tensor, got {vocab.dtype} "
                         f"{tuple(vocab.shape)}")
    if vocab.numel() > 1 and not bool((vocab[1:] > vocab[:-1]).all()):
        raise ValueError(f"{source}: draft_vocab must list strictly ascending token ids")
    if int(vocab[0]) < 0 or int(vocab[-1]) >= vocab_size:
        raise ValueError(f"{source}: draft_vocab holds ids outside the vocabulary [0, {vocab_size})")
