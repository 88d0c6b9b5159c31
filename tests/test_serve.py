"""`exitspec serve` with real clients: the `openai` package and raw HTTP against a server on loopback, on a tiny
model. Answers equal the decoder's own (and `exitspec generate`'s, across processes), streamed or not; 50
requests from 8 clients come back whole and equal to their sequential runs; a client that leaves frees the
target; bad bodies get one-line OpenAI-style errors."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
import uvicorn
from tiny_models import save_tiny_llama, save_word_tokenizer

from exitspec.decode import SpeculativeDecoder
from exitspec.serve import StopStrings, create_app

PROMPTS = [f"w{i} w{i + 3} w{i + 1} w{i + 3} w{i + 1}" for i in range(4, 14)]


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "tiny"
    save_tiny_llama(path, seed=3)
    save_word_tokenizer(path)
    return path


def decoder_of(folder) -> SpeculativeDecoder:
    return SpeculativeDecoder.from_pretrained(folder, "ngram", device="cpu", dtype="float32", warm_start=False)


@contextmanager
def serving(decoder, **options):
    """The app on a free loopback port, in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(create_app(decoder, "tiny", **{"budget": 4, **options}), host="127.0.0.1",
                                           port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def post(url: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, object]:
    """(status, JSON body, headers: case-insensitive) of a raw POST."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def expected(decoder, prompt, chat: bool = True, **settings) -> str:
    messages = [{"role": "user", "content": prompt}] if chat else prompt
    return decoder.generate(messages, chat=chat, budget=4, **settings).text


def test_chat_and_text_completions_equal_the_decoders_output_streamed_or_not(folder):
    reference = decoder_of(folder)
    chat = expected(reference, PROMPTS[0], temperature=0, max_new_tokens=20)
    text = expected(reference, PROMPTS[1], chat=False, temperature=0, max_new_tokens=20)
    with serving(decoder_of(folder)) as url:
        api = client(url)
        answer = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                             temperature=0, max_tokens=20)
        assert answer.choices[0].message.content == chat
        assert answer.usage.completion_tokens <= 20 and answer.usage.prompt_tokens > 0
        assert answer.usage.model_extra["exitspec"]["tau"] >= 1.0
        assert answer.choices[0].finish_reason in ("stop", "length")
        chunks = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                  temperature=0, max_tokens=20, stream=True,
                                                  stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == answer.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
        completion = api.completions.create(model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=20)
        assert completion.choices[0].text == text
        streamed = api.completions.create(model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=20, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == text
        assert [m.id for m in api.models.list()] == ["tiny"]


def test_sampled_requests_equal_the_decoder_run_from_the_same_state(folder):
    reference = decoder_of(folder)  # the same requests, in the same order, from a decoder in the same state
    want = [expected(reference, p, temperature=1.0, top_k=20, seed=s, max_new_tokens=16)
            for s, p in enumerate(PROMPTS[:3])]
    with serving(decoder_of(folder)) as url:
        got = [_sampled(url, p, s) for s, p in enumerate(PROMPTS[:3])]
    assert got == want


def _sampled(url: str, prompt: str, seed: int) -> str:
    status, body, _ = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                         "temperature": 1.0, "top_k": 20, "seed": seed,
                                                         "max_tokens": 16})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_fifty_requests_from_eight_clients_come_back_whole_and_equal_to_sequential_runs(folder):
    reference = decoder_of(folder)
    want = {p: expected(reference, p, temperature=0, max_new_tokens=16) for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(50)]
    with serving(decoder_of(folder), max_queue=8) as url:
        api = client(url)

        def ask(i_prompt):
            i, prompt = i_prompt
            messages = [{"role": "user", "content": prompt}]
            if i % 2:
                chunks = api.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16,
                                                     stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks)
            answer = api.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16)
            return answer.choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, enumerate(prompts)))
        metrics = _metrics(url)
    assert sum(a == want[p] for a, p in zip(got, prompts)) == 50
    assert metrics['exitspec_requests_total{endpoint="/v1/chat/completions",outcome="ok"}'] == 50
    assert metrics["exitspec_queue_depth"] == 0


def _metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as response:
        lines = response.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def slowed(decoder: SpeculativeDecoder, seconds_per_piece: float, results: list):
    """Each streamed text piece of the decoder takes `seconds_per_piece` longer; its results go to `results`."""
    generate = decoder.generate

    def slow_generate(prompt, stream=None, **settings):
        def sink(text):
            time.sleep(seconds_per_piece)
            stream(text)

        results.append(generate(prompt, stream=sink, **settings))
        return results[-1]

    decoder.generate = slow_generate


def test_a_client_that_leaves_mid_stream_frees_the_target_after_a_round(folder):
    decoder, results = decoder_of(folder), []
    slowed(decoder, 0.05, results)
    with serving(decoder) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}], "stream": True, "max_tokens": 100,
                           "temperature": 1.0, "seed": 1}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            received = b""
            while received.count(b"data: ") < 3:  # the role chunk and two pieces of text
                received += s.recv(4096)
        deadline = time.time() + 20
        while not results and time.time() < deadline:
            time.sleep(0.05)
        assert results and results[0].stopped_by == "cancelled" and len(results[0].tokens) < 100
        answer = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}],
                                                     temperature=0, max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert _metrics(url)['exitspec_requests_total{endpoint="/v1/chat/completions",outcome="client_left"}'] == 1


def test_a_full_queue_answers_503_with_retry_after(folder):
    decoder, results = decoder_of(folder), []
    slowed(decoder, 0.1, results)
    with serving(decoder, max_queue=1) as url:
        slow = threading.Thread(target=post, args=(url, "/v1/completions", {"prompt": "w4 w5", "max_tokens": 30,
                                                                             "temperature": 0}))
        slow.start()
        while not _metrics(url)["exitspec_queue_depth"]:
            time.sleep(0.01)
        status, body, headers = post(url, "/v1/completions", {"prompt": "w4", "max_tokens": 2})
        slow.join()
    assert status == 503 and body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1


def test_stop_strings_cut_the_text_before_them_and_across_pieces():
    stop = StopStrings(["w7 w8", "END"])
    assert [stop.feed(t) for t in ["w1 w", "7 w", "8 w9"]] == ["w1 ", "", ""] and stop.hit
    stop = StopStrings(["EN"])
    assert stop.feed("abcE") == "abc" and stop.feed("x") == "Ex" and stop.flush() == "" and not stop.hit


def test_a_stop_string_ends_the_answer_before_it(folder):
    reference = decoder_of(folder)
    words = expected(reference, PROMPTS[2], temperature=0, max_new_tokens=20).split(" ")
    assert len(words) > 4
    cut = " ".join(words[2:4])
    with serving(decoder_of(folder)) as url:
        answer = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}],
                                                     temperature=0, max_tokens=20, stop=[cut])
    full = " ".join(words)
    assert answer.choices[0].message.content == full[: full.index(cut)]
    assert answer.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "n": 2}', "n"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "logit_bias": {"3": 5}}', "logit_bias"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "presence_penalty": 0.5}', "presence_penalty"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "logprobs": true}', "logprobs"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "temperature": -1}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "max_tokens": 1000}', "messages"),
        (b'{"messages": [{"role": "user", "content": "w4"}], "stop": ["a", "b", "c", "d", "e"]}', "stop"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}', "messages"),
    ],
)
def test_bad_bodies_get_one_line_openai_errors(folder, body, param):
    with serving(decoder_of(folder)) as url:
        status, answer, _ = post(url, "/v1/chat/completions", body)
        assert post(url, "/v1/completions", {"prompt": "w4 w5", "max_tokens": 2})[0] == 200  # the server goes on
    error = answer["error"]
    assert status == 400 and error["param"] == param and "\n" not in error["message"] and error["message"]


def test_an_api_key_guards_v1_and_metrics_but_not_health(folder):
    with serving(decoder_of(folder), api_key="sesame") as url:
        status, body, _ = post(url, "/v1/completions", {"prompt": "w4", "max_tokens": 2})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        authorized = {"Authorization": "Bearer sesame"}
        assert post(url, "/v1/completions", {"prompt": "w4", "max_tokens": 2}, authorized)[0] == 200
        import urllib.request

        with urllib.request.urlopen(url + "/health") as response:
            assert json.loads(response.read())["status"] == "ok"


def test_the_serve_command_answers_as_the_generate_command_does(folder):
    """Two processes: `exitspec generate --json` and `exitspec serve`, each fresh, the same seed, greedy and
    sampled (the server's first sampled request, from the same learned state as a fresh generate)."""
    common = ["--model", str(folder), "--dtype", "float32", "--threads", "1", "--no-warm-start", "--budget", "4"]
    env = dict(os.environ, EXITSPEC_CACHE=str(folder.parent / "cache"))
    want = []
    for temperature in ("0", "1"):
        out = subprocess.run([sys.executable, "-m", "exitspec", "generate", PROMPTS[3], "--json", "--seed", "5",
                              "--temperature", temperature, "--max-new-tokens", "16", *common],
                             capture_output=True, text=True, env=env, check=True)
        want.append(json.loads(out.stdout)["text"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "exitspec", "serve", "--port", str(port), *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:  # the load's progress lines, then the address
            if line.startswith("exitspec serve: tiny"):
                break
        api = client(f"http://127.0.0.1:{port}")
        got = [api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], seed=5,
                                           temperature=float(t), max_tokens=16).choices[0].message.content
               for t in ("1", "0")]
    finally:
        server.terminate()
        assert server.wait(30) in (0, -signal.SIGTERM)  # uvicorn shuts down, then re-raises the signal
    assert got[::-1] == want
