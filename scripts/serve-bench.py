"""What the server adds to a request, measured against the decoding it wraps, with the `openai` client.

    python scripts/serve-bench.py OUT.jsonl [--prompts data/prompts/everyday-chat.jsonl] [-- serve options...]

Starts `exitspec serve` (the default model unless the serve options name one) on a free loopback port. Then, for
each prompt, it sends one streamed request (timing the first text) and one whole one, greedy, 128 tokens, in
that order. Each request's overhead is the client's wall time over the decode seconds that the server measured
inside `generate` (usage.exitspec.decode_seconds, prefill included). The streamed request's first-text ratio
is its time to the first text over that request's own prefill. Writes one JSON object per request and prints
the per-prompt table and the medians. The two answers must be equal, and both are checked.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai


def main() -> int:
    argv = sys.argv[1:]
    serve_options = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--prompts", default="data/prompts/everyday-chat.jsonl")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["exitspec", "serve", "--port", str(port), *serve_options], stdout=subprocess.PIPE,
                              text=True)
    try:
        for line in server.stdout:
            print(line, end="", file=sys.stderr)
            if line.startswith("exitspec serve:"):
                break
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = api.models.list().data[0].id
        rows = [row for prompt in prompts for row in measure(api, model, prompt, args.max_tokens)]
    finally:
        server.terminate()
        server.wait(60)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    report(rows)
    return 0


def measure(api: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> list[dict]:
    """One streamed request, then one whole request, of `prompt`."""
    messages = [{"role": "user", "content": prompt}]
    started = time.perf_counter()
    first, parts, usage = None, [], None
    for chunk in api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                             stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    streamed = row(prompt, "stream", time.perf_counter() - started, usage, "".join(parts))
    streamed["first_text_seconds"] = first - started
    streamed["first_text_over_prefill"] = streamed["first_text_seconds"] / streamed["prefill_seconds"]
    streamed["server_first_text_seconds"] = usage.model_extra["exitspec"]["first_text_seconds"]
    streamed["server_first_text_over_prefill"] = streamed["server_first_text_seconds"] / streamed["prefill_seconds"]
    started = time.perf_counter()
    answer = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    whole = row(prompt, "whole", time.perf_counter() - started, answer.usage, answer.choices[0].message.content)
    assert whole["text"] == streamed["text"], f"streamed and whole answers differ for {prompt!r}"
    return [streamed, whole]


def row(prompt: str, mode: str, wall: float, usage, text: str) -> dict:
    stats = usage.model_extra["exitspec"]
    return {"prompt": prompt, "mode": mode, "wall_seconds": wall, "decode_seconds": stats["decode_seconds"],
            "prefill_seconds": stats["prefill_seconds"], "overhead": wall / stats["decode_seconds"] - 1,
            "tokens": usage.completion_tokens, "tau": stats["tau"], "text": text}


def report(rows: list[dict]) -> None:
    print("| prompt | mode | tokens | τ | decode s | client s | overhead | first text / prefill, client (server) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['first_text_over_prefill']:.2f}× ({r['server_first_text_over_prefill']:.2f}×): " \
                f"{r['first_text_seconds'] * 1e3:.0f} ({r['server_first_text_seconds'] * 1e3:.0f}) / " \
                f"{r['prefill_seconds'] * 1e3:.0f} ms" if r["mode"] == "stream" else ""
        print(f"| {r['prompt'][:40]} | {r['mode']} | {r['tokens']} | {r['tau']:.2f} | {r['decode_seconds']:.3f} | "
              f"{r['wall_seconds']:.3f} | {100 * r['overhead']:.1f}% | {ratio} |")
    for mode in ("stream", "whole"):
        over = [r["overhead"] for r in rows if r["mode"] == mode]
        print(f"{mode}: median overhead {100 * statistics.median(over):.1f}% (range {100 * min(over):.1f}% to "
              f"{100 * max(over):.1f}%) over {len(over)} requests")
    for side in ("", "server_"):
        first = [r[f"{side}first_text_over_prefill"] for r in rows if r["mode"] == "stream"]
        print(f"first text / prefill, {side.rstrip('_') or 'client'} clock: median {statistics.median(first):.2f}× "
              f"(range {min(first):.2f}× to {max(first):.2f}×)")


if __name__ == "__main__":
    sys.exit(main())
