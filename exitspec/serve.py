"""`exitspec serve`: an OpenAI-compatible HTTP server over one SpeculativeDecoder, so that every OpenAI client,
editor, agent and router can use exact tree speculative decoding unchanged.

    exitspec serve                                   # the default model on http://127.0.0.1:8000/v1
    curl 127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}'

    request ─ FastAPI: the body checked (pydantic), refused fields named (`refusal`), the prompt encoded here
      ─ Worker.admit: a bounded FIFO (HTTP 503 + Retry-After past --max-queue)
      ─ the decoding thread: SpeculativeDecoder.generate, one request at a time, in arrival order; its text
        increments pass StopStrings and go back to the event loop ─ JSON, or server-sent events (`stream`)

The decoder is loaded, calibrated and warmed once. A request is exact as `exitspec generate` is: its output has
the target's (warped) distribution, at T = 0 exactly the target's greedy text, and the same seed from the same
learned state (a fresh `--no-warm-start` server, first request) gives generate's text. A client that leaves
cancels its request: queued, it is dropped; decoding, the target is free after the round in flight
(`generate(cancel=...)`). Fields that would change the output law (penalties, logit bias, n > 1, logprobs,
min_p, forced formats or tools) are refused with HTTP 400 and one line, as is a prompt that does not fit.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from exitspec.app import check_budgets, load_decoders
from exitspec.decode import GenerationResult, SpeculativeDecoder, encode_prompt
from exitspec.drafters import default_drafter
from exitspec.models import resolve_device
from exitspec.sampling import SamplingParams
from exitspec.settings import DEFAULT_MODEL
from exitspec.verify import check_verifier

__all__ = ["create_app", "run"]

# Fields a client may send that would change the output law, each with the value that leaves it unchanged.
REFUSED: dict[str, Callable[[Any], bool]] = {
    "presence_penalty": lambda v: v not in (None, 0),
    "frequency_penalty": lambda v: v not in (None, 0),
    "repetition_penalty": lambda v: v not in (None, 1),
    "min_p": lambda v: v not in (None, 0),
    "logit_bias": bool,
    "logprobs": bool,
    "top_logprobs": bool,
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "min_tokens": bool,
    "ignore_eos": bool,
    "echo": bool,
    "suffix": bool,
    "tools": bool,
    "functions": bool,
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
}


# ---------------------------------------------------------------------------------------------------------
# Requests: OpenAI's fields; unknown ones are ignored, as vLLM and llama-server ignore them


class ServerError(Exception):
    """An OpenAI-style error: HTTP `status`, one line of `message`, the offending `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 and -1 keep every token
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: dict | None = None

    def refusal(self) -> None:
        """Raises ServerError naming the first field that would change the output law."""
        for name, changes_law in REFUSED.items():
            value = getattr(self, name, None) if name in type(self).model_fields else (self.model_extra or {}).get(name)
            if changes_law(value):
                raise ServerError(400, f"{name}={json.dumps(value)} is not supported: exitspec samples exactly the "
                                  "model's distribution (temperature, top_p, top_k), nothing else", name)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or not all(stops):
            raise ServerError(400, "stop takes at most 4 non-empty strings", "stop")
        return stops


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content as text: a string, or the text parts of a list of content parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ServerError(400, "only text content parts are supported", "messages")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(Sampled):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int]


# ---------------------------------------------------------------------------------------------------------
# Decoding: one thread, one request at a time, in arrival order


class StopStrings:
    """Cuts a growing text before the first of `stops`, holding back a tail that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.hit = stops, "", False

    def feed(self, text: str) -> str:
        """What of the text so far can be released now."""
        if self.hit:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, out, self.pending = True, self.pending[: min(found)], ""
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Finished:
    """The end of a job: its result, why it stopped (OpenAI's finish_reason) and its time in the queue."""

    result: GenerationResult
    finish_reason: str
    queue_seconds: float
    seed: int


@dataclass(eq=False)
class Job:
    """One request on its way through the queue. `items` receives text increments, then a Finished or an error."""

    prompt_ids: list[int]
    settings: dict  # SpeculativeDecoder.generate's keyword arguments
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    left: threading.Event = field(default_factory=threading.Event)  # the client is gone
    admitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the decoding thread took it up (None: never, the client left first)

    def send(self, item) -> None:
        """From the decoding thread to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    def decode(self, decoder: SpeculativeDecoder) -> Finished | Exception | None:
        """Runs on the decoding thread; returns the job's last item (None: the client left while it waited)."""
        if self.left.is_set():
            return None
        self.started = time.perf_counter()
        queued = self.started - self.admitted
        stop, streamed = StopStrings(self.stops), []

        def sink(text: str) -> None:
            streamed.append(text)
            if out := stop.feed(text):
                self.send(out)

        try:
            result = decoder.generate(self.prompt_ids, stream=sink, cancel=lambda: stop.hit or self.left.is_set(),
                                      chat=False, **self.settings)
        except Exception as e:  # noqa: BLE001 - a model error (NaN logits, ...) fails the request, not the server
            return e
        seen = "".join(streamed)
        if not stop.hit and result.text.startswith(seen) and (out := stop.feed(result.text[len(seen) :])):
            self.send(out)  # an unfinished multi-byte tail that the text stream held back
        if out := stop.flush():  # empty once a stop string was hit
            self.send(out)
        length = result.stopped_by in ("max_new_tokens", "context") and not stop.hit
        return Finished(result, "length" if length else "stop", queued, self.settings["seed"])


class Worker:
    """The decoder, its thread and its bounded queue. `depth` counts admitted requests not yet finished."""

    def __init__(self, decoder: SpeculativeDecoder, max_queue: int, metrics: Metrics):
        self.decoder, self.max_queue, self.metrics = decoder, max_queue, metrics
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="exitspec-decode")
        self.depth, self.closing, self.jobs = 0, False, set()
        self.mean_seconds = 1.0  # a running mean of a request's decode time, for Retry-After

    def admit(self, job: Job) -> None:
        """Queues `job` (on the event loop), or raises ServerError 503 when the queue is full or the server stops."""
        if self.closing:
            raise ServerError(503, "the server is shutting down", code="shutting_down")
        if self.depth >= self.max_queue:
            wait = max(1, math.ceil(self.depth * self.mean_seconds))
            raise ServerError(503, f"{self.depth} requests are waiting, the most this server queues; retry in {wait} s",
                              code="queue_full", headers={"Retry-After": str(wait)})
        self.depth += 1
        self.jobs.add(job)
        self.metrics.queue_depth.set(self.depth)
        job.loop.run_in_executor(self.executor, self._decode, job)

    def _decode(self, job: Job) -> None:
        """On the decoding thread: the job leaves the queue's count before its client hears that it finished, so
        that a client's next request finds its place free."""
        last = job.decode(self.decoder)
        job.loop.call_soon_threadsafe(self._done, job)
        if last is not None:
            job.send(last)

    def _done(self, job: Job) -> None:
        self.depth -= 1
        self.jobs.discard(job)
        self.metrics.queue_depth.set(self.depth)
        if job.started is not None:
            self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * (time.perf_counter() - job.started)

    def warm_up(self, budget, verifier: str) -> None:
        """One-time costs before the first request, on the decoding thread itself (its first tensor ops start
        that thread's own OpenMP team): a short run per warp, the text stream included."""
        def runs():
            for temperature in (0.0, 1.0):  # `auto`'s rates are kept per warp
                self.decoder.generate("Hi", max_new_tokens=4, temperature=temperature, budget=budget, verifier=verifier,
                                      stream=lambda text: None, learn=False)

        self.executor.submit(runs).result()

    def close(self) -> None:
        """No new requests; the queued ones are dropped and the one decoding ends after its round."""
        self.closing = True
        for job in list(self.jobs):
            job.left.set()
        self.executor.shutdown(wait=True)


class Metrics:
    """Prometheus metrics, in a registry of the app's own (several apps may live in one process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("exitspec_requests", "requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("exitspec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("exitspec_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("exitspec_queue_depth", "requests admitted and not finished", registry=r)
        self.tau = Histogram("exitspec_tau", "mean tokens per round of a request (τ, bonus included)", registry=r,
                             buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8, 16))
        self.round_seconds = Histogram("exitspec_round_seconds", "mean round latency of a request", registry=r,
                                       buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28))
        self.queue_seconds = Histogram("exitspec_queue_seconds", "time from admission to decoding", registry=r)
        self.first_text_seconds = Histogram("exitspec_first_text_seconds", "request to first streamed text",
                                            registry=r)

    def finished(self, done: Finished) -> None:
        result = done.result
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.generated_tokens.inc(len(result.tokens))
        self.queue_seconds.observe(done.queue_seconds)
        if result.rounds:
            self.tau.observe(result.tau)
            self.round_seconds.observe((result.total_seconds - result.prefill_seconds) / len(result.rounds))


# ---------------------------------------------------------------------------------------------------------
# The app


class OpenAIServer:
    """The endpoints over one decoder served as model `name`; requests decode with `budget` and `verifier`."""

    def __init__(self, decoder: SpeculativeDecoder, name: str, budget, verifier: str, max_queue: int,
                 api_key: str | None):
        if decoder.target.tokenizer is None:
            raise ValueError("the model folder has no tokenizer, which a text server needs")
        self.decoder, self.name, self.budget, self.verifier, self.api_key = decoder, name, budget, verifier, api_key
        self.metrics = Metrics()
        self.worker = Worker(decoder, max_queue, self.metrics)

    async def authorized(self, request: Request) -> None:
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise ServerError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")

    async def health(self):
        return {"status": "ok", "queue_depth": self.worker.depth}

    async def prometheus(self):
        return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "exitspec"}]}

    async def chat(self, request: Request):
        arrived = time.perf_counter()
        body = await _parse(request, ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = _encode(self.decoder, messages, True, "messages")
        return await self.respond(request, body, ids, "chat.completion", "chatcmpl", arrived)

    async def completions(self, request: Request):
        arrived = time.perf_counter()
        body = await _parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ServerError(400, "one prompt a request (a list of prompts would be n > 1)", "prompt")
            prompt = prompt[0]
        ids = _encode(self.decoder, prompt, False, "prompt")
        return await self.respond(request, body, ids, "text_completion", "cmpl", arrived)

    async def respond(self, request: Request, body: Sampled, ids: list[int], kind: str, prefix: str, arrived: float):
        """Queues the request's job; answers with the whole text, or streams it (`arrived`: its perf_counter)."""
        endpoint = request.url.path
        try:
            job = _job(self.decoder, body, ids, self.budget, self.verifier)
            self.worker.admit(job)
        except ServerError as e:
            self.metrics.requests.labels(endpoint, f"refused_{e.status}").inc()
            raise
        head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": self.name}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = _events(job, head, kind, include_usage, self.metrics, endpoint, arrived)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _whole(request, job, head, kind, self.metrics, endpoint)


def create_app(decoder: SpeculativeDecoder, name: str, budget: int | str = "auto", verifier: str = "tev",
               max_queue: int = 16, api_key: str | None = None) -> FastAPI:
    """The ASGI app: OpenAIServer's endpoints, OpenAI-style errors, the queue closed at shutdown."""
    server = OpenAIServer(decoder, name, budget, verifier, max_queue, api_key)

    async def lifespan(app):
        yield
        await asyncio.to_thread(server.worker.close)

    app = FastAPI(title="exitspec", lifespan=lifespan)
    app.state.server = server
    guarded = [Depends(server.authorized)]
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"], dependencies=guarded)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=guarded)
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=guarded)
    app.add_exception_handler(ServerError, lambda _, e: _error(e.status, e.message, e.param, e.code, e.headers))
    app.add_exception_handler(HTTPException, lambda _, e: _error(e.status_code, str(e.detail), None, None, e.headers))
    return app


async def _parse(request: Request, schema: type[Sampled]) -> Sampled:
    """The JSON body, whatever its Content-Type (curl -d sends a form's), checked against `schema`."""
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        invalid = first["type"] == "json_invalid"
        message = f"the body is not JSON: {first['msg']}" if invalid else f"{where}: {first['msg']}"
        raise ServerError(400, message, None if first["type"] == "json_invalid" else where) from None


def _encode(decoder: SpeculativeDecoder, prompt, chat: bool, param: str) -> list[int]:
    try:
        return encode_prompt(decoder.target.tokenizer, prompt, chat)
    except ValueError as e:
        raise ServerError(400, str(e), param) from None


def _job(decoder: SpeculativeDecoder, body: Sampled, ids: list[int], budget, verifier: str) -> Job:
    """The request's decoding settings, checked before it is queued."""
    body.refusal()
    params = SamplingParams(body.temperature, max(body.top_k, 0), body.top_p)
    check_verifier(verifier, params)
    room = decoder.target.max_context - len(ids)
    wanted = body.max_completion_tokens or body.max_tokens
    if room < 1 or (wanted is not None and wanted > room):
        raise ServerError(400, f"this model's context is {decoder.target.max_context} tokens; the prompt has "
                          f"{len(ids)}" + (f" and {wanted} more were asked for" if wanted else ""), "messages",
                          "context_length_exceeded")
    settings = {"max_new_tokens": wanted or room, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "seed": secrets.randbelow(2**31) if body.seed is None else body.seed,
                "budget": budget, "verifier": verifier}
    return Job(ids, settings, body.stops(), asyncio.get_running_loop())


async def _items(job: Job) -> AsyncIterator:
    """The job's text increments, then its Finished; a decoding error is raised as a 500."""
    while True:
        item = await job.items.get()
        if isinstance(item, Exception):
            raise ServerError(500, f"decoding failed: {' '.join(str(item).split())}", code="decode_error")
        yield item
        if isinstance(item, Finished):
            return


async def _whole(request: Request, job: Job, head: dict, kind: str, metrics: Metrics, endpoint: str):
    """The non-streaming answer; a client that leaves while it waits cancels the job (polled each second)."""
    parts, items = [], _items(job)
    try:
        while True:
            waiting = asyncio.ensure_future(anext(items))
            while not (await asyncio.wait({waiting}, timeout=1.0))[0]:
                if await request.is_disconnected():
                    waiting.cancel()
                    metrics.requests.labels(endpoint, "client_left").inc()
                    return None
            item = waiting.result()
            if isinstance(item, Finished):
                break
            parts.append(item)
    finally:
        job.left.set()  # a no-op once finished; frees the target when the client left
    metrics.finished(item)
    metrics.requests.labels(endpoint, "ok").inc()
    text = "".join(parts)
    choice = {"message": {"role": "assistant", "content": text}} if kind == "chat.completion" else {"text": text}
    return {**head, "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": item.finish_reason}],
            "usage": _usage(item)}


async def _events(job: Job, head: dict, kind: str, include_usage: bool, metrics: Metrics, endpoint: str,
                  started: float) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; `started`: the request's arrival."""
    kind = "chat.completion.chunk" if kind == "chat.completion" else kind

    def chunk(payload: dict, finish: str | None = None) -> str:
        if kind == "chat.completion.chunk":
            choice = {"index": 0, "delta": payload, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": payload.get("content", ""), "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

    first = None
    try:
        if kind == "chat.completion.chunk":
            yield chunk({"role": "assistant", "content": ""})
        async for item in _items(job):
            if isinstance(item, Finished):
                metrics.finished(item)
                metrics.requests.labels(endpoint, "ok").inc()
                yield chunk({}, item.finish_reason)
                if include_usage:
                    usage = _usage(item)
                    usage["exitspec"]["first_text_seconds"] = first  # from the request's arrival, None without text
                    yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': usage})}\n\n"
                break
            if first is None:
                first = time.perf_counter() - started
                metrics.first_text_seconds.observe(first)
            yield chunk({"content": item})
        yield "data: [DONE]\n\n"
    except ServerError as e:
        metrics.requests.labels(endpoint, "error").inc()
        yield f"data: {json.dumps({'error': _error_body(e.message, e.param, e.code)})}\n\n"
    except asyncio.CancelledError:
        metrics.requests.labels(endpoint, "client_left").inc()
        raise
    finally:
        job.left.set()  # a client that left frees the target after the round in flight


def _usage(done: Finished) -> dict:
    """OpenAI's usage, plus exitspec's own statistics under `exitspec`."""
    result = done.result
    prompt, completion = len(result.prompt_ids), len(result.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "exitspec": {"tau": result.tau if result.rounds else 0.0, "mean_coverage": result.mean_coverage,
                         "rounds": len(result.rounds), "tokens_per_second": result.tokens_per_second,
                         "decode_seconds": result.total_seconds, "prefill_seconds": result.prefill_seconds,
                         "queue_seconds": done.queue_seconds, "seed": done.seed, "stopped_by": result.stopped_by}}


def _error_body(message: str, param: str | None, code: str | None) -> dict:
    kind = "invalid_request_error" if code not in ("decode_error", "queue_full", "shutting_down") else "server_error"
    return {"message": message, "type": kind, "param": param, "code": code}


def _error(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": _error_body(" ".join(message.split()), param, code)}, status, headers=headers)


# ---------------------------------------------------------------------------------------------------------
# The command


def run(args) -> int:
    """`exitspec serve`: load, calibrate and warm the decoder once, then serve until interrupted."""
    args.drafter = args.drafter or default_drafter(args.model)
    resolve_device(args.device)
    check_budgets([args.budget], args.model, args.device)
    decoder = load_decoders(args.model, [args.drafter], args.device, args.dtype, args.threads, args.lookup,
                            budgets=[args.budget], warm_start=not args.no_warm_start)[args.drafter]
    name = args.name or (DEFAULT_MODEL if args.model is None else str(args.model).rstrip("/").split("/")[-1])
    app = create_app(decoder, name, args.budget, args.verifier, args.max_queue, args.api_key)
    app.state.server.worker.warm_up(args.budget, args.verifier)
    print(f"exitspec serve: {name} on http://{args.host}:{args.port}/v1 ({decoder.target.precision}, "
          f"drafter {args.drafter}, budget {args.budget})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
