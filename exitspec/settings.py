"""The values a decoder takes, and their checks: budgets, verifier and dtype names, device names, the default
model; and the CPU it runs on (native_bf16, cpu_name). Standard library only, so that the command line
(options.py) checks them before torch loads, and the core (decode, app, models, drafters) shares the same rules.
"""

from __future__ import annotations

import platform
import re
from functools import cache
from pathlib import Path

AUTO = "auto"
AUTO_CAP = 32  # the largest tree `--budget auto` builds unless given auto:B
MAX_BUDGET = 4096  # draft tokens per tree: beyond this no tree pays; below it app.check_budgets checks memory
DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0", "q4_1", "gguf")
# precisions the quantized forward runs (quant.py): gguf is the model file's own blocks
QUANTIZED = ("q8_0", "q4_1", "gguf")
VERIFIERS = ("greedy", "predraw", "sequential", "tev")  # the keys of verify.DECIDERS (a test keeps them equal)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# drafter specs of draft models: a causal-LM folder, the target's first K layers
DRAFT_MODEL_PREFIXES = ("model:", "layers:")
DRAFTER_HELP = (
    "'dflash' (the DFlash drafter shipped for the default model; the default there), 'ngram' (prompt lookup; the "
    "default for other models), 'suffix' (suffix trees over the request and earlier answers), a DFlash checkpoint "
    "folder, model:PATH (a small causal LM of the target's tokenizer growing dynamic trees), layers:K (the target's "
    "first K layers as that draft model), or chain:SPEC (the best path of SPEC's trees: plain chain speculative "
    "decoding)"
)


def parse_budget(value: str | int) -> int | str:
    """`B` (a fixed budget of B draft tokens, B >= 0), `auto` (cost-aware, at most 32) or `auto:B`."""
    text = str(value).strip().lower()
    if text == AUTO:
        return f"{AUTO}:{AUTO_CAP}"
    try:
        cap = int(text[len(AUTO) + 1 :]) if text.startswith(f"{AUTO}:") else int(text)
    except ValueError:
        raise ValueError(f"budget must be a number of draft tokens, 'auto' or 'auto:B'; got {value!r}") from None
    if cap < 0:
        raise ValueError(f"budget must be >= 0 draft tokens per round, got {cap}")
    if cap > MAX_BUDGET:
        raise ValueError(f"a budget of {cap} is over the limit of {MAX_BUDGET} draft tokens per tree")
    return f"{AUTO}:{cap}" if text.startswith(AUTO) else cap


def budget_cap(budget: int | str) -> int:
    """The most draft tokens a round may hold under `budget` (parsed)."""
    return int(str(budget).split(":")[1]) if isinstance(budget, str) else budget


def check_device_name(name: str) -> str:
    """`name` if it spells a device exitspec runs on (cpu, cuda, cuda:N, mps); app.resolve_device checks that
    it is there."""
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps")
    return name


@cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or AMX): there a bf16 target decodes as fast as fp32
    and verifies trees far cheaper, and its products are row-invariant (lean.invariant_by_default)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.is_file() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    """This CPU's model name (/proc/cpuinfo's), for the records of a measurement; the platform's own word where
    there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
