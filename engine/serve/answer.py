"""The answer to an admitted completion: whole or streamed, its choices merged, its logprobs shaped.

Each choice is one engine request; a :class:`Choice` keeps what has been read of its stream.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Callable

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tidegate.engine.core.request import RequestState
from tidegate.engine.serve.messages import Outcome
from tidegate.engine.serve.protocol import (
    SSE_DONE,
    StreamEvents,
    chat_logprobs,
    completion_body,
    completion_choice,
    completion_logprobs,
    error_body,
    error_response,
    sse_event,
    usage_body,
)
from tidegate.engine.serve.service import Stream

if TYPE_CHECKING:
    from tidegate.engine.serve.arrival import Ask
    from tidegate.engine.serve.service import EngineService


class Choice:
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
            chunk = chunks.popleft()
            self.finished = chunk.finished
            text.append(chunk.delta)
            if chunk.logprobs:
                entries.extend(chunk.logprobs)
            if chunk.prompt_logprobs is not None:
                self.prompt_entries = chunk.prompt_logprobs
        joined = "".join(text)
        self.parts.append(joined)
        self.entries.extend(entries)
        return joined, entries

    @property
    def cumulative_logprob(self) -> float:
        return sum(e[1] for e in self.entries)


def abandon(service: EngineService, choices: list[Choice]) -> None:
    """Cancel the requests of choices not read to their end, and release them all."""
    for c in choices:
        if not c.finished:
            service.cancel(c.stream)
        service.done(c.stream)


class AnswerWriter:
    """The answer to admitted choices: one body once all have finished, or server-sent events as
    their text comes.

    :param service: the running engine service
    :param tokenizer: the served model's tokenizer, for the text of a logprob's token
    :param model_name: the model name the answer carries
    """

    def __init__(self, service: EngineService, tokenizer, model_name: str) -> None:
        self.service = service
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._token_texts: dict[int, tuple[str, list[int]]] = {}

    async def respond(self, http: HttpRequest, choices: list[Choice], ask: Ask, prompt_ids: list[int]) -> Response:
        """Answer admitted choices whole or, once their first token has come (or every choice has
        ended, maybe refused), as a stream of events."""
        rid = f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        if not ask.stream:
            return await self.complete(http, choices, rid, ask, prompt_ids)

        def started() -> bool:  # every choice has an answer, or one is generating (the others may queue)
            return (all(c.stream.chunks for c in choices)
                    or any(c.stream.chunks and not c.stream.chunks[0].finished for c in choices))

        try:
            if not await _wait(choices, http, started):  # the client left before the first token
                abandon(self.service, choices)
                return Response(status_code=499)
        except BaseException:
            abandon(self.service, choices)
            raise
        for c in choices:  # one that ended before its first token: an error status, not a stream
            if not c.stream.chunks:
                continue
            first = c.stream.chunks[0]
            bad = _ended_badly(c.stream.result, c.stream, first.delta) if first.finished else None
            if bad is not None:
                abandon(self.service, choices)
                return _error(bad)
        return StreamingResponse(self.sse(choices, rid, ask, prompt_ids), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def complete(self, http: HttpRequest, choices: list[Choice], rid: str, ask: Ask,
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
            abandon(self.service, choices)
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

    def _choice_logprobs(self, c: Choice, ask: Ask, prompt_ids: list[int]) -> dict | None:
        if ask.logprobs is None:
            return None
        if ask.chat:
            return chat_logprobs(c.entries, self.token_text)
        entries = c.entries
        if ask.echo is not None:
            entries = _prompt_entries(prompt_ids, c.prompt_entries) + entries
        return completion_logprobs(entries, self.token_text)

    async def sse(self, choices: list[Choice], rid: str, ask: Ask, prompt_ids: list[int]):
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
            abandon(self.service, choices)

    def _choice_events(self, events: StreamEvents, c: Choice, ask: Ask, prompt_ids: list[int], text: str,
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

    def _completion_logprobs(self, c: Choice, entries: list) -> dict:
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


async def _wait(choices: list[Choice], http: HttpRequest | None, ready: Callable[[], bool] | None = None) -> bool:
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


def _prompt_entries(prompt_ids: list[int], engine_entries: list | None) -> list:
    """The prompt's logprob entries for echo: the first token's logprob is None (it has no context)."""
    engine_entries = engine_entries or []
    out = []
    for i, tid in enumerate(prompt_ids):
        e = engine_entries[i] if 0 < i < len(engine_entries) else None
        out.append((tid, e[1], e[2]) if e is not None else (tid, None, None))
    return out


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
        limit = r.finish_reason or "queue timeout"
        return 503, "queue_timeout", f"the request waited past the {limit} without starting"
    if r.state is RequestState.REJECTED:
        return 429, "rate_limited", r.finish_reason or "rejected"
    if r.unavailable:
        return 503, "engine_unavailable", r.finish_reason or "the engine went away"
    if r.state is RequestState.CANCELLED:
        return 499, "cancelled", "the request was cancelled"
    return 500, "engine_error", r.finish_reason or "the engine failed this request"
