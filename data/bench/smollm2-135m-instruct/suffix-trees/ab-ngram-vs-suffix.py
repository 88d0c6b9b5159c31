"""Training-free drafters side by side on the same prompts: 'ngram' (prompt lookup) vs 'suffix' (suffix trees)."""
import sys, json
sys.path.insert(0, "/work/main")
import exitspec
exitspec.setup_cpu()
from exitspec.decode import SpeculativeDecoder
from exitspec.data import load_dataset
spec, n = sys.argv[1], int(sys.argv[2])
dec = SpeculativeDecoder.from_pretrained(drafter=spec, threads=2, warm_start=False, learn=False)
prompts = []
for ds in ("mtbench", "humaneval", "gsm8k", "math500", "humaneval-edit", "gsm8k-rewrite"):
    _, samples = load_dataset(ds)
    prompts += [(ds, s.prompt(0)) for s in samples[:n]]
res = {}
for ds, chat in prompts:
    r = dec.generate(chat, max_new_tokens=128, temperature=0.0, budget="auto")
    res.setdefault(ds, []).append((r.tau, r.tokens_per_second))
out = {ds: [round(sum(v[i] for v in vals) / len(vals), 3) for i in range(2)] for ds, vals in res.items()}
allv = [v for vals in res.values() for v in vals]
print(spec, json.dumps(out), "mean tau %.3f tok/s %.1f" % (sum(v[0] for v in allv) / len(allv), sum(v[1] for v in allv) / len(allv)))
