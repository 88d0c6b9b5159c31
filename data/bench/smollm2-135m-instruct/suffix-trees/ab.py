"""One decoder's τ and tok/s on the first N prompts of some sets: T = 0, 128 new tokens, `--budget auto`, warm
start and learning off, 2 threads. Run one arm after another on an idle machine and compare their lines.

    python ab.py REPO N DRAFTER SET [SET ...]

REPO: the repository to import (a worktree of an older commit works: `learn` is passed only where it exists);
DRAFTER: a drafter spec ('dflash' for the default model's, 'ngram', 'suffix'); SET: a dataset name.
"""
import json
import sys

repo, n, spec, sets = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
sys.path.insert(0, repo)
import exitspec
from exitspec.data import load_dataset
from exitspec.decode import SpeculativeDecoder

exitspec.setup_cpu()
options = {"drafter": spec, "threads": 2, "warm_start": False}
if "learn" in SpeculativeDecoder.from_pretrained.__code__.co_varnames:
    options["learn"] = False
decoder = SpeculativeDecoder.from_pretrained(**options)
results = {}
for name in sets:
    for sample in load_dataset(name)[1][:n]:
        r = decoder.generate(sample.prompt(0), max_new_tokens=128, temperature=0.0, budget="auto")
        results.setdefault(name, []).append((r.tau, r.tokens_per_second))
means = {name: [round(sum(v[i] for v in runs) / len(runs), 3) for i in range(2)] for name, runs in results.items()}
every = [v for runs in results.values() for v in runs]
tau, rate = (sum(v[i] for v in every) / len(every) for i in range(2))
print(exitspec.__file__, spec, json.dumps(means), f"mean tau {tau:.3f} tok/s {rate:.1f}")
