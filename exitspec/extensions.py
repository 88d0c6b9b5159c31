"""exitspec's C++ kernels (csrc/), compiled on first use for the CPU at hand and cached by torch.

Each source builds once per version of its text (its digest names the build, so an edit rebuilds it) with
-march=native (the same machine runs both sides of every comparison) and FMA contraction off (only a kernel's
explicit fused multiply-adds fuse, so a vector lane and a loop's scalar tail round alike).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]


def digest(source: str) -> str:
    """12 hex digits of the source's text: its build's name, and its version in forward configs and cost caches."""
    return hashlib.sha256((CSRC / source).read_bytes()).hexdigest()[:12]


@cache
def build(source: str, purpose: str):
    """The compiled extension of csrc/`source`; a one-line RuntimeError naming the remedy where it cannot be
    built (`purpose`: what needs it)."""
    from torch.utils.cpp_extension import load

    name = f"exitspec_{Path(source).stem}_{digest(source)}"
    try:
        return load(name=name, sources=[str(CSRC / source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    except (OSError, RuntimeError, ImportError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise RuntimeError(f"{purpose} needs exitspec's C++ kernel {source}, which did not build ({reason}); "
                           f"install g++ and ninja") from None
