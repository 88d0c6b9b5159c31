"""A/B of DFlash's copy source: run with the repository to import (old: prompt lookup; new: suffix trees)."""
import sys, json
repo, n = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, repo)
import torch, exitspec
exitspec.setup_cpu()
from exitspec.decode import SpeculativeDecoder
from exitspec.data import load_dataset
kw = dict(threads=2, warm_start=False)
if "learn" in SpeculativeDecoder.from_pretrained.__code__.co_varnames:
    kw["learn"] = False
dec = SpeculativeDecoder.from_pretrained(**kw)
prompts = []
for ds in ("mtbench", "humaneval", "gsm8k", "math500"):
    _, samples = load_dataset(ds)
    prompts += [(ds, s.prompt(0)) for s in samples[:n]]
res = {}
for ds, chat in prompts:
    r = dec.generate(chat, max_new_tokens=128, temperature=0.0, budget="auto")
    res.setdefault(ds, []).append((r.tau, r.tokens_per_second))
out = {ds: [round(sum(v[i] for v in vals) / len(vals), 3) for i in range(2)] for ds, vals in res.items()}
allv = [v for vals in res.values() for v in vals]
print(exitspec.__file__, json.dumps(out), "mean tau %.3f tok/s %.1f" % (sum(v[0] for v in allv) / len(allv), sum(v[1] for v in allv) / len(allv)))
