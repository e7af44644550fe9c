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
    prompt_logprobs_body,
    error_response,
    sse_event,
    usage_body,
)
from tidegate.engine.serve.service import Stream
from tidegate.engine.serve.tools import ParsedTools, new_call_id

if TYPE_CHECKING:
    from tidegate.engine.serve.arrival import Ask
    from tidegate.engine.serve.service import EngineService


class Choice:
    """One engine request of a completion, and what has been read of it.

    :param index: its place among the completion's engine requests (``best_of`` per prompt, in prompt order)
    :param stream: its stream of events
    :param prompt: which of the completion's prompts it answers
    :param prompt_ids: that prompt's token ids
    :param echo: the text put before its own (the echoed prompt), or None
    """

    __slots__ = ("index", "stream", "prompt", "prompt_ids", "echo", "parts", "entries", "prompt_entries",
                 "token_ids", "finished", "offset", "started", "sent_tokens", "call_id", "held", "sent_text")

    def __init__(self, index: int, stream: Stream, prompt: int = 0, prompt_ids: list[int] | None = None,
                 echo: str | None = None) -> None:
        self.index = index
        self.stream = stream
        self.prompt = prompt
        self.prompt_ids = prompt_ids or []
        self.echo = echo
        self.parts: list[str] = []
        self.entries: list = []
        self.prompt_entries: list | None = None
        self.token_ids: list[int] = []
        self.finished = False
        #: the next token's ``text_offset``: the token texts sent before it (as the whole answer counts them)
        self.offset = 0
        #: its first chunk was sent (the echoed prompt, when asked for, goes in it)
        self.started = False
        #: tokens already streamed
        self.sent_tokens = 0
        #: a streamed named tool call's id (None: not begun); a streamed required call's text so far
        self.call_id: str | None = None
        self.held: list[str] = []
        #: of a streamed answer whose calls wait: the characters of its text already sent before them
        self.sent_text = 0

    def read(self, most: int | None = None) -> tuple[str, list, list[int]]:
        """Take the chunks waiting (at most ``most`` of them): returns their text, logprob entries and
        token ids (also kept)."""
        text: list[str] = []
        entries: list = []
        ids: list[int] = []
        chunks = self.stream.chunks
        while chunks and not self.finished and (most is None or len(text) < most):
            chunk = chunks.popleft()
            self.finished = chunk.finished
            text.append(chunk.delta)
            ids.extend(chunk.token_ids)
            if chunk.logprobs:
                entries.extend(chunk.logprobs)
            if chunk.prompt_logprobs is not None:
                self.prompt_entries = chunk.prompt_logprobs
        joined = "".join(text)
        self.parts.append(joined)
        self.entries.extend(entries)
        self.token_ids.extend(ids)
        return joined, entries, ids

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
        #: usage carries ``prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``)
        self.details = bool(getattr(getattr(service, "config", None), "enable_prompt_tokens_details", False))
        self._token_texts: dict[int, tuple[str, list[int]]] = {}

    async def respond(self, http: HttpRequest, choices: list[Choice], ask: Ask,
                      prompts: list[tuple[list[int], str | None]]) -> Response:
        """Answer admitted choices whole or, once their first token has come (or every choice has
        ended, maybe refused), as a stream of events."""
        rid = f"{'chatcmpl' if ask.chat else 'cmpl'}-{ask.request_id or uuid.uuid4().hex}"
        if not ask.stream:
            return await self.complete(http, choices, rid, ask, prompts)

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
        return StreamingResponse(self.sse(choices, rid, ask), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def complete(self, http: HttpRequest, choices: list[Choice], rid: str, ask: Ask,
                       prompts: list[tuple[list[int], str | None]]) -> Response:
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
        usage = _usage(choices, self.details)
        bodies = []
        for p in range(len(prompts)):
            ranked = [c for c in choices if c.prompt == p]
            if ask.best_of > ask.n:
                ranked = sorted(ranked, key=lambda c: c.cumulative_logprob, reverse=True)[:ask.n]
            for k, c in enumerate(ranked):
                generated = "".join(c.parts)
                text = (c.echo or "") + generated
                finish = _finish_reason(c.stream.result)
                calls = None
                parsed = isinstance(ask.tools, ParsedTools)  # auto: the model's calls are read whatever ended it
                if ask.tools is not None and (finish == "stop" or ask.tools.name is not None or parsed):
                    content, calls = ask.tools.answer(generated)
                    if calls:  # the calls take their text out of the answer's, as vLLM answers them; the echo stays
                        text = (c.echo or "") + content
                        if parsed or (ask.tools.name is None and finish == "stop"):
                            finish = "tool_calls"
                bodies.append(completion_choice(p * ask.n + k, text if text or not (parsed and calls) else None,
                                                finish, self._choice_logprobs(c, ask), ask.chat,
                                                self._choice_extra(c, ask), tool_calls=calls or None))
        return JSONResponse(completion_body(rid, self.model_name, bodies, usage, ask.chat,
                                            self._top_extra(choices[0], ask, whole=True)))

    def _choice_extra(self, c: Choice, ask: Ask) -> dict | None:
        """vLLM's fields of a whole choice: ``token_ids`` and, for completions, ``prompt_token_ids``
        and ``prompt_logprobs``."""
        extra: dict = {}
        if ask.return_token_ids:
            extra["token_ids"] = list(c.token_ids)
            if not ask.chat:
                extra["prompt_token_ids"] = list(c.prompt_ids)
        if not ask.chat and ask.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self._prompt_logprobs(c, ask)
        return extra

    def _top_extra(self, c: Choice, ask: Ask, whole: bool) -> dict | None:
        """vLLM's top-level fields of a chat answer: the prompt's ids, logprobs and text."""
        if not ask.chat:
            return None
        extra: dict = {}
        if ask.return_token_ids:
            extra["prompt_token_ids"] = list(c.prompt_ids)
        if ask.prompt_logprobs is not None and whole:
            extra["prompt_logprobs"] = self._prompt_logprobs(c, ask)
        if ask.prompt_text is not None:
            extra["prompt_text"] = ask.prompt_text
        return extra

    def _prompt_logprobs(self, c: Choice, ask: Ask) -> list:
        """vLLM's ``prompt_logprobs`` of the choice's prompt; ``decoded_token`` is the token's text (vLLM's
        detokenizer writes it, whatever ``return_tokens_as_token_ids`` says of the answer's logprobs)."""
        entries = _prompt_entries(c.prompt_ids, c.prompt_entries, ranks=True)
        top = ask.prompt_logprobs or 0
        return prompt_logprobs_body([(t, lp, (alts or [])[:top], rank) for t, lp, alts, rank in entries],
                                    self.token_text)

    def _choice_logprobs(self, c: Choice, ask: Ask) -> dict | None:
        if ask.logprobs is None:
            return None
        if ask.chat:
            return chat_logprobs(c.entries, self._namer(ask))
        entries = c.entries
        if c.echo is not None:
            entries = _prompt_entries(c.prompt_ids, c.prompt_entries) + entries
        return completion_logprobs(entries, self._namer(ask))

    async def sse(self, choices: list[Choice], rid: str, ask: Ask):
        """The answer as server-sent events, ending with ``[DONE]``; the choices' chunks interleave,
        each with its ``index``. A chunk per engine event (a token, as vLLM streams them), or per
        ``stream_interval`` tokens after the first."""
        events = StreamEvents(rid, self.model_name, ask.chat, ask.include_usage, ask.continuous_usage)

        # a chunk to send, not merely one waiting: waiting for the latter, a chunk held back for its
        # interval would have the loop spin, holding the event loop, until the interval's tokens came
        def due() -> bool:
            return any(not c.finished and _due(c, ask.stream_interval) for c in choices)

        try:
            if ask.chat:
                for c in choices:
                    top = self._top_extra(c, ask, whole=False) if c is choices[0] else None
                    yield events.chunk(c.index, None, None, role=True, top=top, usage=_choice_usage(c, ask))
            while not all(c.finished for c in choices):
                await _wait(choices, None, due)
                for c in choices:
                    while not c.finished and _due(c, ask.stream_interval):
                        # the first chunk alone, then at most an interval's events a chunk, though
                        # more wait when the client reads slowly: chunks keep the size asked for
                        text, entries, ids = c.read(1 if c.sent_tokens == 0 else ask.stream_interval)
                        for event in self._choice_events(events, c, ask, text, entries, ids):
                            yield event
                        if c.finished and _ended_badly(c.stream.result, c.stream) is not None:
                            yield SSE_DONE
                            return
            if ask.include_usage:
                yield events.usage(_usage(choices, self.details))
            yield SSE_DONE
        finally:  # also when the client went away mid-stream: free the KV blocks of the unfinished
            abandon(self.service, choices)

    def _choice_events(self, events: StreamEvents, c: Choice, ask: Ask, text: str, entries: list,
                       ids: list[int]) -> list[str]:
        """The events of what was just read of choice ``c``: the echoed prompt first, its text, and
        at its end the finish (or the error)."""
        out = []
        want = ask.logprobs is not None
        first = not c.started
        if c.echo is not None and not c.started:
            lps = None
            if want and not ask.chat:
                lps = self._completion_logprobs(c, _prompt_entries(c.prompt_ids, c.prompt_entries), ask)
            out.append(events.chunk(c.index, c.echo, None, lps, extra=self._first_extra(c, ask),
                                    usage=_choice_usage(c, ask)))
            first = False
        c.started = True
        c.sent_tokens += len(ids)
        if ask.tools is not None:
            return out + self._tool_events(events, c, ask, text, entries, ids)
        if text or ids or (want and entries):
            lps = None
            if want:
                lps = (chat_logprobs(entries, self._namer(ask)) if ask.chat
                       else self._completion_logprobs(c, entries, ask))
            extra = self._first_extra(c, ask) if first else {}
            if ask.return_token_ids:
                extra["token_ids"] = list(ids)
            out.append(events.chunk(c.index, text, None, lps, extra=extra, usage=_choice_usage(c, ask)))
        if c.finished:
            bad = _ended_badly(c.stream.result, c.stream)
            if bad is not None:
                status, kind, message = bad
                out.append(sse_event(error_body(message, kind, status)))
            else:
                out.append(events.chunk(c.index, None, _finish_reason(c.stream.result),
                                        usage=_choice_usage(c, ask)))
        return out

    def _tool_events(self, events: StreamEvents, c: Choice, ask: Ask, text: str, entries: list,
                     ids: list[int]) -> list[str]:
        """The events of a forced tool call: a named call's arguments as they come (its id and name in the first),
        the calls of "required" whole at the end (their text is one JSON array until then); text again where the
        output is no whole call (cut short)."""
        assert ask.tools is not None
        out = []
        lps = chat_logprobs(entries, self._namer(ask)) if ask.logprobs is not None and entries else None
        extra = {"token_ids": list(ids)} if ask.return_token_ids else {}
        named = ask.tools.name
        if named is not None and text:
            first = c.call_id is None
            c.call_id = c.call_id or new_call_id()
            call: dict = {"index": 0, "function": {"arguments": text}}
            if first:
                call.update(id=c.call_id, type="function")
                call["function"] = {"name": named, "arguments": text}
            out.append(events.chunk(c.index, None, None, lps, extra=extra, usage=_choice_usage(c, ask),
                                    delta={"tool_calls": [call]}))
        else:
            sent = ""
            if named is None:  # calls wait until they are whole; text before them streams (auto's)
                c.held.append(text)
                if isinstance(ask.tools, ParsedTools):
                    so_far = "".join(c.held)
                    upto = ask.tools.sendable(so_far)
                    sent, c.sent_text = so_far[c.sent_text:upto], max(c.sent_text, upto)
            if sent or lps or (extra and ids):
                out.append(events.chunk(c.index, sent or None, None, lps, extra=extra, usage=_choice_usage(c, ask),
                                        delta={"content": sent} if sent else {}))
        if not c.finished:
            return out
        bad = _ended_badly(c.stream.result, c.stream)
        if bad is not None:
            status, kind, message = bad
            return out + [sse_event(error_body(message, kind, status))]
        finish = _finish_reason(c.stream.result)
        if named is None:
            held = "".join(c.held)
            readable = finish == "stop" or isinstance(ask.tools, ParsedTools)
            content, calls = ask.tools.answer(held) if readable else (held, None)
            if content[c.sent_text:]:
                out.append(events.chunk(c.index, content[c.sent_text:], None, usage=_choice_usage(c, ask)))
            if calls and finish == "stop":  # streamed, vLLM turns a stop into tool_calls; cut short, it stays length
                finish = "tool_calls"
            if calls:
                out.append(events.chunk(c.index, None, None, usage=_choice_usage(c, ask), delta={
                    "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}))
        out.append(events.chunk(c.index, None, finish, usage=_choice_usage(c, ask)))
        return out

    def _first_extra(self, c: Choice, ask: Ask) -> dict:
        """What a completion choice's first chunk carries besides its text: its prompt's ids."""
        return {"prompt_token_ids": list(c.prompt_ids)} if ask.return_token_ids and not ask.chat else {}

    def _completion_logprobs(self, c: Choice, entries: list, ask: Ask) -> dict:
        """The ``logprobs`` of a streamed completion chunk; its text offsets go on from the previous chunk's."""
        lps = completion_logprobs(entries, self._namer(ask), c.offset)
        if lps["tokens"]:
            c.offset = lps["text_offset"][-1] + len(lps["tokens"][-1])
        return lps

    def _namer(self, ask: Ask) -> Callable[[int], tuple[str, list[int]]]:
        """How logprobs name a token: its text, or ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)."""
        return _token_as_id if ask.tokens_as_ids else self.token_text

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


def _token_as_id(token_id: int) -> tuple[str, list[int]]:
    text = f"token_id:{token_id}"
    return text, list(text.encode())


def _due(c: Choice, interval: int) -> bool:
    """Whether choice ``c`` has a chunk to send: anything waiting for its first, then ``interval``
    tokens' events, or its end (vLLM's ``stream_interval``: the first and last chunks go at once);
    also once half its buffer waits, whatever the interval, since a full buffer ends the stream as
    a slow client's."""
    if not c.stream.chunks:
        return False
    if interval <= 1 or c.sent_tokens == 0:
        return True
    # a copy: the service's reader thread appends to the deque while this runs, and a generator
    # over the deque itself would see it change ("deque mutated during iteration")
    chunks = tuple(c.stream.chunks)
    if any(ch.finished for ch in chunks):
        return True
    return sum(len(ch.token_ids) for ch in chunks) >= interval or 2 * len(chunks) >= c.stream.limit


def _choice_usage(c: Choice, ask: Ask) -> dict | None:
    """The usage of one choice so far, for a client that asked for it in every chunk
    (``continuous_usage_stats``); None otherwise."""
    return usage_body(len(c.prompt_ids), len(c.token_ids)) if ask.continuous_usage else None


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


def _prompt_entries(prompt_ids: list[int], engine_entries: list | None, ranks: bool = False) -> list:
    """The prompt's logprob entries ``(token, logprob, alternatives)``, for echo: the first token's logprob is
    None (it has no context). ``ranks``: each entry ends with the token's rank in the vocabulary (None with
    the logprob)."""
    engine_entries = engine_entries or []
    out = []
    for i, tid in enumerate(prompt_ids):
        e = engine_entries[i] if 0 < i < len(engine_entries) else None
        entry = (tid, e[1], e[2]) if e is not None else (tid, None, None)
        if ranks:
            entry += (e[3] if e is not None else None,)
        out.append(entry)
    return out


def _usage(choices: list[Choice], details: bool = False) -> dict:
    """Token counts of a completion's requests: each prompt once (as OpenAI and vLLM count them), every
    choice's output; with ``details``, each prompt's cached tokens once (its first choice's)."""
    prompts = {c.prompt: len(c.prompt_ids) for c in choices}
    results = [c.stream.result for c in choices]
    cached = None
    if details:
        first: dict[int, int] = {}
        for c in choices:
            if c.stream.result is not None:
                first.setdefault(c.prompt, c.stream.result.cached_tokens)
        cached = sum(first.values())
    return usage_body(sum(prompts.values()), sum(r.completion_tokens for r in results if r is not None), cached)


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
