"""`generate(model, input_ids, generation_config, **kwargs)`: transformers' `model.generate` arguments in, exact
tree speculative decoding of `model` out (`custom_generate/generate.py` hands it to transformers).

    model.generate(**inputs, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, drafter=..., budget=...)
      ─ the generation config as transformers resolves it (model.generation_config < generation_config < kwargs)
      ─ do_sample, temperature, top_k, top_p ─▶ SamplingParams; max_new_tokens (else max_length), eos_token_id
      ─ a decoder over the model's own weights, made once per model and drafter (SpeculativeDecoder.from_model)
      ─ SpeculativeDecoder.generate ─▶ LongTensor [1, prompt + new] or, with return_dict_in_generate,
        ExitspecGenerateOutput (sequences, and τ, C_p and the tree sizes of the run)

Batch size 1. Anything that would change the output law and that exitspec does not apply (beam search,
repetition penalties, logits processors, min_p, ...) is refused with one line naming it, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from exitspec.decode import SpeculativeDecoder

DECODER_OPTIONS = {  # exitspec's own keyword arguments to model.generate, with their defaults
    "drafter": None, "budget": "auto", "verifier": "tev", "lookup": "auto", "seed": None, "warm_start": True,
    "learn": True, "weight_copies": False,
}
# generation-config fields honoured here; every other field must keep its neutral value (None or the default)
HONOURED = {"do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "max_length", "eos_token_id",
            "pad_token_id", "bos_token_id", "return_dict_in_generate", "use_cache"}
METADATA = {"_from_model_config", "transformers_version"}
UNSUPPORTED_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                         "negative_prompt_ids", "negative_prompt_attention_mask")


@dataclass
class ExitspecGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only output (`sequences` [1, prompt + new]) plus the run's speculative statistics."""

    tau: float | None = None  # mean block length per round, bonus included
    mean_coverage: float | None = None  # mean C_p of the verified trees
    tree_sizes: list[int] | None = None  # N per round
    accepted_lengths: list[int] | None = None  # accepted draft tokens per round
    tokens_per_second: float | None = None


def generate(model, inputs=None, generation_config=None, streamer=None, tokenizer=None, synced_gpus=None,
             use_model_defaults=None, **kwargs):
    """Exact tree speculative decoding of `model` for transformers' `generate` arguments (module docstring)."""
    for name in UNSUPPORTED_ARGUMENTS:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"exitspec's custom_generate does not take {name}: it would change the output law")
    options = {name: kwargs.pop(name, default) for name, default in DECODER_OPTIONS.items()}
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    if input_ids is None:
        raise ValueError("exitspec's custom_generate needs input_ids (a [1, L] LongTensor)")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"exitspec's custom_generate decodes one sequence at a time: input_ids must be [1, L], "
                         f"got {list(input_ids.shape)}")
    attention_mask = kwargs.pop("attention_mask", None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model_kwargs.pop("use_cache", None)
    if model_kwargs:
        raise ValueError(f"exitspec's custom_generate does not know the argument(s) {', '.join(sorted(model_kwargs))} "
                         f"(its own: {', '.join(DECODER_OPTIONS)})")
    check_neutral(config, model.generation_config._get_default_generation_params())
    prompt = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]  # padding dropped
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt.numel()
    temperature = float(config.temperature) if config.do_sample else 0.0
    top_k, top_p = (int(config.top_k or 0), float(config.top_p or 1.0)) if config.do_sample else (0, 1.0)
    eos = config.eos_token_id
    stops = () if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    # torch.manual_seed decides
    seed = options["seed"] if options["seed"] is not None else int(torch.randint(2**62, ()))

    decoder = _decoder(model, tokenizer, options)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    on_round = None if streamer is None else (
        lambda trace: streamer.put(torch.tensor(trace.verdict.output_tokens(trace.tree)[: trace.emitted])))
    result = decoder.generate(prompt, max(int(max_new), 0), temperature, top_p, top_k, options["budget"],
                              options["verifier"], seed, stop_tokens=stops, chat=False, on_round=on_round)
    if streamer is not None:
        streamer.end()
    new = torch.tensor([result.tokens], dtype=input_ids.dtype, device=input_ids.device)  # [1, n]
    sequences = torch.cat([input_ids, new], dim=1)  # [1, L + n]
    if not config.return_dict_in_generate:
        return sequences
    return ExitspecGenerateOutput(sequences=sequences, tau=result.tau, mean_coverage=result.mean_coverage,
                                  tree_sizes=[r.tree_size for r in result.rounds],
                                  accepted_lengths=[r.accepted for r in result.rounds],
                                  tokens_per_second=result.tokens_per_second)


def check_neutral(config, defaults: dict) -> None:
    """ValueError naming the first generation-config field outside HONOURED that is set to anything but its neutral
    value (None, False, or transformers' global default): exitspec would otherwise ignore it silently."""
    for name, value in sorted(config.to_dict().items()):
        if name in HONOURED or name in METADATA or value is None or value is False:
            continue
        if name in defaults and value == defaults[name]:
            continue
        raise ValueError(f"exitspec's custom_generate does not support generation_config.{name}={value!r} "
                         f"(it honours {', '.join(sorted(HONOURED))})")


def _decoder(model, tokenizer, options: dict):
    """The model's decoder for these options, made on first use and kept on the model (its weights in place)."""
    key = (options["drafter"], str(options["lookup"]), options["warm_start"], options["learn"],
           options["weight_copies"])
    decoders = model.__dict__.setdefault("_exitspec_decoders", {})
    if key not in decoders:
        decoders[key] = SpeculativeDecoder.from_model(
            model, tokenizer, options["drafter"], options["lookup"], warm_start=options["warm_start"],
            learn=options["learn"], weight_copies=options["weight_copies"])
    return decoders[key]
