"""The OpenAI-compatible streaming server: FastAPI on uvicorn, the engine loop in its own thread.

The HTTP side never runs engine code. An arrival is checked and decided on at once (the
controller's ``admit`` on the engine's latest observation), so a refused request gets its 429
without queueing; an accepted one is handed to the engine thread through a queue, and its text
comes back through a bounded per-stream buffer.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from ctrl.base import Rejection
from engine.core.request import Request, RequestState
from engine.serve.metrics import ServerMetrics

log = logging.getLogger("tidegate.server")


@dataclass
class ServeConfig:
    """Server settings (``tidegate serve --help`` describes each)."""

    model: str = "tiny"
    served_model_name: str | None = None
    controller: str = "learned"
    profile: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    device: str | None = None
    dtype: str | None = None
    max_in_flight: int = 1024
    queue_timeout_s: float | None = 30.0
    stream_buffer_chunks: int = 512
    drain_timeout_s: float = 30.0
    default_max_tokens: int = 256

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


# ---------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is served")
    ignore_eos: bool = False


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def error_body(message: str, type_: str = "invalid_request_error", code: int | str = 400,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)


# ---------------------------------------------------------------------------------- engine side
class Stream:
    """What the engine thread hands one HTTP request: text deltas, then the end."""

    __slots__ = ("loop", "event", "chunks", "request", "limit", "overflowed", "arrival_s", "last_token_s",
                 "admitted", "touched")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.chunks: deque[tuple[str, bool]] = deque()
        self.request: Request | None = None
        self.limit = limit
        self.overflowed = False
        self.arrival_s = time.perf_counter()
        self.last_token_s: float | None = None
        self.admitted = False
        self.touched = False  # has data the HTTP side has not been woken for yet


def _set_events(streams: list[Stream]) -> None:
    for stream in streams:
        stream.touched = False
        stream.event.set()


class TimedController:
    """Wraps the controller to time each decision; everything else passes through."""

    def __init__(self, inner, histogram) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["_hist"] = histogram

    def decide(self, obs):
        t = time.perf_counter()
        d = self._inner.decide(obs)
        self._hist.observe(time.perf_counter() - t)
        return d

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


class EngineService:
    """Owns the LLM and runs its engine loop in a thread; every call from HTTP goes through a queue."""

    def __init__(self, llm, config: ServeConfig, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.core = llm.core
        self.config = config
        self.metrics = metrics
        self.core.controller = TimedController(self.core.controller, metrics.decision_time)
        if config.queue_timeout_s is not None:
            self.core.controller.queue_timeout_s = config.queue_timeout_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.in_flight = 0
        self.draining = False
        self._stop = False
        self._ids = itertools.count()
        self._seen_evictions = 0
        self._seen_interventions = 0
        self.thread = threading.Thread(target=self._run, name="tidegate-engine", daemon=True)
        self._touched: list[Stream] = []
        # (requests, prompt tokens) handed to the engine thread, and taken by it: each written by
        # one thread only, so their difference is exact without a lock.
        self._submitted = (0, 0)
        self._taken = (0, 0)

    # -- called from the HTTP side
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def admission(self, prompt_len: int, max_tokens: int) -> Rejection | None:
        """The controller's answer on the engine's latest observation (read-only, any thread),
        counting the requests handed over since then as waiting."""
        obs = copy.copy(self.core.obs)
        obs.num_waiting += self._submitted[0] - self._taken[0]
        obs.waiting_prompt_tokens += self._submitted[1] - self._taken[1]
        return self.core.controller.admit(obs, prompt_len, max_tokens)

    def submit(self, stream: Stream, prompt_ids: list[int], sampling, max_tokens: int) -> None:
        self._submitted = (self._submitted[0] + 1, self._submitted[1] + len(prompt_ids))
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self.inbox.put(("add", stream, prompt_ids, sampling, max_tokens))
        self.wake.set()

    def record_rejection(self, prompt_len: int, max_tokens: int, rejection: Rejection) -> None:
        self.inbox.put(("reject", prompt_len, max_tokens, rejection))
        self.wake.set()

    def cancel(self, stream: Stream) -> None:
        self.inbox.put(("cancel", stream))
        self.wake.set()

    def done(self, stream: Stream) -> None:
        """The HTTP side has finished with a stream."""
        if stream.admitted:
            stream.admitted = False
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    # -- the engine thread
    def _run(self) -> None:
        llm = self.llm
        # The HTTP loop and this thread share the GIL: switch often so a 429 is never held up
        # behind a long stretch of engine bookkeeping.
        sys.setswitchinterval(0.001)
        while not self._stop:
            self._drain_inbox()
            if llm.has_unfinished:
                try:
                    llm.step()
                except Exception:  # a bug outside the executor: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all()
                self._wake_streams()
                self._update_gauges()
            else:
                self._wake_streams()
                self._update_gauges()
                self.wake.wait(0.05)
                self.wake.clear()

    def _touch(self, stream: Stream) -> None:
        if not stream.touched:
            stream.touched = True
            self._touched.append(stream)

    def _wake_streams(self) -> None:
        """One wake-up of the HTTP loop per step for every stream that got data (not one per token)."""
        if self._touched:
            touched, self._touched = self._touched, []
            touched[0].loop.call_soon_threadsafe(_set_events, touched)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "add":
                _, stream, ids, sampling, max_tokens = item
                self._add(stream, ids, sampling, max_tokens)
                self._taken = (self._taken[0] + 1, self._taken[1] + len(ids))
            elif kind == "reject":
                _, n, max_tokens, rejection = item
                r = Request(f"rejected-{next(self._ids)}", self.core.clock.now(), n, max_tokens)
                self.core.add_request(r, admission=rejection)
            elif kind == "cancel":
                r = item[1].request
                if r is not None and not r.state.is_terminal:
                    self.llm.cancel(r)

    def _add(self, stream: Stream, ids, sampling, max_tokens) -> None:
        def on_delta(r: Request, delta: str, finished: bool) -> None:
            now = time.perf_counter()
            if delta:
                if stream.last_token_s is None:
                    self.metrics.ttft.observe(now - stream.arrival_s)
                else:
                    self.metrics.itl.observe(now - stream.last_token_s)
                stream.last_token_s = now
            if finished:
                self._on_finished(r, stream, now)
            elif len(stream.chunks) >= stream.limit:
                if not stream.overflowed:  # the client reads too slowly: end its stream
                    stream.overflowed = True
                    self.llm.cancel(r)
                return
            stream.chunks.append((delta, finished))
            self._touch(stream)

        try:
            r = self.llm.add_request(ids, sampling, max_tokens, request_id=f"cmpl-{next(self._ids)}",
                                     on_delta=on_delta, admission=None)
        except ValueError as exc:  # checked on arrival already; a race with a resize would land here
            stream.chunks.append((str(exc), True))
            self._touch(stream)
            return
        stream.request = r
        if r.state.is_terminal:  # ended at once (refused by the engine's own checks)
            stream.chunks.append(("", True))
            self._touch(stream)

    def _on_finished(self, r: Request, stream: Stream, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - stream.arrival_s)
        if r.first_token_time_s is not None:
            m.prompt_tokens.inc(r.prompt_len)
            m.generation_tokens.inc(len(r.output_token_ids))
        if r.start_time_s is not None:
            m.queue_time.observe(max(0.0, r.start_time_s - r.arrival_time_s))
        m.finished(r.finish_reason if r.state is RequestState.FINISHED else r.state.value)

    def _fail_all(self) -> None:
        core = self.core
        for r in list(core.running) + list(core.waiting):
            core.cancel(r)

    def _update_gauges(self) -> None:
        # Arrivals are decided on the HTTP side from this observation: keep it current between
        # steps and while idle, or a queue that has drained would still look full.
        self.core.observe()
        core, m = self.core, self.metrics
        m.running.set(len(core.running))
        m.waiting.set(len(core.waiting))
        m.kv_usage.set(core.pool.used_tokens / core.pool.capacity_tokens)
        ev = core.metrics.evictions
        if ev > self._seen_evictions:
            m.evictions.inc(ev - self._seen_evictions)
            self._seen_evictions = ev
        iv = getattr(core.controller, "interventions", None)
        if isinstance(iv, int) and iv > self._seen_interventions:
            m.shield_interventions.inc(iv - self._seen_interventions)
            self._seen_interventions = iv


# ---------------------------------------------------------------------------------- HTTP side
def _chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    def text(m: ChatMessage) -> str:
        if isinstance(m.content, list):
            return "".join(part.get("text", "") for part in m.content if isinstance(part, dict))
        return m.content or ""

    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": m.role, "content": text(m)} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m.role}|>\n{text(m)}\n" for m in messages) + "<|assistant|>\n"


def _finish_reason(r: Request | None) -> str:
    if r is None or r.finish_reason not in ("length", "stop"):
        return "stop"
    return r.finish_reason


def _ended_badly(r: Request | None, stream: Stream, fallback: str | None = None) -> tuple[int, str, str] | None:
    """(status, type, message) for a request that did not finish normally; None if it did."""
    if stream.overflowed:
        return 503, "stream_overflow", "the client read the stream too slowly; it was ended to bound the buffer"
    if r is None:
        return 500, "engine_error", fallback or "the engine could not take the request"
    if r.state is RequestState.FINISHED:
        return None
    if r.state is RequestState.EXPIRED:
        return 503, "queue_timeout", "the request waited longer than the queue timeout without starting"
    if r.state is RequestState.REJECTED:
        return 429, "rate_limited", r.finish_reason or "rejected"
    if r.state is RequestState.CANCELLED:
        return 499, "cancelled", "the request was cancelled"
    return 500, "engine_error", r.finish_reason or "the engine failed this request"


def create_app(service: EngineService, config: ServeConfig) -> FastAPI:
    """The FastAPI application around a running EngineService."""
    app = FastAPI(title="tidegate", version="0.1.0")
    llm, metrics = service.llm, service.metrics
    tokenizer = llm.tokenizer
    model_name = config.model_name
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: HttpRequest, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        msg = err.get("msg", "invalid request")
        return error_response(400, f"{where}: {msg}" if where else msg, param=where or None)

    @app.exception_handler(Exception)
    async def _unexpected(_request: HttpRequest, exc: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.get("/health")
    async def health():
        if not service.alive:
            return error_response(503, "the engine thread has stopped", "unavailable")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if service.draining or not service.alive:
            return error_response(503, "the server is shutting down", "unavailable", retry_after_s=5)
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tidegate", "max_model_len": llm.max_model_len}]}

    async def admit(body: _Sampling, prompt_ids: list[int], max_tokens: int | None):
        """Common arrival path: returns (stream, None) when admitted, (None, response) otherwise."""
        if service.draining:
            metrics.rejected("shutting_down")
            return None, error_response(503, "the server is shutting down", "unavailable", retry_after_s=5)
        if body.model != model_name:
            return None, error_response(400, f"the model {body.model!r} is not served here; use {model_name!r}",
                                        "invalid_request_error", "model")
        context = llm.max_model_len or (len(prompt_ids) + config.default_max_tokens)
        if max_tokens is None:
            max_tokens = max(1, min(config.default_max_tokens, context - len(prompt_ids)))
        if max_tokens < 1:
            return None, error_response(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        try:
            llm.check_request(prompt_ids, max_tokens)
            sampling = _sampling(body)
        except ValueError as exc:
            return None, error_response(400, str(exc).rstrip("."))
        if service.in_flight >= config.max_in_flight:
            metrics.rejected("max_in_flight")
            return None, error_response(429, f"the server is at its limit of {config.max_in_flight} requests in "
                                             "flight", "rate_limited", retry_after_s=1)
        rejection = service.admission(len(prompt_ids), max_tokens)
        if rejection is not None:
            metrics.rejected(rejection.reason.split(" ")[0].lower())
            service.record_rejection(len(prompt_ids), max_tokens, rejection)
            return None, error_response(429, rejection.reason, "rate_limited", retry_after_s=rejection.retry_after_s)
        stream = Stream(asyncio.get_running_loop(), config.stream_buffer_chunks)
        stream.admitted = True
        service.submit(stream, prompt_ids, sampling, max_tokens)
        return stream, None

    async def next_chunk(stream: Stream, http: HttpRequest | None) -> tuple[str, bool] | None:
        """The next (delta, finished); None if the client went away while waiting."""
        while not stream.chunks:
            stream.event.clear()
            if stream.chunks:
                break
            try:
                await asyncio.wait_for(stream.event.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    return None
        return stream.chunks.popleft()

    def usage(r: Request | None) -> dict:
        p = r.prompt_len if r else 0
        c = len(r.output_token_ids) if r else 0
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def respond(http: HttpRequest, body: _Sampling, prompt_ids: list[int], max_tokens: int | None, chat: bool):
        stream, refusal = await admit(body, prompt_ids, max_tokens)
        if refusal is not None:
            return refusal
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{id(stream):x}"
        try:
            first = await next_chunk(stream, http)
        except BaseException:
            service.cancel(stream)
            service.done(stream)
            raise
        if first is None:  # the client left before the first token
            service.cancel(stream)
            service.done(stream)
            return Response(status_code=499)
        r = stream.request
        if first[1]:  # ended before or with its first text
            bad = _ended_badly(r, stream, first[0])
            if bad is not None:
                service.done(stream)
                status, kind, message = bad
                retry = 5 if status in (429, 503) else None
                return error_response(status, message, kind, retry_after_s=retry)
        if not body.stream:
            return await complete(http, stream, first, rid, chat)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse(stream, first, rid, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def complete(http: HttpRequest, stream: Stream, first: tuple[str, bool], rid: str, chat: bool):
        parts = [first[0]]
        finished = first[1]
        try:
            while not finished:
                chunk = await next_chunk(stream, http)
                if chunk is None:
                    service.cancel(stream)
                    return Response(status_code=499)
                parts.append(chunk[0])
                finished = chunk[1]
        finally:
            service.done(stream)
        r = stream.request
        bad = _ended_badly(r, stream)
        if bad is not None:
            status, kind, message = bad
            return error_response(status, message, kind)
        text = "".join(parts)
        reason = _finish_reason(r)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice],
                "usage": usage(r)}

    async def sse(stream: Stream, first: tuple[str, bool], rid: str, chat: bool, include_usage: bool):
        created_at = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            body = {"id": rid, "object": obj, "created": created_at, "model": model_name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            delta, finished = first
            while True:
                if finished:
                    r = stream.request
                    bad = _ended_badly(r, stream)
                    if delta:
                        yield chunk(delta, None)
                    if bad is not None:
                        status, kind, message = bad
                        yield f"data: {json.dumps(error_body(message, kind, status))}\n\n"
                    else:
                        yield chunk(None, _finish_reason(r))
                        if include_usage:
                            yield ("data: " + json.dumps({"id": rid, "object": obj, "created": created_at,
                                                          "model": model_name, "choices": [], "usage": usage(r)})
                                   + "\n\n")
                    yield "data: [DONE]\n\n"
                    return
                if delta:
                    yield chunk(delta, None)
                delta, finished = await next_chunk(stream, None)
                # Under load several tokens may be waiting: send them as one event.
                while not finished and stream.chunks:
                    more, finished = stream.chunks.popleft()
                    delta += more
        finally:
            if not finished:  # the client went away mid-stream: free its KV blocks
                service.cancel(stream)
            service.done(stream)

    def _sampling(body: _Sampling):
        from engine.real.executor import SamplingParams
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                              seed=body.seed, stop=stops, ignore_eos=body.ignore_eos)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return error_response(400, "only one prompt per request is served; send a string", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                return error_response(400, "the prompt is empty", param="prompt")
            ids = list(tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        return await respond(http, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        ids = list(tokenizer.encode(_chat_prompt(tokenizer, body.messages)))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(http, body, ids, max_tokens, chat=True)

    return app


# ---------------------------------------------------------------------------------- running it
def build_service(config: ServeConfig, model_and_tokenizer=None) -> EngineService:
    """Load the model (or use an already loaded ``(model, tokenizer)``) and start the engine thread."""
    from engine.real.llm import LLM

    llm = LLM(config.model, kv_capacity_tokens=config.kv_capacity_tokens, block_size=config.block_size,
              controller=config.controller, device=config.device, dtype=config.dtype,
              max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
              model_and_tokenizer=model_and_tokenizer, record_steps=False, profile=config.profile)
    service = EngineService(llm, config, ServerMetrics(config.model_name))
    service.start()
    return service


class GracefulServer:
    """uvicorn with a draining shutdown: on SIGTERM stop admitting (503), let in-flight requests
    finish within ``drain_timeout_s``, then exit. A second signal exits at once."""

    def __init__(self, app: FastAPI, service: EngineService, config: ServeConfig) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(inner, sig: int, frame) -> None:  # noqa: N805
                if service.draining or sig != signal.SIGTERM:
                    return uvicorn.Server.handle_exit(inner, sig, frame)
                service.draining = True
                log.warning("SIGTERM: draining %d in-flight requests (up to %.0f s)", service.in_flight,
                            config.drain_timeout_s)
                threading.Thread(target=self._drain_then_exit, daemon=True).start()

        self.service = service
        self.config = config
        self.server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                             timeout_graceful_shutdown=5))

    def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.should_exit = True

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.service.stop()
