"""The HTTP side of the server: the FastAPI application and its OpenAI-compatible routes.

The HTTP side never runs engine code. An arrival is checked and decided on at once (the
controller's ``admit`` on the engine's latest observation), so a refused request gets its 429
without queueing; an accepted one is handed to the engine thread through a queue, and its text
comes back through a bounded per-stream buffer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
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
    chat_logprobs,
    completion_body,
    completion_choice,
    completion_logprobs,
    error_body,
    error_response,
    model_list,
    sse_event,
    usage_body,
    validation_message,
)
from engine.serve.chat import chat_prompt
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
    from engine.serve.extra_routes import add_extra_routes, package_version
    from engine.serve.operator import install_operator

    app = FastAPI(title="tidegate", version=package_version())
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _unexpected)
    _add_probe_routes(app, service)
    _add_openai_routes(app, OpenAIServing(service, config))
    add_extra_routes(app, service, config)
    install_operator(app, config)  # after the handlers above: it wraps the validation one
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
        return _with_request_id(await serving.create_completion(body, http), http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        return _with_request_id(await serving.create_chat_completion(body, http), http)


async def _invalid_request(request: HttpRequest, exc: RequestValidationError):
    """A body that fails its schema: 400 with the first error, in OpenAI's error body."""
    message, param = validation_message(exc.errors()[0] if exc.errors() else {})
    return _with_request_id(error_response(400, message, param=param), request)


async def _unexpected(request: HttpRequest, exc: Exception):
    log.exception("unexpected error")
    return _with_request_id(error_response(500, f"internal error: {type(exc).__name__}", "internal_error"), request)


def _with_request_id(response: Response, http: HttpRequest) -> Response:
    """The response with the request's ``X-Request-Id``: the client's, or a new one when it sent none
    (or one that is not a short printable token)."""
    rid = http.headers.get("x-request-id")
    if not rid or len(rid) > 256 or not rid.isprintable():
        rid = uuid.uuid4().hex
    response.headers["X-Request-Id"] = rid
    return response


# ---------------------------------------------------------------------------------- serving
class _Refused(Exception):
    """An arrival answered at once with an error response, without reaching the engine."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _bad(message: str, param: str | None = None) -> _Refused:
    return _Refused(error_response(400, message, param=param))


@dataclass
class _Ask:
    """What a client asked for beyond the sampling: how many choices, which logprobs, echo, streaming."""

    chat: bool
    max_tokens: int | None
    #: choices in the answer
    n: int = 1
    #: engine requests; the n of them with the highest cumulative logprob are the answer
    best_of: int = 1
    #: alternatives per token in the answer's logprobs; None: no logprobs
    logprobs: int | None = None
    #: the prompt's text, put before each choice's text (completions' ``echo``)
    echo: str | None = None
    stream: bool = False
    include_usage: bool = False

    @classmethod
    def of(cls, body: SamplingBody, chat: bool, max_tokens: int | None, **fields) -> _Ask:
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        return cls(chat, max_tokens, n=body.n, stream=body.stream, include_usage=include_usage, **fields)


class _Choice:
    """One engine request of a completion, and what has been read of it."""

    __slots__ = ("index", "stream", "parts", "entries", "prompt_entries", "finished", "offset", "echoed")

    def __init__(self, index: int, stream: Stream) -> None:
        self.index = index
        self.stream = stream
        self.parts: list[str] = []
        self.entries: list = []
        self.prompt_entries: list | None = None
        self.finished = False
        #: the next token's ``text_offset``: the token texts sent before it (as the whole answer counts them)
        self.offset = 0
        self.echoed = False

    def read(self) -> tuple[str, list]:
        """Take every chunk waiting: returns their text and logprob entries (also kept)."""
        text: list[str] = []
        entries: list = []
        chunks = self.stream.chunks
        while chunks and not self.finished:
            delta, self.finished, logprobs, prompt_logprobs = chunks.popleft()
            text.append(delta)
            if logprobs:
                entries.extend(logprobs)
            if prompt_logprobs is not None:
                self.prompt_entries = prompt_logprobs
        joined = "".join(text)
        self.parts.append(joined)
        self.entries.extend(entries)
        return joined, entries

    @property
    def cumulative_logprob(self) -> float:
        return sum(e[1] for e in self.entries)


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
        self._bytes_per_token: float | None | bool = False  # False: not yet derived
        self._token_texts: dict[int, tuple[str, list[int]]] = {}

    # -- the two routes
    async def create_completion(self, body: CompletionBody, http: HttpRequest) -> Response:
        try:
            _refuse_unserved(body)
            ids, text = await asyncio.to_thread(self._completion_prompt, body.prompt, body.echo)
        except _Refused as refused:
            return refused.response
        best_of = body.best_of or body.n
        ask = _Ask.of(body, False, body.max_tokens, best_of=best_of, logprobs=body.logprobs,
                      echo=text if body.echo else None)
        return await self.respond(http, body, ids, ask)

    async def create_chat_completion(self, body: ChatBody, http: HttpRequest) -> Response:
        try:
            _refuse_unserved(body)
            ids = await asyncio.to_thread(self._chat_prompt, body.messages)
        except _Refused as refused:
            return refused.response
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ask = _Ask.of(body, True, max_tokens, best_of=body.n,
                      logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        return await self.respond(http, body, ids, ask)

    # -- prompts (run off the event loop)
    def _completion_prompt(self, prompt: str | list[str] | list[int], echo: bool) -> tuple[list[int], str | None]:
        """(token ids, text, when echoed) of a completion's prompt; raises :class:`_Refused` for one
        that is not served."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise _bad("only one prompt per request is served; send a string", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("the prompt is empty", "prompt")
            return self._encode(prompt, True, "prompt"), prompt
        ids = list(prompt)
        vocab = self.service.info.vocab_size if self.service.info is not None else None
        if vocab is not None and any(t < 0 or t >= vocab for t in ids):
            raise _bad(f"the prompt holds token ids outside the vocabulary of {vocab}", "prompt")
        return ids, self.tokenizer.decode(ids, skip_special_tokens=True) if echo else None

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The token ids of the conversation (:func:`engine.serve.chat.chat_prompt`). A template writes
        the BOS text where the model wants it, so its text is tokenized without adding special tokens:
        one BOS, not two; the tiny model's byte tokenizer has no BOS text, so its BOS is added."""
        try:
            text = chat_prompt(self.tokenizer, messages, getattr(self.config, "chat_template", None))
        except ValueError as exc:
            raise _bad(str(exc), "messages") from None
        return self._encode(text, not hasattr(self.tokenizer, "apply_chat_template"), "messages")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The token ids of a prompt text; raises :class:`_Refused` (400) for a text that is not valid
        Unicode or is too long to fit, before tokenizing a long one whole."""
        try:
            n_bytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise _bad("the prompt is not valid Unicode (it holds a lone surrogate)", param) from None
        self._refuse_too_long(n_bytes, param)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (UnicodeError, TypeError, ValueError) as exc:
            raise _bad(f"the prompt cannot be tokenized ({type(exc).__name__})", param) from None

    def _refuse_too_long(self, n_bytes: int, param: str) -> None:
        """Refuse a text that has, at the tokenizer's most bytes per token, more tokens than can fit."""
        if self._bytes_per_token is False:
            self._bytes_per_token = _max_bytes_per_token(self.tokenizer)
        per_token, info = self._bytes_per_token, self.service.info
        if not per_token or info is None:
            return
        at_least = math.ceil(n_bytes / per_token)
        context = self.service.max_model_len
        if context is not None and at_least > context:
            raise _bad(f"the prompt has at least {at_least} tokens, more than the model context of {context} "
                       f"tokens", param)
        if at_least >= info.kv_capacity_tokens:
            raise _bad(f"the prompt has at least {at_least} tokens; with one generated token that exceeds the "
                       f"KV capacity of {info.kv_capacity_tokens} tokens", param)

    # -- arrival
    async def admit(self, body: SamplingBody, prompt_ids: list[int], ask: _Ask):
        """Common arrival path: returns (choices, None) when admitted, one engine request per choice
        (``best_of`` of them), or (None, response) otherwise."""
        try:
            self._check_open()
            max_tokens, sampling = self._check_request(body, prompt_ids, ask)
        except _Refused as refused:
            return None, refused.response
        event = asyncio.Event()
        loop = asyncio.get_running_loop()
        choices: list[_Choice] = []
        for i in range(ask.best_of):
            try:
                self._check_admission(len(prompt_ids), max_tokens)
                stream = Stream(loop, self.config.stream_buffer_chunks, event)
                self.service.submit(stream, prompt_ids, _nth_sampling(sampling, i), max_tokens)
            except (_Refused, EngineUnavailable) as exc:
                self._abandon(choices)
                if isinstance(exc, _Refused):
                    return None, exc.response
                self.metrics.rejected("engine_down")
                return None, error_response(503, "the engine is restarting", "unavailable", retry_after_s=5)
            choices.append(_Choice(i, stream))
        return choices, None

    def _abandon(self, choices: list[_Choice]) -> None:
        """Cancel the requests of choices not read to their end, and release them all."""
        for c in choices:
            if not c.finished:
                self.service.cancel(c.stream)
            self.service.done(c.stream)

    def _check_open(self) -> None:
        if self.service.draining:
            self.metrics.rejected("shutting_down")
            raise _Refused(error_response(503, "the server is shutting down", "unavailable", retry_after_s=5))
        if not self.service.alive:
            self.metrics.rejected("engine_down")
            raise _Refused(error_response(503, "the engine is restarting", "unavailable", retry_after_s=5))

    def _check_request(self, body: SamplingBody, prompt_ids: list[int], ask: _Ask):
        """(max_tokens, sampling parameters) of a request this server can serve; raises :class:`_Refused`
        (400) otherwise. A request that sets no ``max_tokens`` gets the default, within the context."""
        if body.model != self.model_name:
            raise _Refused(error_response(400, f"the model {body.model!r} is not served here; use "
                                               f"{self.model_name!r}", "invalid_request_error", "model"))
        context = self.service.max_model_len or (len(prompt_ids) + self.config.default_max_tokens)
        max_tokens = ask.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.config.default_max_tokens, context - len(prompt_ids)))
        if body.min_tokens > max_tokens:
            raise _bad(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
        try:
            self.service.check_request(prompt_ids, max_tokens)
        except ValueError as exc:
            raise _bad(str(exc).rstrip("."), "max_tokens" if "max_tokens" in str(exc) else None) from None
        vocab = self.service.info.vocab_size if self.service.info is not None else 0
        sampling = _sampling_params(body, ask, vocab)
        verify = getattr(sampling, "verify", None)  # what depends on the model and on max_tokens
        if verify is not None:
            try:
                verify(vocab, max_tokens)
            except ValueError as exc:
                raise _bad(str(exc).rstrip("."), _named_param(str(exc), ("logit_bias", "stop_token_ids",
                                                                          "min_tokens"))) from None
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
    async def respond(self, http: HttpRequest, body: SamplingBody, prompt_ids: list[int], ask: _Ask) -> Response:
        """Admit an arrival, then answer it whole or, once its first token has come (or every choice
        has ended, maybe refused), as a stream of events."""
        choices, refusal = await self.admit(body, prompt_ids, ask)
        if refusal is not None:
            return refusal
        rid = f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        if not ask.stream:
            return await self.complete(http, choices, rid, ask, prompt_ids)

        def started() -> bool:  # every choice has an answer, or one is generating (the others may queue)
            return (all(c.stream.chunks for c in choices)
                    or any(c.stream.chunks and not c.stream.chunks[0][1] for c in choices))

        try:
            if not await _wait(choices, http, started):  # the client left before the first token
                self._abandon(choices)
                return Response(status_code=499)
        except BaseException:
            self._abandon(choices)
            raise
        for c in choices:  # one that ended before its first token: an error status, not a stream
            if not c.stream.chunks:
                continue
            delta, finished = c.stream.chunks[0][:2]
            bad = _ended_badly(c.stream.result, c.stream, delta) if finished else None
            if bad is not None:
                self._abandon(choices)
                return _error(bad)
        return StreamingResponse(self.sse(choices, rid, ask, prompt_ids), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def complete(self, http: HttpRequest, choices: list[_Choice], rid: str, ask: _Ask,
                       prompt_ids: list[int]) -> Response:
        """The whole answer as one body, once every request has finished."""
        try:
            while not all(c.finished for c in choices):
                if not await _wait(choices, http):
                    return Response(status_code=499)  # the client went away
                for c in choices:
                    if not c.finished and c.stream.chunks:
                        c.read()
                        bad = _ended_badly(c.stream.result, c.stream) if c.finished else None
                        if bad is not None:
                            return _error(bad)
        finally:
            self._abandon(choices)
        usage = _usage([c.stream.result for c in choices])
        if ask.best_of > ask.n:
            choices = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[:ask.n]
        bodies = []
        for index, c in enumerate(choices):
            text = "".join(c.parts)
            if ask.echo is not None:
                text = ask.echo + text
            bodies.append(completion_choice(index, text, _finish_reason(c.stream.result),
                                            self._choice_logprobs(c, ask, prompt_ids), ask.chat))
        return JSONResponse(completion_body(rid, self.model_name, bodies, usage, ask.chat))

    def _choice_logprobs(self, c: _Choice, ask: _Ask, prompt_ids: list[int]) -> dict | None:
        if ask.logprobs is None:
            return None
        if ask.chat:
            return chat_logprobs(c.entries, self.token_text)
        entries = c.entries
        if ask.echo is not None:
            entries = _prompt_entries(prompt_ids, c.prompt_entries) + entries
        return completion_logprobs(entries, self.token_text)

    async def sse(self, choices: list[_Choice], rid: str, ask: _Ask, prompt_ids: list[int]):
        """The answer as server-sent events, ending with ``[DONE]``; the choices' chunks interleave,
        each with its ``index``."""
        events = StreamEvents(rid, self.model_name, ask.chat, ask.include_usage)
        try:
            if ask.chat:
                for c in choices:
                    yield events.chunk(c.index, None, None, role=True)
            while not all(c.finished for c in choices):
                await _wait(choices, None)
                for c in choices:
                    if c.finished or not c.stream.chunks:
                        continue
                    text, entries = c.read()
                    for event in self._choice_events(events, c, ask, prompt_ids, text, entries):
                        yield event
                    if c.finished and _ended_badly(c.stream.result, c.stream) is not None:
                        yield SSE_DONE
                        return
            if ask.include_usage:
                yield events.usage(_usage([c.stream.result for c in choices]))
            yield SSE_DONE
        finally:  # also when the client went away mid-stream: free the KV blocks of the unfinished
            self._abandon(choices)

    def _choice_events(self, events: StreamEvents, c: _Choice, ask: _Ask, prompt_ids: list[int], text: str,
                       entries: list) -> list[str]:
        """The events of what was just read of choice ``c``: the echoed prompt first, its text, and
        at its end the finish (or the error)."""
        out = []
        want = ask.logprobs is not None
        if ask.echo is not None and not c.echoed:
            c.echoed = True
            lps = self._completion_logprobs(c, _prompt_entries(prompt_ids, c.prompt_entries)) if want else None
            out.append(events.chunk(c.index, ask.echo, None, lps))
        if text or (want and entries):
            lps = None
            if want:
                lps = chat_logprobs(entries, self.token_text) if ask.chat else self._completion_logprobs(c, entries)
            out.append(events.chunk(c.index, text, None, lps))
        if c.finished:
            bad = _ended_badly(c.stream.result, c.stream)
            if bad is not None:
                status, kind, message = bad
                out.append(sse_event(error_body(message, kind, status)))
            else:
                out.append(events.chunk(c.index, None, _finish_reason(c.stream.result)))
        return out

    def _completion_logprobs(self, c: _Choice, entries: list) -> dict:
        """The ``logprobs`` of a streamed completion chunk; its text offsets go on from the previous chunk's."""
        lps = completion_logprobs(entries, self.token_text, c.offset)
        if lps["tokens"]:
            c.offset = lps["text_offset"][-1] + len(lps["tokens"][-1])
        return lps

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text (the tokenizer's decode of the one id) and its UTF-8 bytes."""
        known = self._token_texts.get(token_id)
        if known is None:
            decode_bytes = getattr(self.tokenizer, "decode_bytes", None)
            if decode_bytes is not None:  # a byte tokenizer: a token may be part of a character
                raw = decode_bytes([token_id], skip_special_tokens=False)
                known = (raw.decode("utf-8", errors="replace"), list(raw))
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                known = (text, list(text.encode("utf-8", errors="replace")))
            self._token_texts[token_id] = known
        return known


# ---------------------------------------------------------------------------------- helpers
async def _wait(choices: list[_Choice], http: HttpRequest | None, ready: Callable[[], bool] | None = None) -> bool:
    """Wait until ``ready()`` (by default: a chunk waits for an unfinished choice); False if the
    client went away first. Without ``http`` (a stream being sent, whose disconnect the response
    notices itself) it waits without a timer: every stream ends, by the engine or, if the engine
    goes away, by the service."""
    if ready is None:
        def ready() -> bool:
            return any(c.stream.chunks for c in choices if not c.finished)

    event = choices[0].stream.event  # shared by the choices' streams
    while not ready():
        event.clear()
        if ready():
            break
        if http is None:
            await event.wait()
            continue
        try:
            await asyncio.wait_for(event.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return False
    return True


def _refuse_unserved(body: SamplingBody) -> None:
    unserved = body.unserved()
    if unserved is not None:
        param, why = unserved
        raise _bad(why, param)


#: keyword arguments of SamplingParams this engine has (newer parameters may be missing)
_SAMPLING_FIELDS = frozenset(inspect.signature(SamplingParams).parameters)
#: the request parameter each engine parameter comes from, where the names differ
_PARAM_OF = {"prompt_logprobs": "logprobs", "logprobs": "logprobs"}


def _sampling_params(body: SamplingBody, ask: _Ask, vocab_size: int) -> SamplingParams:
    """The engine's sampling parameters of a request; raises :class:`_Refused` (400, naming the
    parameter) for a value the engine refuses or a parameter it does not have."""
    kwargs: dict = dict(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), seed=body.seed,
                        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                        ignore_eos=body.ignore_eos)
    # only what differs from the engine's neutral default, so an engine without a parameter
    # still serves the clients that send it at its default
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_p", 0.0), ("min_tokens", 0), ("include_stop_str_in_output", False)):
        value = getattr(body, name)
        if value is not None and value != neutral:
            kwargs[name] = value
    if body.stop_token_ids:
        if any(t < 0 or t >= vocab_size for t in body.stop_token_ids):
            raise _bad(f"stop_token_ids holds ids outside the vocabulary of {vocab_size}", "stop_token_ids")
        kwargs["stop_token_ids"] = list(body.stop_token_ids)
    if body.logit_bias:
        kwargs["logit_bias"] = _logit_bias(body.logit_bias, vocab_size)
    if ask.logprobs is not None or ask.best_of > ask.n:  # best_of ranks by cumulative logprob
        kwargs["logprobs"] = ask.logprobs or 0
    if ask.echo is not None and ask.logprobs is not None:
        kwargs["prompt_logprobs"] = ask.logprobs
    missing = [name for name in kwargs if name not in _SAMPLING_FIELDS]
    if missing:
        param = "best_of" if missing[0] == "logprobs" and ask.logprobs is None else _PARAM_OF.get(missing[0],
                                                                                                  missing[0])
        raise _bad(f"{param} is not supported by this engine yet", param)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise _bad(str(exc).rstrip("."), _named_param(str(exc), kwargs)) from None


def _named_param(message: str, names) -> str | None:
    """The request parameter an engine's error message names (the longest name it holds)."""
    named = [n for n in sorted(names, key=len, reverse=True) if n in message]
    return _PARAM_OF.get(named[0], named[0]) if named else None


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as string keys) with int keys, each within the vocabulary."""
    out = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise _bad(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise _bad(f"logit_bias holds token id {tid}, outside the vocabulary of {vocab_size}", "logit_bias")
        out[tid] = value
    return out


def _nth_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """The sampling of a completion's ``i``-th choice: a seeded request's choices get seeds of their
    own (seed + i, as vLLM), so they differ yet reproduce."""
    if i == 0 or sampling.seed is None:
        return sampling
    seed = sampling.seed + i if sampling.seed + i < 2**64 else sampling.seed - i
    return dataclasses.replace(sampling, seed=seed)


def _prompt_entries(prompt_ids: list[int], engine_entries: list | None) -> list:
    """The prompt's logprob entries for echo: the first token's logprob is None (it has no context)."""
    engine_entries = engine_entries or []
    out = []
    for i, tid in enumerate(prompt_ids):
        e = engine_entries[i] if 0 < i < len(engine_entries) else None
        out.append((tid, e[1], e[2]) if e is not None else (tid, None, None))
    return out


def _max_bytes_per_token(tokenizer) -> float | None:
    """The most bytes of UTF-8 prompt text one token can stand for (an upper bound), so that a text's
    length bounds its token count from below; None when the tokenizer gives no such bound."""
    decode_bytes = getattr(tokenizer, "decode_bytes", None)
    if decode_bytes is not None:  # the byte tokenizer: a token is at most one byte
        return float(max(len(decode_bytes([i])) for i in range(len(tokenizer)))) or None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if (model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback"))
            or not _keeps_text(spec.get("normalizer")) or not _keeps_text(spec.get("pre_tokenizer"))):
        return None
    longest = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=0)
    # a normalizer may shorten the text: NFKC folds a 4-byte compatibility character into 1 byte
    return float(longest * (4 if spec.get("normalizer") else 1)) or None


#: normalizers and pre-tokenizers that drop no text (a Split that removes its matches, a Strip, a
#: Replace with nothing, BERT's cleaning would)
_TEXT_KEEPING = {"Sequence", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "ByteLevel",
                 "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _keeps_text(part: dict | None) -> bool:
    if part is None:
        return True
    if (part.get("type") not in _TEXT_KEEPING or part.get("behavior") == "Removed"
            or (part.get("type") == "Replace" and not part.get("content"))):
        return False
    return all(_keeps_text(p) for p in part.get("normalizers") or part.get("pretokenizers") or ())


def _usage(results: list[Outcome | None]) -> dict:
    """Token counts of a completion's requests: the prompt once (as OpenAI counts it), every choice's output."""
    prompt = next((r.prompt_len for r in results if r is not None and r.prompt_len), 0)
    return usage_body(prompt, sum(r.completion_tokens for r in results if r is not None))


def _finish_reason(r: Outcome | None) -> str:
    if r is None or r.finish_reason not in ("length", "stop"):
        return "stop"
    return r.finish_reason


def _error(bad: tuple[int, str, str]) -> Response:
    status, kind, message = bad
    return error_response(status, message, kind, retry_after_s=5 if status in (429, 503) else None)


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
