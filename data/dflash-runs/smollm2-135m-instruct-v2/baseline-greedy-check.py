import json, torch
torch.set_num_threads(1)
from exitspec.models import load_model_and_tokenizer, model_name
from exitspec.drafters.dflash_model import DFlashModel
from exitspec.train.dflash_loss import DFlashObjective
from exitspec.train.heldout import HELDOUT_TOKENS, GreedyCheck, make_heldout
from exitspec.train.config import BENCHMARKS
target, tok = load_model_and_tokenizer(None, "cpu", torch.float32)
heldout = make_heldout(target, tok, model_name(None), BENCHMARKS, "runs/heldout", 20, HELDOUT_TOKENS, progress=False)
out = {}
for name, folder in (("dflash (shipped)", "exitspec/assets/dflash-v1-smollm2-135m-instruct"), ("dflash-shipped-v16k", "runs/dflash-shipped-v16k")):
    d = DFlashModel.from_pretrained(folder, dtype=torch.float32)
    check = GreedyCheck(target, heldout, d.config.target_layer_ids, seed=0)
    obj = DFlashObjective(d, target.get_input_embeddings(), target.get_output_embeddings())
    out[name] = check(obj)
    print(name, json.dumps(out[name]))
json.dump(out, open("/tmp/baseline_check.json", "w"), indent=1)
