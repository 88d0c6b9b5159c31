"""Tiny random-weight models for fast, exact tests (no downloads), and a word-level tokenizer for them."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast


def tiny_llama(vocab_size: int = 32, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 32, 4 heads, 2 kv heads, context 128) with seeded random weights, fp32, sdpa, eval.

    The init scale is larger than HF's default so that attention is far from uniform and logits are spread:
    a wrong mask, position or cache entry then shows up well above float error.
    """
    return tiny_causal_lm(LlamaConfig, vocab_size, seed, **overrides)


def tiny_causal_lm(config_cls=LlamaConfig, vocab_size: int = 32, seed: int = 0, **overrides) -> PreTrainedModel:
    """tiny_llama's shape for any Llama-family config class (Qwen2Config, Qwen3Config, ...)."""
    config = config_cls(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "initializer_range": 0.2,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": None,
            **overrides,
        }
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval().requires_grad_(False)


def save_tiny_llama(path: str | Path, vocab_size: int = 32, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Writes tiny_llama(...) to `path` as a local HF folder (config + safetensors) and returns the model."""
    model = tiny_llama(vocab_size, seed, **overrides)
    model.save_pretrained(path)
    return model


def save_word_tokenizer(folder) -> None:
    """A whitespace word-level tokenizer over the tiny model's 32 ids, with a chat template."""
    words = ["<unk>", "</s>", "<user>", "<assistant>"] + [f"w{i}" for i in range(28)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}<user> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    tok.save_pretrained(folder)
