"""Batch-invariant attention: a query row's output depends only on its own query and its own keys, in position
order, never on how many rows share the forward or where the tree put its keys. With it a bf16 target verifies a
tree exactly as it decodes one token at a time.

Why: exactness refers to the target as it is run. A tree forward computes every node's logits in one call;
autoregressive decoding computes the same positions one row at a time. In fp32 the two agree to ~1e-5 and greedy
outputs match. In bf16, CPU sdpa's result depends on the query count and key length through its blocking, and a
tree's keys interleave its branches: greedy tree output left bf16 autoregressive output within 12–70 tokens.

The kernel (csrc/invariant_attention.cpp) computes each row r at position p_r over its keys j = 0..p_r (the cache,
then its ancestors-or-self in depth order) as

    s_j = scale · Σ_d q_d k_{j,d}   (in order of d),      m = max_j s_j,      w_j = exp(s_j − m),
    out = Σ_j w_j v_j / Σ_j w_j     (in order of j),

in fp32 (the lean forward keeps its cache in float32 for it, the keys transposed, so no call converts the cache),
with one fixed sequence of float operations per number: vectorised across keys for the scores and across d for the
sums, never across the order of a sum; FMA contraction off, so a vector lane and a loop's scalar tail round alike;
exp as plain arithmetic (a libm call differs between its vector and scalar versions). A one-token step lays out the
same keys in the same order in its cache, so it computes the same bits. Together with products that are invariant in
the row count (lean.LeanLlama.linear runs bf16 products on 2 rows or more) a tree's logits equal the one-token steps'
bit for bit (tests/test_attention.py).

The extension is compiled on first use (extensions.py; ~30 s, cached under torch's extensions folder, one build
per version of the source).
"""

from __future__ import annotations

from torch import Tensor

from exitspec.extensions import build, digest

IDENTITY = f"invariant:{digest('invariant_attention.cpp')}"  # in forward configs and cost caches


def kernel():
    """The compiled extension (extensions.build)."""
    return build("invariant_attention.cpp", "bf16 on a CPU (or run in float32)")


def invariant_attention(q: Tensor, keys_t: Tensor, values: Tensor, visible: Tensor, start: int, scale: float) -> Tensor:
    """q [Hkv, g, n, hd] (the g query heads of each KV head, n new rows); keys_t [Hkv, hd, ≥ start + n] and values
    [Hkv, ≥ start + n, hd], float32 with the last dim contiguous (the cache, then the new rows'; slots past them
    unread); visible [n, n] bool (row i sees new row j: ancestors-or-self, parents before children). Returns
    [Hkv, g, n, hd] in q's dtype (the equations above)."""
    return kernel().invariant_attention(q, keys_t, values, visible, start, scale)
