"""exitspec: exact tree speculative decoding. Dependencies point one way (tests/test_code_shape.py): the core (tree
-> flow -> verify -> build -> models -> target -> decode, with drafters, hf and train beside it) -> app (decoders
from options) -> the commands (commands, exits, serve, bench, train.cli) -> cli. Importing it changes nothing;
`setup_cpu()` is the one CPU setting it recommends."""

import os
from pathlib import Path


def setup_cpu() -> None:
    """Makes MKL take its AVX2 code path on AMD CPUs, unless the user set MKL_CBWR themselves.

    MKL, torch's CPU BLAS, runs a slow generic branch for the small matrix products of tree verification on
    AMD: on a 2-core EPYC a 9-token SmolLM2-135M forward cost 3.1× a 1-token one, and 1.6× with
    MKL_CBWR=AVX2. MKL reads the variable at its first BLAS call, so call this before any tensor math (an
    import of torch before it is fine). The `exitspec` command does it first thing.
    """
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "AuthenticAMD" in cpuinfo.read_text(errors="replace")[:4096]:
        os.environ.setdefault("MKL_CBWR", "AVX2")
