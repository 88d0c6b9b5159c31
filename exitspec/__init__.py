"""exitspec: exact tree speculative decoding (tree -> flow -> verify -> build -> models -> decode -> train -> bench).

On AMD CPUs, MKL (torch's CPU BLAS) takes a slow generic path for the small matrix products that tree
verification makes: on a 2-core EPYC, a 9-token SmolLM2-135M forward cost 3.1x a 1-token one. Its AVX2
code branch (MKL_CBWR=AVX2) brings that to 1.6x. MKL reads the variable when it loads, so it is set here,
before exitspec imports torch, and only where the user has not set it.
"""

import os
from pathlib import Path


def _amd_cpu() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "AuthenticAMD" in cpuinfo.read_text(errors="replace")[:4096]


if _amd_cpu():
    os.environ.setdefault("MKL_CBWR", "AVX2")
