"""The validation split of issue 19's λ sweep: 40 prompts each from the tails of GSM8K train, the ShareGPT first
turns and the stdlib code prompts, which the online training stream (`run.sh`: the first 7000 GSM8K train
questions, the first 7000 ShareGPT first turns of at most 512 tokens, the first 2500 code prompts) never reaches.
No benchmark set is used. Writes validation/{gsm8k-train,sharegpt,code}.jsonl, one {"id", "prompt"} a line,
for `exitspec train eval --datasets FILE ...`.

    python data/exittrain-runs/smollm2-135m-instruct-v2/make-validation.py
"""

import json
from pathlib import Path

from exitspec.data import gsm8k_train, python_functions, sharegpt

OUT = Path(__file__).parent / "validation"
N = 40


def write(name: str, prompts) -> None:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": p.id.split("/", 1)[-1], "prompt": p.text}) + "\n" for p in prompts))
    print(f"{path}: {len(prompts)} prompts, {prompts[0].id} .. {prompts[-1].id}")


write("gsm8k-train", gsm8k_train()[-N:])  # questions 7433-7472 of 7473
write("sharegpt", list(sharegpt())[17000 : 17000 + N])  # of 17382 first turns; the stream stops before 7000 fit
write("code", list(python_functions())[-N:])  # 2586-2625 of 2626; the stream takes the first 2500
