"""The HTTP side of the server: the FastAPI application and its OpenAI-compatible routes.

The HTTP side never runs engine code. An arrival is checked and decided on at once (the
controller's ``admit`` on the engine's latest observation), so a refused request gets its 429
without queueing; an accepted one is handed to the engine thread through a queue, and its text
comes back through a bounded per-stream buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.core.request import RequestState
from engine.real.sampling import SamplingParams
from engine.serve.protocol import (
    SSE_DONE,
    ChatBody,
    ChatMessage,
    CompletionBody,
    SamplingBody,
    StreamEvents,
    completion_body,
    error_body,
    error_response,
    model_list,
    sse_event,
    usage_body,
)
from engine.serve.engine_proc import Outcome
from engine.serve.service import EngineService, EngineUnavailable, Stream

if TYPE_CHECKING:
    from engine.serve.launch import ServeConfig

log = logging.getLogger("tidegate.server")


def create_app(service: EngineService, config: ServeConfig) -> FastAPI:
    """The FastAPI application around a running EngineService.

    :param service: the running engine service
    :param config: the server settings
    """
    app = FastAPI(title="tidegate", version="0.1.0")
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _unexpected)
    _add_probe_routes(app, service)
    _add_openai_routes(app, OpenAIServing(service, config))
    return app


# ---------------------------------------------------------------------------------- routes
def _add_probe_routes(app: FastAPI, service: EngineService) -> None:
    """Liveness, readiness and Prometheus metrics."""

    @app.get("/health")
    async def health():
        if not service.alive:
            return error_response(503, "the engine is not running; a new one is starting", "unavailable",
                                  retry_after_s=5)
        # degraded: serving, but on the learned policy's fallback (the policy failed, was late or is
        # backing off); guarded (in "controller"): the runtime guard found the policy losing
        return {"status": "degraded" if service.degraded else "ok", **service.status()}

    @app.get("/ready")
    async def ready():
        if service.draining:
            return error_response(503, "the server is shutting down", "unavailable", retry_after_s=5)
        if not service.alive:
            return error_response(503, "the engine is restarting", "unavailable", retry_after_s=5)
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``."""

    @app.get("/v1/models")
    async def models():
        return model_list(serving.model_name, serving.created, serving.service.max_model_len)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        try:
            ids = serving.prompt_ids(body.prompt)
        except _Refused as refused:
            return refused.response
        return await serving.respond(http, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        ids = list(serving.tokenizer.encode(_chat_prompt(serving.tokenizer, body.messages)))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await serving.respond(http, body, ids, max_tokens, chat=True)


async def _invalid_request(_request: HttpRequest, exc: RequestValidationError):
    """A body that fails its schema: 400 with the first error, in OpenAI's error body."""
    err = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON")
    msg = err.get("msg", "invalid request")
    return error_response(400, f"{where}: {msg}" if where else msg, param=where or None)


async def _unexpected(_request: HttpRequest, exc: Exception):
    log.exception("unexpected error")
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


# ---------------------------------------------------------------------------------- serving
class _Refused(Exception):
    """An arrival answered at once with an error response, without reaching the engine."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class OpenAIServing:
    """What the completion routes share: admission of an arrival, then its streamed or whole answer.

    :param service: the running engine service
    :param config: the server settings
    """

    def __init__(self, service: EngineService, config: ServeConfig) -> None:
        self.service = service
        self.config = config
        self.metrics = service.metrics
        self.tokenizer = service.tokenizer
        self.model_name = config.model_name
        self.created = int(time.time())

    # -- arrival
    def prompt_ids(self, prompt: str | list[str] | list[int]) -> list[int]:
        """The token ids of a completion's prompt; raises :class:`_Refused` for one that is not served."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise _Refused(error_response(400, "only one prompt per request is served; send a string",
                                              param="prompt"))
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise _Refused(error_response(400, "the prompt is empty", param="prompt"))
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    async def admit(self, body: SamplingBody, prompt_ids: list[int], max_tokens: int | None):
        """Common arrival path: returns (stream, None) when admitted, (None, response) otherwise."""
        try:
            self._check_open()
            max_tokens, sampling = self._check_request(body, prompt_ids, max_tokens)
            self._check_admission(len(prompt_ids), max_tokens)
        except _Refused as refused:
            return None, refused.response
        stream = Stream(asyncio.get_running_loop(), self.config.stream_buffer_chunks)
        try:
            self.service.submit(stream, prompt_ids, sampling, max_tokens)
        except EngineUnavailable:
            self.metrics.rejected("engine_down")
            return None, error_response(503, "the engine is restarting", "unavailable", retry_after_s=5)
        return stream, None

    def _check_open(self) -> None:
        if self.service.draining:
            self.metrics.rejected("shutting_down")
            raise _Refused(error_response(503, "the server is shutting down", "unavailable", retry_after_s=5))
        if not self.service.alive:
            self.metrics.rejected("engine_down")
            raise _Refused(error_response(503, "the engine is restarting", "unavailable", retry_after_s=5))

    def _check_request(self, body: SamplingBody, prompt_ids: list[int], max_tokens: int | None):
        """(max_tokens, sampling parameters) of a request this server can serve; raises :class:`_Refused`
        (400) otherwise. A request that sets no ``max_tokens`` gets the default, within the context."""
        if body.model != self.model_name:
            raise _Refused(error_response(400, f"the model {body.model!r} is not served here; use "
                                               f"{self.model_name!r}", "invalid_request_error", "model"))
        context = self.service.max_model_len or (len(prompt_ids) + self.config.default_max_tokens)
        if max_tokens is None:
            max_tokens = max(1, min(self.config.default_max_tokens, context - len(prompt_ids)))
        if max_tokens < 1:
            raise _Refused(error_response(400, f"max_tokens must be at least 1, got {max_tokens}",
                                          param="max_tokens"))
        try:
            self.service.check_request(prompt_ids, max_tokens)
            sampling = _sampling_params(body)
        except ValueError as exc:
            raise _Refused(error_response(400, str(exc).rstrip("."))) from None
        return max_tokens, sampling

    def _check_admission(self, prompt_len: int, max_tokens: int) -> None:
        """Raises :class:`_Refused` (429) when the server is at its in-flight limit or the controller refuses."""
        limit = self.config.max_in_flight
        if self.service.in_flight >= limit:
            self.metrics.rejected("max_in_flight")
            raise _Refused(error_response(429, f"the server is at its limit of {limit} requests in flight",
                                          "rate_limited", retry_after_s=1))
        rejection = self.service.admission(prompt_len, max_tokens)
        if rejection is not None:
            self.metrics.rejected(rejection.reason.split(" ")[0].lower())
            self.service.record_rejection(prompt_len, max_tokens, rejection)
            raise _Refused(error_response(429, rejection.reason, "rate_limited",
                                          retry_after_s=rejection.retry_after_s))

    # -- answer
    async def respond(self, http: HttpRequest, body: SamplingBody, prompt_ids: list[int], max_tokens: int | None,
                      chat: bool):
        """Admit an arrival, wait for its first text, then answer it whole or as a stream of events."""
        stream, refusal = await self.admit(body, prompt_ids, max_tokens)
        if refusal is not None:
            return refusal
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        first = await self._first_chunk(stream, http)
        if first is None:  # the client left before the first token
            return Response(status_code=499)
        if first[1]:  # ended before or with its first text
            bad = _ended_badly(stream.result, stream, first[0])
            if bad is not None:
                self.service.done(stream)
                status, kind, message = bad
                retry = 5 if status in (429, 503) else None
                return error_response(status, message, kind, retry_after_s=retry)
        if not body.stream:
            return await self.complete(http, stream, first, rid, chat)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(self.sse(stream, first, rid, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _first_chunk(self, stream: Stream, http: HttpRequest) -> tuple[str, bool] | None:
        """The first (delta, finished); None, with the request cancelled, if the client left first."""
        try:
            first = await _next_chunk(stream, http)
        except BaseException:
            self.service.cancel(stream)
            self.service.done(stream)
            raise
        if first is None:
            self.service.cancel(stream)
            self.service.done(stream)
        return first

    async def complete(self, http: HttpRequest, stream: Stream, first: tuple[str, bool], rid: str, chat: bool):
        """The whole answer as one body, once the request has finished."""
        parts = await self._collect(http, stream, first)
        if parts is None:  # the client went away
            return Response(status_code=499)
        r = stream.result
        bad = _ended_badly(r, stream)
        if bad is not None:
            status, kind, message = bad
            return error_response(status, message, kind)
        return completion_body(rid, self.model_name, "".join(parts), _finish_reason(r), _usage(r), chat)

    async def _collect(self, http: HttpRequest, stream: Stream, first: tuple[str, bool]) -> list[str] | None:
        """Every text delta until the end; None, with the request cancelled, if the client went away."""
        parts = [first[0]]
        finished = first[1]
        try:
            while not finished:
                chunk = await _next_chunk(stream, http)
                if chunk is None:
                    self.service.cancel(stream)
                    return None
                parts.append(chunk[0])
                finished = chunk[1]
        finally:
            self.service.done(stream)
        return parts

    async def sse(self, stream: Stream, first: tuple[str, bool], rid: str, chat: bool, include_usage: bool):
        """The answer as server-sent events, ending with ``[DONE]``."""
        events = StreamEvents(rid, self.model_name, chat, include_usage)
        finished = False
        try:
            if chat:
                yield events.chunk(None, None, role=True)
            delta, finished = first
            while not finished:
                if delta:
                    yield events.chunk(delta, None)
                delta, finished = await _next_chunks(stream)
            for event in _last_events(events, stream, delta):
                yield event
        finally:
            if not finished:  # the client went away mid-stream: free its KV blocks
                self.service.cancel(stream)
            self.service.done(stream)


# ---------------------------------------------------------------------------------- helpers
async def _next_chunk(stream: Stream, http: HttpRequest | None) -> tuple[str, bool] | None:
    """The next (delta, finished); None if the client went away while waiting. Without ``http``
    (a stream being sent, whose disconnect the response notices itself) it waits without a timer:
    every stream ends, by the engine or, if the engine goes away, by the service."""
    while not stream.chunks:
        stream.event.clear()
        if stream.chunks:
            break
        if http is None:
            await stream.event.wait()
            continue
        try:
            await asyncio.wait_for(stream.event.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            if http is not None and await http.is_disconnected():
                return None
    return stream.chunks.popleft()


async def _next_chunks(stream: Stream) -> tuple[str, bool]:
    """The next (delta, finished) of a stream being sent, with every delta already waiting joined to it."""
    delta, finished = await _next_chunk(stream, None)
    # Under load several tokens may be waiting: send them as one event.
    while not finished and stream.chunks:
        more, finished = stream.chunks.popleft()
        delta += more
    return delta, finished


def _last_events(events: StreamEvents, stream: Stream, delta: str) -> list[str]:
    """The events after the last text arrived: that text, then the finish (or the error), usage, ``[DONE]``."""
    r = stream.result
    bad = _ended_badly(r, stream)
    out = [events.chunk(delta, None)] if delta else []
    if bad is not None:
        status, kind, message = bad
        out.append(sse_event(error_body(message, kind, status)))
    else:
        out.append(events.chunk(None, _finish_reason(r)))
        if events.include_usage:
            out.append(events.usage(_usage(r)))
    out.append(SSE_DONE)
    return out


def _usage(r: Outcome | None) -> dict:
    return usage_body(r.prompt_len if r else 0, r.completion_tokens if r else 0)


def _sampling_params(body: SamplingBody) -> SamplingParams:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                          seed=body.seed, stop=stops, ignore_eos=body.ignore_eos)


def _chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    def text(m: ChatMessage) -> str:
        if isinstance(m.content, list):
            return "".join(part.get("text", "") for part in m.content if isinstance(part, dict))
        return m.content or ""

    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": m.role, "content": text(m)} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m.role}|>\n{text(m)}\n" for m in messages) + "<|assistant|>\n"


def _finish_reason(r: Outcome | None) -> str:
    if r is None or r.finish_reason not in ("length", "stop"):
        return "stop"
    return r.finish_reason


def _ended_badly(r: Outcome | None, stream: Stream, fallback: str | None = None) -> tuple[int, str, str] | None:
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
    if r.unavailable:
        return 503, "engine_unavailable", r.finish_reason or "the engine went away"
    if r.state is RequestState.CANCELLED:
        return 499, "cancelled", "the request was cancelled"
    return 500, "engine_error", r.finish_reason or "the engine failed this request"
