"""Resident memory of a decoder over a model the user loaded (issue 39): RSS after loading the default model with
transformers, then after `SpeculativeDecoder.from_model` (calibrated, one 128-token answer), then after
`model.generate(custom_generate=...)` (its own decoder, kept on the model), in one process; and for comparison
a process that lets the row plan lay the weights out again (`weight_copies=True`). RSS is read after
glibc's malloc_trim, so that heap pages freed by the cost measurement's temporaries do not count as held.

    python memory.py [--drafter SPEC]            # from_model as shipped: the model's weights in place
    python memory.py --copies [--drafter SPEC]   # weight_copies=True
"""

import ctypes
import json
import sys

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import exitspec
import exitspec.hf
from exitspec.decode import SpeculativeDecoder
from exitspec.models import default_model_dir

exitspec.setup_cpu()
torch.set_num_threads(2)
copies = "--copies" in sys.argv
drafter = sys.argv[sys.argv.index("--drafter") + 1] if "--drafter" in sys.argv else None
libc = ctypes.CDLL("libc.so.6")


def rss() -> float:
    """MiB resident (anonymous + file-backed), after handing freed heap pages back to the system."""
    libc.malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20


record = {"copies": copies, "drafter": drafter or "default (dflash)", "rss_start_mib": rss()}
folder = default_model_dir()
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Give me three tips for sleeping better."}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)
model.generate(**ids, max_new_tokens=16, do_sample=False)
record["weights_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
record["rss_model_loaded_mib"] = rss()
decoder = SpeculativeDecoder.from_model(model, tokenizer, drafter, weight_copies=copies, warm_start=False)
out = decoder.generate(ids["input_ids"][0], 128, budget="auto")
record["rss_after_from_model_mib"] = rss()
record["row_plan_layouts"] = sorted({layout for _, layout in decoder.target.row_plan.values()})
record["tau"] = out.tau
hf = model.generate(**ids, max_new_tokens=128, do_sample=False, custom_generate=exitspec.hf.CUSTOM_GENERATE,
                    trust_remote_code=True, warm_start=False, weight_copies=copies, drafter=drafter)
record["rss_after_custom_generate_mib"] = rss()
record["custom_generate_equals_from_model"] = hf[0, ids["input_ids"].shape[1]:].tolist() == out.tokens
record["from_model_added"] = record["rss_after_from_model_mib"] / record["rss_model_loaded_mib"] - 1
print(json.dumps(record, indent=1))
