"""The target stage (tree forward + commit, device-synchronised, median of 6 alternated runs) over bushy trees of
N nodes after 300 and 1000 cached tokens, bf16, 2 threads: the attention kernel before blocks of 8 rows (OLD, the
source at commit fb526ae) against the current one, in one process.

    git show fb526ae:exitspec/csrc/invariant_attention.cpp > /tmp/old.cpp
    python kernel-blocks.py /tmp/old.cpp
"""
import statistics
import sys

import torch
from torch.utils.cpp_extension import load

import exitspec
from exitspec import lean
from exitspec.app import load_decoders
from exitspec.attention import FLAGS, invariant_attention
from exitspec.bench.forward import bushy_tree, target_stage_seconds

exitspec.setup_cpu()
old = load(name="kx_old", sources=[sys.argv[1]], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"]).invariant_attention
d = load_decoders(None, ["dflash"], dtype="bfloat16", threads=2, budgets=None, warm_start=False, learn=False)["dflash"]
target = d.target
for context in (300, 1000):
    target.reset(); target.prefill(torch.arange(context) % 1000 + 100)
    times = {}
    for rep in range(6):
        for name, fn in (("old", old), ("new", invariant_attention)):
            lean.invariant_attention = fn
            for n in (0, 4, 16, 32):
                tree = bushy_tree(n, 1, target.vocab_size, target.device)
                times.setdefault((name, n), []).append(target_stage_seconds(target, tree))
    for n in (0, 4, 16, 32):
        o, w = (1e3 * statistics.median(times[(k, n)]) for k in ("old", "new"))
        print(f"context {context} N {n}: old kernel {o:.1f} ms, new {w:.1f} ms ({w / o - 1:+.1%})")
