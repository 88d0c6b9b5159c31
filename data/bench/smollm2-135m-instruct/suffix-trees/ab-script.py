# the A/B script as it ran (against 9440de6 + drafters/suffix.py; the 'copy' arm no longer exists)
import sys, json, time
sys.path.insert(0, '/work/main')
import torch, exitspec
exitspec.setup_cpu()
from exitspec.decode import SpeculativeDecoder
from exitspec.data import load_dataset
from exitspec.drafters.suffix import SuffixSource, SuffixMemory
arm = sys.argv[1]; n = int(sys.argv[2]); temp = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
dec = SpeculativeDecoder.from_pretrained(threads=2, warm_start=False)
d = dec.drafter
vocab = d.vocab_size
if arm in ("suffix", "both", "suffix+mem", "both+mem"):
    d.suffix = SuffixSource(SuffixMemory(vocab, "x") if arm.endswith("+mem") else None)
if arm in ("suffix", "suffix+mem"):
    d.copy = None
d._identity = None
prompts = []
for ds in ("mtbench", "humaneval", "gsm8k", "math500"):
    _, samples = load_dataset(ds)
    prompts += [(ds, s.prompt(0)) for s in samples[:n]]
prompts.append(("chat", [{"role":"user","content":"Give me three tips for keeping houseplants alive."}]))
res = {}
for ds, chat in prompts:
    r = dec.generate(chat, max_new_tokens=128, temperature=temp, budget="auto")
    if d.suffix is not None: d.suffix.learn(r.tokens)
    res.setdefault(ds, []).append((r.tau, r.tokens_per_second, sum(x.tree_size for x in r.rounds)/len(r.rounds)))
out = {ds: [round(sum(v[i] for v in vals)/len(vals), 3) for i in range(3)] for ds, vals in res.items()}
allv = [v for vals in res.values() for v in vals]
print(arm, temp, json.dumps(out), "mean tau %.3f tok/s %.1f" % (sum(v[0] for v in allv)/len(allv), sum(v[1] for v in allv)/len(allv)))
