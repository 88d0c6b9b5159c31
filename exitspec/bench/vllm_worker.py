"""vLLM as a peer baseline, run in vLLM's own environment: reads one JSON request on stdin, writes one JSON
result on stdout. It imports nothing of exitspec (vLLM's CPU build lives in its own venv, see
`exitspec.bench.peers`).

    request  {"model": DIR, "dtype": "float32", "speculative": null | {"method": "ngram", ...},
              "prompts": [[ids...], ...], "max_new_tokens": 128, "temperature": 0.0, "seed": 0, "stop": [ids]}
    result   RESULT_PREFIX + {"runs": [{"tokens": [...], "seconds": s}, ...], "vllm": version, "load_seconds": s}
             on the last line (vLLM logs to stdout too)

One request at a time, as a user decoding one chat would: each prompt is timed alone, after one untimed
warm-up request, from the prompt's token ids to its last new token.
"""

import json
import sys
import time

RESULT_PREFIX = "exitspec-vllm-result: "


def main() -> None:
    request = json.load(sys.stdin)
    import vllm  # here, so that a bad request fails before the engine loads

    start = time.perf_counter()
    llm = vllm.LLM(
        model=request["model"], dtype=request["dtype"], seed=request["seed"], max_model_len=2048,
        speculative_config=request.get("speculative"), enable_prefix_caching=False,
        gpu_memory_utilization=request.get("memory_fraction", 0.3),  # on CPU: the share of RAM it may take
    )
    load_seconds = time.perf_counter() - start
    params = vllm.SamplingParams(
        temperature=request["temperature"], max_tokens=request["max_new_tokens"], seed=request["seed"],
        stop_token_ids=request["stop"], ignore_eos=False,
    )
    prompts = [vllm.TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: one-time costs stay untimed
    runs = []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        runs.append({"tokens": list(out.token_ids), "seconds": time.perf_counter() - start})
    result = {"runs": runs, "vllm": vllm.__version__, "load_seconds": load_seconds}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
