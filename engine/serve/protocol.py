"""The OpenAI wire format: request bodies, response bodies, server-sent events and error bodies.

Nothing here knows about the engine; :mod:`engine.serve.serving` and :mod:`engine.serve.answer` translate.
Bodies are strict, as OpenAI's are: a ``"stream": "yes"`` or a ``"max_tokens": true`` is a 400, and
so is a field the API does not have. OpenAI's metadata fields (``user``, ``metadata``, ``store``,
...) are accepted and ignored; the parameters of features this server lacks (tools, structured
output, ``suffix``) are refused by name (:meth:`SamplingBody.unserved`).
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tidegate.ctrl.base import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S

#: The event that ends every stream.
SSE_DONE = "data: [DONE]\n\n"
#: The most choices (``n``, ``best_of``) one request may ask for.
MAX_CHOICES = 16
#: The most alternatives per token (``logprobs``, ``top_logprobs``), as vLLM's default ``max_logprobs``.
MAX_LOGPROBS = 20
#: the most stop strings a request may give, and the longest one: every generated token of every
#: choice is checked against each of them inside the engine's step, so an unbounded list would let
#: one request slow every other request's tokens (OpenAI takes 4; vLLM sets no bound)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
#: A logprob of -inf on the wire (JSON has no infinity), as vLLM writes it.
_MIN_LOGPROB = -9999.0

_STRICT = ConfigDict(strict=True, extra="forbid")
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


# ---------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks; nothing to obfuscate here


class SamplingBody(BaseModel):
    """The fields both completion bodies share: the model, the length limit and the sampling settings."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: (Annotated[str, Field(max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)]
           | None) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    logit_bias: dict[str, _Bias] | None = None
    # vLLM's sampling parameters beyond OpenAI's
    top_k: int = Field(0, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # vLLM asks only > 0; the bounds keep logits / penalty finite in float32 (a 1e-300 is 0 there)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # refused when set (see unserved)
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # OpenAI's metadata: accepted, and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def unserved(self) -> tuple[str, str] | None:
        """``(parameter, why)`` for a parameter of a feature this server does not serve; None if all are served."""
        if self.response_format is not None and self.response_format != {"type": "text"}:
            return "response_format", 'only response_format {"type": "text"} is served; structured output is not'
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name, f"guided decoding ({name}) is not served"
        return None


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def unserved(self) -> tuple[str, str] | None:
        if self.suffix is not None:
            return "suffix", "suffix (text after the insertion point) is not served"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
        if self.best_of is not None and self.best_of > 1 and self.stream:
            return "best_of", "best_of cannot be streamed; send stream: false"
        return super().unserved()


class ChatMessage(BaseModel):
    # Lenient about extra fields: clients send back the assistant messages they were given, with
    # fields (refusal, annotations, audio) that have no meaning in a prompt.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text_parts_only(self) -> bool:
        """Whether the content is text (a string, or only ``{"type": "text", "text": ...}`` parts)."""
        if not isinstance(self.content, list):
            return True
        return all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in self.content)

    def turn(self) -> dict[str, Any]:
        """The message as a chat template takes it, its content as one text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p["text"] for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[Literal["text"]] | None = None
    # refused when set (see unserved)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # metadata while no tools are served

    def unserved(self) -> tuple[str, str] | None:
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name, f"tool calling ({name}) is not served"
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                return name, f"tool calling ({name}) is not served"
        if not all(m.text_parts_only() for m in self.messages):
            return "messages", "only text content parts are served"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unserved()


# ---------------------------------------------------------------------------------- response bodies
#: A token's logprob entry as the engine reports it: ``(token_id, logprob, [(alt_id, alt_logprob), ...])``;
#: the logprob (and the alternatives) are None for a prompt's first token, which has no context.
Entry = tuple  # (int, float | None, list[tuple[int, float]] | None)
#: ``token_id -> (its text, its UTF-8 bytes)``
TokenText = Callable[[int], tuple[str, list[int]]]


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(model_name: str, created: int, max_model_len: int | None) -> dict:
    """The body of ``GET /v1/models``: the one model served here."""
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "tidegate", "max_model_len": max_model_len}]}


def _wire_logprob(lp: float | None) -> float | None:
    return None if lp is None else (lp if lp > _MIN_LOGPROB else _MIN_LOGPROB)


def completion_logprobs(entries: list[Entry], token: TokenText, text_offset: int = 0) -> dict:
    """A completion choice's ``logprobs``: the tokens, their logprobs, the alternatives (with the
    chosen token) and where each token starts in the choice's text.

    :param text_offset: where the first of ``entries`` starts (the text sent before it)
    """
    tokens, logprobs, tops, offsets = [], [], [], []
    for tid, lp, alts in entries:
        text = token(tid)[0]
        tokens.append(text)
        logprobs.append(_wire_logprob(lp))
        offsets.append(text_offset)
        text_offset += len(text)
        if lp is None:
            tops.append(None)
            continue
        top = {token(a)[0]: _wire_logprob(alp) for a, alp in alts or ()}
        top.setdefault(text, _wire_logprob(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[Entry], token: TokenText) -> dict:
    """A chat choice's ``logprobs``: each token with its logprob, bytes and alternatives."""
    def one(tid: int, lp: float) -> dict:
        text, raw = token(tid)
        return {"token": text, "logprob": _wire_logprob(lp), "bytes": raw}

    return {"content": [{**one(tid, lp), "top_logprobs": [one(a, alp) for a, alp in alts or ()]}
                        for tid, lp, alts in entries], "refusal": None}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None, chat: bool) -> dict:
    """One choice of a non-streamed completion (``finish_reason``: ``"stop"`` or ``"length"``)."""
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(rid: str, model_name: str, choices: list[dict], usage: dict, chat: bool) -> dict:
    """The body of a non-streamed completion.

    :param rid: the response id (``cmpl-...`` or ``chatcmpl-...``)
    :param model_name: the served model's name
    :param choices: as :func:`completion_choice` gives them
    :param usage: token counts, as :func:`usage_body` gives them
    :param chat: a ``chat.completion`` rather than a ``text_completion``
    """
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": usage}


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class StreamEvents:
    """Formats the server-sent events of one streamed completion; all share its id and creation time.

    :param rid: the response id (``cmpl-...`` or ``chatcmpl-...``)
    :param model_name: the served model's name
    :param chat: ``chat.completion.chunk`` events rather than ``text_completion`` ones
    :param include_usage: the client asked for ``stream_options.include_usage``
    """

    def __init__(self, rid: str, model_name: str, chat: bool, include_usage: bool) -> None:
        self.rid = rid
        self.model_name = model_name
        self.chat = chat
        self.include_usage = include_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
              role: bool = False) -> str:
        """One chunk of choice ``index``: text with the logprobs of its tokens (or, for chat, the
        opening ``role`` delta, or the closing empty delta)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse_event(body)

    def usage(self, usage: dict) -> str:
        """The last event before ``[DONE]`` when the client asked for usage: no choices, only the counts."""
        return sse_event({"id": self.rid, "object": self.object, "created": self.created, "model": self.model_name,
                          "choices": [], "usage": usage})


# ---------------------------------------------------------------------------------- errors
def error_body(message: str, type_: str = "invalid_request_error", code: int | str = 400,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(err: dict) -> tuple[str, str | None]:
    """``(message, parameter)`` of the first error of a body that fails its schema."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if not loc:
        return err.get("msg", "invalid request"), None
    param, where = loc[0], ".".join(loc)
    kind, ctx, got = err.get("type"), err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden" and len(loc) == 1:
        return f"unknown parameter: {param}", param
    bounds = {"greater_than_equal": ("at least", "ge"), "greater_than": ("above", "gt"),
              "less_than_equal": ("at most", "le"), "less_than": ("below", "lt")}
    if kind in bounds:
        words, key = bounds[kind]
        return f"{where} must be {words} {ctx.get(key)}, got {got!r}", param
    return f"{where}: {err.get('msg', 'invalid')}", param


def retry_after_header(seconds: float) -> str:
    """Whole seconds within [``RETRY_AFTER_MIN_S``, ``RETRY_AFTER_MAX_S``] (a NaN or non-number: the minimum)."""
    try:
        wait = float(seconds)
    except (TypeError, ValueError):
        wait = RETRY_AFTER_MIN_S
    if not wait >= RETRY_AFTER_MIN_S:
        wait = RETRY_AFTER_MIN_S
    return str(int(math.ceil(min(wait, RETRY_AFTER_MAX_S))))


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": retry_after_header(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)
