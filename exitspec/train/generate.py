"""Batched generation of rollouts: continuous batching over a static KV cache, for Llama-family targets.

transformers' batched `generate` runs a batch until its longest row ends. Rollouts are capped at 256 tokens
and many end far sooner, so a large share of its row-steps decode padding. Here each of R rows holds one
prompt at a time; when a response ends (an end-of-sequence token, max_new_tokens, or a repetition loop), the
row takes the next prompt. Every step then advances R live responses.

    cache   keys, values [layers, R, Hkv, capacity, hd]; row r holds its first lengths[r] entries
    prefill one forward of row r's prompt, n tokens under a causal mask (the row restarts at 0)
    step    one forward of one token per row; row r's query sees its first lengths[r] + 1 entries

The layers are lean.py's (`decoder_layer`, the fused weights of `LeanLlama`), so the maths is the lean
forward's, which tests check against transformers.

Sampling is greedy, or at temperature T with one generator per prompt, seeded by (seed, prompt id): a
response's random draws depend neither on the prompts that shared its batch nor on where a resumed job
restarted. Other architectures fall back to transformers' `generate`, one static batch at a time.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

from exitspec.lean import LeanLlama, additive_mask, decoder_layer, supports

LOOP_SPANS = range(4, 65)  # span lengths a repetition loop is looked for at


class LeanBatch:
    """R rows of independent sequences over one static cache (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, rows: int, capacity: int):
        self.lean = LeanLlama(model)
        lean = self.lean
        shape = (len(lean.layers), rows, lean.kv_heads, capacity, lean.head_dim)
        # zeros, not empty: a row's query masks the slots past its length, but 0 · NaN from uninitialised memory
        # would still reach its output
        self.keys = torch.zeros(shape, dtype=lean.dtype, device=lean.device)
        self.values = torch.zeros(shape, dtype=lean.dtype, device=lean.device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=lean.device)  # [R]
        self.rows, self.capacity = rows, capacity
        self.groups = lean.heads // lean.kv_heads

    @torch.inference_mode()
    def prefill(self, row: int, ids: Tensor) -> Tensor:
        """Puts prompt ids [n] in row `row` (replacing what it held); returns the logits [V] after its last token."""
        n = ids.numel()
        if not 1 <= n < self.capacity:
            raise ValueError(f"a prompt of {n} tokens does not fit a row of {self.capacity} cache entries")
        lean, g = self.lean, self.groups
        x = lean.embed(ids)[None]  # [1, n, D]
        cos, sin = lean.rotary(x, torch.arange(n, device=ids.device)[None])  # [1, n, hd]
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        mask = additive_mask(causal, 0, x.dtype).repeat(g, 1)  # [g·n, n]
        for i, layer in enumerate(lean.layers):

            def attend(q: Tensor, k: Tensor, v: Tensor, i: int = i) -> Tensor:  # [1, H, n, hd], [1, Hkv, n, hd] x 2
                keys, values = self.keys[i, row : row + 1, :, :n], self.values[i, row : row + 1, :, :n]
                keys.copy_(k), values.copy_(v)
                stacked = q.reshape(1, lean.kv_heads, g * n, -1)
                out = F.scaled_dot_product_attention(stacked, keys, values, attn_mask=mask)
                return out.view(q.shape)  # [1, H, n, hd]

            x = decoder_layer(layer, x, cos[:, None], sin[:, None], lean.head_shape, attend)
        self.lengths[row] = n
        return lean.lm_head(lean.final_norm(x[0, -1])).float()

    @torch.inference_mode()
    def step(self, tokens: Tensor) -> Tensor:
        """Appends tokens [R] (one per row) and returns every row's next-token logits [R, V]. A row that would
        outgrow the cache raises; an idle row may be stepped with any token (reset it with `prefill`)."""
        lean, g, rows = self.lean, self.groups, torch.arange(self.rows, device=tokens.device)
        lengths = self.lengths
        if int(lengths.max()) >= self.capacity:
            raise ValueError(f"a row outgrew its {self.capacity} cache entries")
        end = int(lengths.max()) + 1
        x = lean.embed(tokens)[:, None]  # [R, 1, D]
        cos, sin = lean.rotary(x, lengths[:, None])  # [R, 1, hd]
        visible = torch.arange(end, device=tokens.device) <= lengths[:, None]  # [R, end]
        mask = torch.zeros(self.rows, 1, 1, end, dtype=x.dtype, device=tokens.device)
        mask.masked_fill_(~visible[:, None, None], float("-inf"))  # [R, 1, 1, end]: each row its own prefix
        for i, layer in enumerate(lean.layers):

            def attend(q: Tensor, k: Tensor, v: Tensor, i: int = i) -> Tensor:  # [R, H, 1, hd], [R, Hkv, 1, hd] x 2
                self.keys[i][rows, :, lengths] = k[:, :, 0]
                self.values[i][rows, :, lengths] = v[:, :, 0]
                q = q.reshape(self.rows, lean.kv_heads, g, -1)  # [R, Hkv, g, hd]: a KV group's query heads
                out = F.scaled_dot_product_attention(
                    q, self.keys[i, :, :, :end], self.values[i, :, :, :end], attn_mask=mask
                )
                return out.reshape(self.rows, -1, 1, out.shape[-1])  # [R, H, 1, hd]

            x = decoder_layer(layer, x, cos[:, None], sin[:, None], lean.head_shape, attend)
        self.lengths += 1
        return lean.lm_head(lean.final_norm(x[:, 0])).float()


class LoopWatch:
    """Per row, how many tokens in a row equal the token `span` before them, for every span in LOOP_SPANS: a
    row loops once some span's run reaches (repeats − 1)·span, i.e. the span has come `repeats` times back to
    back (rollouts.loop_start's test, one token at a time for all rows)."""

    def __init__(self, rows: int, max_tokens: int, repeats: int, device):
        self.spans = torch.tensor(list(LOOP_SPANS), device=device)  # [S]
        self.tokens = torch.zeros(rows, max_tokens, dtype=torch.long, device=device)  # [R, T]
        self.runs = torch.zeros(rows, len(LOOP_SPANS), dtype=torch.long, device=device)  # [R, S]
        self.repeats = repeats

    def reset(self, row: int) -> None:
        self.runs[row] = 0

    def add(self, tokens: Tensor, lengths: Tensor, live: Tensor) -> Tensor:
        """tokens [R] at response positions lengths [R], taken in the rows where live [R] -> [R] bool: the row
        has just closed a loop."""
        back = lengths[:, None] - self.spans  # [R, S]: position of the token one span back
        same = (back >= 0) & (self.tokens.gather(1, back.clamp(min=0)) == tokens[:, None])
        self.runs = torch.where(live[:, None], torch.where(same, self.runs + 1, 0), self.runs)
        at = lengths.clamp(max=self.tokens.shape[1] - 1)[:, None]  # [R, 1]
        self.tokens.scatter_(1, at, torch.where(live[:, None], tokens[:, None], self.tokens.gather(1, at)))
        if self.repeats < 2:
            return torch.zeros_like(live)
        return live & (self.runs >= (self.repeats - 1) * self.spans).any(dim=1)


def next_tokens(logits: Tensor, temperature: float, generators: Sequence[torch.Generator | None]) -> Tensor:
    """The next token of each row [R] from logits [R, V]: argmax at temperature 0, else a draw from
    softmax(logits / T) with the row's own generator."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.cat([torch.multinomial(p, 1, generator=gen) for p, gen in zip(probs, generators, strict=True)])


def prompt_generator(seed: int, prompt_id: str, device) -> torch.Generator:
    """The sampling generator of one prompt: seeded by (seed, prompt id) alone (32 bits: the CPU generator's
    Mersenne twister keeps only the low 32 bits of a seed)."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{prompt_id}".encode()))


def generate_responses(
    model: PreTrainedModel,
    prompts: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    loop_repeats: int,
    eos_ids: Sequence[int],
    pad_id: int,
    rows: int = 64,
) -> Iterator[tuple[int, list[int]]]:
    """Yields (index in prompts, response ids) as responses end, in no fixed order. A response ends after its
    first end-of-sequence token (kept), after max_new_tokens, or once it loops (LoopWatch; the caller cuts
    the loop with rollouts.loop_start)."""
    if supports(model) is not None:
        yield from _transformers_responses(model, prompts, max_new_tokens, temperature, seed, loop_repeats, eos_ids,
                                           pad_id, rows)
        return
    if not prompts:
        return
    pool = _Rows(model, prompts, min(rows, len(prompts)), max_new_tokens, temperature, seed, loop_repeats, eos_ids)
    queue = deque(range(len(prompts)))
    while True:
        for row in range(pool.rows):
            while pool.owner[row] is None and queue:  # a new prompt for an idle row (a one-token response ends at once)
                if pool.start(row, queue.popleft()):
                    yield pool.finish(row)
        live = torch.tensor([o is not None for o in pool.owner], device=pool.device)
        if not bool(live.any()):
            return
        for row in pool.step(live):
            yield pool.finish(row)


class _Rows:
    """The rows of a lean batch, each answering one prompt at a time (generate_responses): which prompt a row
    holds, its sampler, its response so far (in the loop watch) and its last token, the next input."""

    def __init__(self, model, prompts, rows, max_new_tokens, temperature, seed, loop_repeats, eos_ids):
        self.prompts, self.rows, self.max_new_tokens, self.temperature, self.seed = (
            prompts, rows, max_new_tokens, temperature, seed)
        self.device = model.get_output_embeddings().weight.device
        self.batch = LeanBatch(model, rows, max(len(ids) for _, ids in prompts) + max_new_tokens)
        self.watch = LoopWatch(rows, max_new_tokens, loop_repeats, self.device)
        self.eos = torch.tensor(list(eos_ids), device=self.device)
        self.owner: list[int | None] = [None] * rows  # the prompt index each row holds
        self.generators: list[torch.Generator | None] = [None] * rows
        self.sizes = torch.zeros(rows, dtype=torch.long, device=self.device)  # [R] response tokens so far
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.device)  # [R] each row's last token

    def start(self, row: int, index: int) -> bool:
        """Prefills prompt `index` into `row` and draws its first token; True when that already ends it."""
        pid, ids = self.prompts[index]
        self.owner[row], self.sizes[row] = index, 0
        self.generators[row] = prompt_generator(self.seed, pid, self.device) if self.temperature > 0 else None
        self.watch.reset(row)
        logits = self.batch.prefill(row, torch.tensor(ids, device=self.device))
        new = self.tokens.clone()
        new[row] = next_tokens(logits[None], self.temperature, [self.generators[row]])[0]
        return bool(self._accept(new, torch.arange(self.rows, device=self.device) == row)[row])

    def step(self, live: Tensor) -> list[int]:
        """One decoding step of every live row [R]; returns the rows whose response just ended."""
        new = next_tokens(self.batch.step(self.tokens), self.temperature, self.generators)  # [R]
        ended = self._accept(new, live)
        self.batch.lengths.masked_fill_(~live, 0)  # idle rows stay empty
        return ended.nonzero().flatten().tolist()

    def finish(self, row: int) -> tuple[int, list[int]]:
        done = self.owner[row], self.watch.tokens[row, : int(self.sizes[row])].tolist()
        self.owner[row] = None
        return done

    def _accept(self, new: Tensor, live: Tensor) -> Tensor:
        """Records the new tokens [R] of the live rows [R]; returns [R] bool: the rows whose response just ended."""
        looped = self.watch.add(new, self.sizes, live)
        self.sizes.add_(live.long())
        self.tokens.copy_(torch.where(live, new, self.tokens))
        return live & (torch.isin(new, self.eos) | (self.sizes >= self.max_new_tokens) | looped)


def _transformers_responses(
    model, prompts, max_new_tokens, temperature, seed, loop_repeats, eos_ids, pad_id, rows
) -> Iterator[tuple[int, list[int]]]:
    """The fallback for architectures the lean forward lacks: static batches of `rows` prompts of similar
    length through transformers' `generate` (one sampling seed per batch)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    for start in range(0, len(order), rows):
        batch = order[start : start + rows]
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + start)
            responses = _generate(model, [prompts[i][1] for i in batch], max_new_tokens, temperature, loop_repeats,
                                  eos_ids, pad_id)
        yield from zip(batch, responses, strict=True)


@torch.inference_mode()
def _generate(model, prompts, max_new_tokens, temperature, loop_repeats, eos_ids, pad_id) -> list[list[int]]:
    """One left-padded batched `generate`; each response is cut after its first end-of-sequence token."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W]
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    sample = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
        top_k=0 if sample else None, top_p=1.0 if sample else None, eos_token_id=list(eos_ids), pad_token_id=pad_id,
    )
    stop = StoppingCriteriaList([LoopStop(loop_repeats)] if loop_repeats else [])
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config,
                         stopping_criteria=stop)
    responses = []
    eos = set(eos_ids)
    for row in out[:, width:].tolist():  # [B, T]
        end = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:end])
    return responses


class LoopStop(StoppingCriteria):
    """Ends a row of a batched `generate` once its last repeats × span tokens are one span repeated, for any
    span in LOOP_SPANS (the check of loop_start on each row's tail, as tensor ops)."""

    def __init__(self, repeats: int):
        self.repeats = repeats

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:  # input_ids [B, T] -> [B] bool
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for span in LOOP_SPANS:
            if self.repeats * span > input_ids.shape[1]:
                break
            tail = input_ids[:, -self.repeats * span :]  # [B, R*span]
            done |= (tail[:, span:] == tail[:, :-span]).all(dim=1)
        return done
