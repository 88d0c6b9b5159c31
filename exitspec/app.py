"""The application layer: how a command line becomes a running decoder.

    exitspec generate "Hi" --budget 64
      cli.main ─ setup_cpu ─ cli.build_parser: options.py's groups and checked types (no torch yet)
        ─ models.resolve_device: the device is there   ─ check_budgets: the tree fits context and memory
        ─ load_decoders: the target once, then per drafter SpeculativeDecoder.from_model over its weights
          (the drafter checked against it, the target tapping the drafter's layers, one calibration for all)
        ─ the command; a user error ends as one line on stderr and exit code 2 (options.run_command)

Every command that decodes (generate, inspect, bench, latency, train eval) gets its decoders from
`load_decoders`; a library user builds several the same way, or one with `SpeculativeDecoder.from_pretrained`
(a folder) or `SpeculativeDecoder.from_model` (a loaded transformers model).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from exitspec import setup_cpu
from exitspec.budget import DENSE
from exitspec.decode import SpeculativeDecoder
from exitspec.models import check_loaded, load_model_and_tokenizer, model_config, resolve_device
from exitspec.settings import DEFAULT_MODEL, budget_cap, parse_budget

__all__ = ["load_decoders", "setup_cpu"]


def load_decoders(
    model: str | Path | PreTrainedModel | None,
    drafters: Sequence[str],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    lookup: str | Path = "auto",
    budgets: Sequence[int | str] = ("auto",),
    warm_start: bool = True,
    learn: bool = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
    weight_copies: bool | None = None,
):
    """{drafter spec: SpeculativeDecoder}, all sharing one copy of the target's weights and one calibration.

    model: a local HF causal-LM folder, None for the default SmolLM2-135M-Instruct, or a loaded transformers
    model (with its `tokenizer`, if any), whose weights the decoders use in place, on its device and in its
    dtype (`device` and `dtype` must then be left out or agree). `weight_copies`: the row plan may lay the
    weights out again where that is faster (each layout a full copy; TargetModel); default yes for a folder,
    no for a loaded model, which the caller keeps using and should not pay for twice. drafters: specs of
    `drafters.load_drafter` ('dflash', 'ngram', 'suffix', a checkpoint folder, chain:SPEC), each checked
    against the target; each decoder's TargetModel taps exactly the layers its drafter reads. `lookup`: the
    DFlash drafters' corpus-lookup table (load_drafter: auto, none or a path). Each decoder is calibrated
    for the largest of `budgets` (`SpeculativeDecoder.calibrate`: one cost grid, the same row plan on every
    decoder's target), so its speculative and autoregressive runs share one forward configuration from the
    start; no `budgets` (a command that times no decoding) skips it. `warm_start`: each decoder's runs start
    from what earlier processes learned under the same settings, and save what they learn (warm.py). `learn`:
    each finished answer goes into the drafter's suffix memory, which later requests draft from (off for
    measurements, whose prompts must not find their own earlier answers there).
    """
    if threads:
        torch.set_num_threads(threads)
    if isinstance(model, PreTrainedModel):
        hf_model = check_loaded(model, device, dtype)
    else:
        hf_model, tokenizer = load_model_and_tokenizer(model, device, dtype)
    copies = not isinstance(model, PreTrainedModel) if weight_copies is None else weight_copies
    cap = max(DENSE, *(budget_cap(parse_budget(b)) for b in budgets)) if budgets else None
    decoders, cost = {}, None
    for spec in dict.fromkeys(drafters):
        decoders[spec] = SpeculativeDecoder.from_model(hf_model, tokenizer, spec, lookup, None, warm_start, learn,
                                                       copies, cap, cost)
        cost = decoders[spec].costs.get(cap)
    return decoders


def check_budgets(budgets: Sequence[int | str], model: str | Path | None, device=None) -> None:
    """Raises ValueError naming the limit when a budget cannot run: the tree must fit the model's context,
    and one tree forward's working memory must fit in half of the memory free on `device`.

    Reads only the model's config.json. The estimate (fp32 bytes, N+1 tree rows over a full context C):
    logits and their warped copies 4·(N+1)·V, the additive mask (N+1)·(C+N+1), attention scores
    heads·(N+1)·(C+N+1), MLP activations 3·(N+1)·I.
    """
    cap = max((budget_cap(b) for b in budgets), default=0)
    if cap == 0:
        return
    config = model_config(model)
    context = config.max_position_embeddings
    if cap + 2 > context:
        raise ValueError(f"a budget of {cap} draft tokens does not fit the context of {context} tokens of "
                         f"{model or DEFAULT_MODEL} (at most {context - 2})")
    rows, cols = cap + 1, context + cap + 1
    floats = 4 * rows * config.vocab_size + rows * cols * (1 + config.num_attention_heads)
    floats += 3 * rows * config.intermediate_size
    need, free = 4 * floats, free_memory(resolve_device(device))
    if need > free / 2:
        raise ValueError(f"a budget of {cap} draft tokens needs about {need / 2**30:.1f} GiB per tree forward at a "
                         f"full context, over half of the {free / 2**30:.1f} GiB free here; use a smaller --budget")


def free_memory(device: torch.device) -> int:
    """Bytes free on `device`: the GPU's free memory, or MemAvailable from /proc/meminfo (else 8 GiB)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 8 << 30
