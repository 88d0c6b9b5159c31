"""llama.cpp as a peer (exitspec/bench/llamacpp.py): the request and the checks of its answer, a server process
and its protocol through a stand-in llama-server (a Python HTTP server answering as llama-server does), the bench
rows interleaved prompt by prompt, and, where scripts/llamacpp.sh has built it, the real llama-server."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_llama

from exitspec.app import load_decoders
from exitspec.bench import llamacpp
from exitspec.bench.llamacpp import LlamaServer, read_completion, request_body, variant_files
from exitspec.bench.peers import llamacpp_peers
from exitspec.bench.presets import LLAMACPP_FILES, LLAMACPP_VARIANTS
from exitspec.bench.runner import BASELINE_KEY, WARMUP_TOKENS, Config, Plan, ResultsFile, Runner, run_plan
from exitspec.cli import main
from exitspec.data import load_dataset
from exitspec.models import cache_dir

PROMPTS = [[2, 5, 3, 7, 2, 5, 3, 7, 4], [6, 2, 5, 3, 6, 2, 5]]
MAX_NEW = 12
FRANCE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
          198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # "What is the capital
# of France?" through the default model's chat template
BUILT = (cache_dir() / "llama.cpp" / llamacpp.VERSION / "bin" / "llama-server").is_file()
STAND_IN = f"""#!{sys.executable}
# answers as llama-server does: /health, /props, /completion (the prompt's first tokens back); logs each request
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
log = open(sys.argv[0] + ".log", "a")
log.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
log.flush()

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, yet it drops each connection unannounced, as an idle one is

    def log_message(self, *args):
        pass

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def do_GET(self):
        self.answer({{"status": "ok"}} if self.path == "/health" else {{"build_info": "b0-stand-in"}})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({{"request": request}}) + "\\n")
        log.flush()
        prompt = request["prompt"]
        self.answer({{"tokens": prompt[: min(3, request["n_predict"])], "tokens_evaluated": len(prompt),
                      "timings": {{"prompt_n": len(prompt)}}, "stop_type": "limit"}})

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """A stand-in llama-server and GGUF files where scripts/llamacpp.sh puts the real ones; the log it writes."""
    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path / "cache"))
    root = llamacpp.install_dir()
    (root / "bin").mkdir(parents=True)
    server = root / "bin" / "llama-server"
    server.write_text(STAND_IN)
    server.chmod(0o755)
    for file in LLAMACPP_FILES:
        (root / f"{llamacpp.MODEL_STEM}.{file.upper()}.gguf").write_bytes(b"")
    return root / "bin" / "llama-server.log"


def logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_build_script_builds_the_version_the_module_runs():
    script = (Path(__file__).resolve().parents[1] / "scripts" / "llamacpp.sh").read_text()
    assert re.search(r"^VERSION=(\S+)$", script, re.MULTILINE).group(1) == llamacpp.VERSION


def test_every_variant_names_a_file_and_a_speculation_the_module_knows():
    assert {v.partition("-")[2] for v in LLAMACPP_VARIANTS} == {"", *llamacpp.SPECULATION}


def test_a_request_sends_token_ids_uncached_with_exitspecs_sampler_order():
    body = request_body([5, 6, 7], max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=3)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 32 and body["seed"] == 3
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["ignore_eos"] is False
    assert body["samplers"] == ["temperature", "top_k", "top_p"]  # exitspec's and transformers' order
    assert (body["temperature"], body["top_k"], body["top_p"]) == (0.7, 40, 0.9)


def test_an_answer_must_have_evaluated_exactly_the_prompt_sent_and_stopped_at_a_stop_token():
    ok = {"tokens": [9, 4, 2], "tokens_evaluated": 3, "timings": {"prompt_n": 3}, "stop_type": "eos"}
    run = read_completion(ok, [5, 6, 7], {2}, 0.25)
    assert run.tokens == [9, 4, 2] and run.seconds == 0.25 and run.stop_type == "eos"
    with pytest.raises(RuntimeError, match="took 4 prompt tokens"):  # a BOS added, say
        read_completion({**ok, "tokens_evaluated": 4}, [5, 6, 7], {2}, 0.25)
    with pytest.raises(RuntimeError, match="processed 1 of the 3 sent"):  # a prompt cache reused
        read_completion({**ok, "timings": {"prompt_n": 1}}, [5, 6, 7], {2}, 0.25)
    with pytest.raises(RuntimeError, match="decoded past stop token 4"):
        read_completion(ok, [5, 6, 7], {4}, 0.25)


def test_unknown_variants_and_a_missing_build_get_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EXITSPEC_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="unknown llama.cpp variant 'q4_2'"):
        variant_files("q4_2")
    with pytest.raises(FileNotFoundError, match="run: bash scripts/llamacpp.sh"):
        variant_files("q4_1")
    assert main(["generate", "Hi", "--llamacpp", "q8_0"]) == 2
    assert "give --compare too" in capsys.readouterr().err
    assert main(["generate", "Hi", "--llamacpp", "q4_2"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path), "--peers", "llamacpp-q4_1"]) == 2
    assert "default model's GGUF files" in capsys.readouterr().err


def test_a_server_starts_with_its_options_and_answers_what_it_was_asked(stand_in):
    with LlamaServer("bf16-ngram", threads=2) as server:
        server.complete([4, 5, 6, 7], {0}, max_new_tokens=2)
        run = server.complete([4, 5, 6, 7], {0}, max_new_tokens=2)  # after the server dropped the connection
        assert server.version == f"llama.cpp b0-stand-in (llama-cpp-python {llamacpp.VERSION})"
    assert run.tokens == [4, 5] and run.seconds > 0
    argv = logged(stand_in)[0]["argv"]
    assert argv[argv.index("-m") + 1].endswith("SmolLM2-135M-Instruct.BF16.gguf")
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("--cache-ram") + 1] == "0"
    assert " ".join(llamacpp.SPECULATION["ngram"]) in " ".join(argv)
    assert server._process.poll() is not None  # closed with the context


def test_llamacpp_rows_follow_each_prompts_exitspec_rows(stand_in, tmp_path):
    """The llama.cpp peers run on each prompt right after exitspec's rows of it, each server warmed once by a
    short request; a rerun measures nothing again."""
    save_tiny_llama(tmp_path / "model", vocab_size=32, seed=0)
    prompts = tmp_path / "toy.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    name, samples = load_dataset(str(prompts))
    plan = Plan({name: samples}, [Config("ngram", 8, "tev")], [0.0], max_new_tokens=MAX_NEW)
    runner = Runner(load_decoders(tmp_path / "model", ["ngram"], budgets=[8]))
    results = ResultsFile(tmp_path / "results.jsonl")
    peers = ["llamacpp-q4_1", "llamacpp-q8_0-ngram"]
    with llamacpp_peers(["hf-lookup", *peers], runner, results) as after_turn:
        assert run_plan(plan, runner, results, progress=False, after_turn=after_turn) == 8
    order = [(row["kind"], row["prompt_id"], row.get("peer")) for row in map(json.loads, results.path.open())]
    assert order == [("baseline", "0", None), ("spec", "0", None), ("peer", "0", peers[0]), ("peer", "0", peers[1]),
                     ("baseline", "1", None), ("spec", "1", None), ("peer", "1", peers[0]), ("peer", "1", peers[1])]
    requests = [entry["request"] for entry in logged(stand_in) if "request" in entry]
    assert [(r["prompt"], r["n_predict"]) for r in requests] == [
        (PROMPTS[0], WARMUP_TOKENS), (PROMPTS[0], MAX_NEW), (PROMPTS[0], WARMUP_TOKENS), (PROMPTS[0], MAX_NEW),
        (PROMPTS[1], MAX_NEW), (PROMPTS[1], MAX_NEW)]
    for row in results.rows:
        if row.kind == "peer":
            base = results.get({"kind": "baseline", **{k: getattr(row, k) for k in BASELINE_KEY}})
            assert row.tokens == PROMPTS[int(row.prompt_id)][:3] and row.prompt_sha == base.prompt_sha
            assert row.version_info.startswith("llama.cpp b0-stand-in")
    with llamacpp_peers(peers, runner, results) as after_turn:
        assert run_plan(plan, runner, results, progress=False, after_turn=after_turn) == 0


@pytest.mark.skipif(not BUILT, reason="llama.cpp is not built (bash scripts/llamacpp.sh)")
def test_the_real_llama_server_decodes_token_ids_greedily_and_repeatably():
    with LlamaServer("q4_1", threads=1) as server:
        first = server.complete(FRANCE, {2}, max_new_tokens=16)
        again = server.complete(FRANCE, {2}, max_new_tokens=16)
    assert 0 < len(first.tokens) <= 16 and first.tokens == again.tokens
    assert first.stop_type in ("eos", "limit") and (first.stop_type == "limit") == (2 not in first.tokens)


@pytest.mark.slow
@pytest.mark.skipif(not BUILT, reason="llama.cpp is not built (bash scripts/llamacpp.sh)")
def test_llama_cpp_in_bf16_answers_as_exitspecs_autoregressive_loop():
    """The default model's bf16 file in llama.cpp, greedy, gives exitspec's fp32 answer on a prompt whose first token
    leads by 0.08 nats (the Q4_1 and Q8_0 files, with 8-bit activations, flip it: "L'Étoile, ...")."""
    decoder = load_decoders(None, ["ngram"], "cpu", "float32", budgets=())["ngram"]
    ours = decoder.autoregressive(FRANCE, max_new_tokens=16)
    assert decoder.target.tokenizer.decode(ours.tokens) == "The capital of France is Paris.<|im_end|>"
    with LlamaServer("bf16", threads=1) as server:
        assert server.complete(FRANCE, {2}, max_new_tokens=16).tokens == ours.tokens
