"""Resident memory of a decoder over a model the user loaded (issue 39): RSS after loading the default model with
transformers, then after `SpeculativeDecoder.from_model` (calibrated, one 128-token answer), then after
`model.generate(custom_generate=...)`, in one process; and for comparison a second process that lets the row
plan lay the weights out again (`weight_copies=True`).

    python memory.py            # from_model as shipped: the model's weights in place
    python memory.py --copies   # weight_copies=True
"""

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
rss = lambda: psutil.Process().memory_info().rss / 2**20  # MiB
record = {"copies": copies, "rss_start_mib": rss()}
folder = default_model_dir()
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Give me three tips for sleeping better."}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)
model.generate(**ids, max_new_tokens=16, do_sample=False)
record["weights_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
record["rss_model_loaded_mib"] = rss()
decoder = SpeculativeDecoder.from_model(model, tokenizer, weight_copies=copies, warm_start=False)
out = decoder.generate(ids["input_ids"][0], 128, budget="auto")
record["rss_after_from_model_mib"] = rss()
record["row_plan_layouts"] = sorted({layout for _, layout in decoder.target.row_plan.values()})
record["tau"] = out.tau
hf = model.generate(**ids, max_new_tokens=128, do_sample=False, custom_generate=exitspec.hf.CUSTOM_GENERATE,
                    trust_remote_code=True, warm_start=False, weight_copies=copies)
record["rss_after_custom_generate_mib"] = rss()
record["custom_generate_equals_from_model"] = hf[0, ids["input_ids"].shape[1]:].tolist() == out.tokens
record["added_over_loaded_model"] = record["rss_after_custom_generate_mib"] / record["rss_model_loaded_mib"] - 1
print(json.dumps(record, indent=1))
