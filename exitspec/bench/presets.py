"""The paper's tables as benchmark presets: temperatures, verifiers, budgets (drafters come from --drafters).

| preset | measures                                                                                  |
|--------|-------------------------------------------------------------------------------------------|
| table1 | τ and SR per dataset x temperature {0, 1} x verifier {predraw, tev}, B = 32               |
| table4 | drafters x verifiers {greedy (T = 0 only), predraw, sequential, tev} crossed, B = 32      |
| table5 | budget sweep with tev: each drafter's chain (at B = 64), then trees of B = 8, 16, 32, 64  |
| edit   | copy-heavy sets (humaneval-edit, gsm8k-rewrite, mtbench-revise) x T {0, 1}, tev, auto     |

Every option given on the command line overrides the preset's value; a preset without datasets runs the
four built-in benchmark sets (data.BUILTIN).
"""

from __future__ import annotations

from dataclasses import dataclass

from exitspec.data import BUILTIN, EDITS
from exitspec.settings import DRAFT_MODEL_PREFIXES

LLAMACPP_FILES = ("q4_1", "q8_0", "bf16")  # the default model's GGUF files that llama.cpp decodes (bench/llamacpp.py)
LLAMACPP_VARIANTS = tuple(f + s for f in LLAMACPP_FILES for s in ("", "-ngram"))  # -ngram: its n-gram speculation
LLAMACPP_PREFIX = "llamacpp-"
LLAMACPP_PEERS = tuple(LLAMACPP_PREFIX + v for v in LLAMACPP_VARIANTS)
PEERS = ("hf-lookup", "vllm-fp32", "vllm-bf16", "vllm-ngram", "vllm-ngram-bf16", "vllm-suffix",
         "vllm-suffix-bf16", *LLAMACPP_PEERS)  # bench --peers (bench/peers.py), torch-free here
ASSISTANT = "hf-assistant:"  # and hf-assistant:SPEC, SPEC a draft model (model:PATH, layers:K): transformers' chains


def peer_option(value: str) -> str:
    """A --peers value: one of PEERS, or hf-assistant: and a draft-model drafter spec."""
    spec = value.removeprefix(ASSISTANT)
    if value in PEERS or (value != spec and spec.startswith(DRAFT_MODEL_PREFIXES)):
        return value
    raise ValueError(f"unknown peer {value!r}: choose among {', '.join(PEERS)} or hf-assistant:layers:K / "
                     "hf-assistant:model:PATH")


@dataclass(frozen=True)
class Preset:
    temperatures: tuple[float, ...] = (0.0,)
    verifiers: tuple[str, ...] = ("tev",)
    budgets: tuple[int | str, ...] = (32,)
    chain: bool = False  # also each drafter's chain ("chain:D") at the largest budget
    datasets: tuple[str, ...] = BUILTIN


PRESETS = {
    "table1": Preset(temperatures=(0.0, 1.0), verifiers=("predraw", "tev")),
    "table4": Preset(temperatures=(0.0, 1.0), verifiers=("greedy", "predraw", "sequential", "tev")),
    "table5": Preset(temperatures=(0.0, 1.0), budgets=(8, 16, 32, 64), chain=True),
    "edit": Preset(temperatures=(0.0, 1.0), budgets=("auto",), datasets=EDITS),
}
CUSTOM = Preset()  # no --preset: greedy, tev, B = 32
