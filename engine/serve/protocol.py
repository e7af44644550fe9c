"""The OpenAI wire format: request bodies, response bodies, server-sent events and error bodies.

Nothing here knows about the engine; the route handlers in :mod:`engine.serve.app` translate.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ctrl.base import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S

#: The event that ends every stream.
SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    """The fields both completion bodies share: the model, the length limit and the sampling settings."""

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


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


# ---------------------------------------------------------------------------------- response bodies
def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(model_name: str, created: int, max_model_len: int | None) -> dict:
    """The body of ``GET /v1/models``: the one model served here."""
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "tidegate", "max_model_len": max_model_len}]}


def completion_body(rid: str, model_name: str, text: str, finish_reason: str, usage: dict, chat: bool) -> dict:
    """The body of a non-streamed completion.

    :param rid: the response id (``cmpl-...`` or ``chatcmpl-...``)
    :param model_name: the served model's name
    :param text: the whole generated text
    :param finish_reason: ``"stop"`` or ``"length"``
    :param usage: token counts, as :func:`usage_body` gives them
    :param chat: a ``chat.completion`` rather than a ``text_completion``
    """
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice],
            "usage": usage}


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

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> str:
        """One chunk of text (or, for chat, the opening ``role`` delta, or the closing empty delta)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
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
