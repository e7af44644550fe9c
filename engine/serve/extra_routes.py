"""The routes vLLM serves beside the OpenAI API: ``GET /version``, ``POST /tokenize`` and
``POST /detokenize``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from tidegate.engine.serve.arrival import Refused
from tidegate.engine.serve.protocol import ChatMessage, error_response

if TYPE_CHECKING:
    from tidegate.engine.serve.config import ServeConfig
    from tidegate.engine.serve.serving import OpenAIServing


def package_version() -> str:
    """The installed tidegate's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tidegate")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# ---------------------------------------------------------------------------------- bodies
class TokenizeBody(BaseModel):
    """A prompt, or chat messages rendered with the chat template, as vLLM's ``/tokenize`` takes them."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    #: BOS and the like; None: added to a prompt, not to messages (their template writes its own)
    add_special_tokens: bool | None = None
    #: also the tokens as the tokenizer writes them (``token_strs``), as vLLM answers
    return_token_strs: bool = False
    #: the tools a chat's template is given, as the chat route gives them
    tools: list[Any] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------- routes
def add_extra_routes(app: FastAPI, serving: OpenAIServing, config: ServeConfig) -> None:
    """``/version``, ``/tokenize`` and ``/detokenize`` on ``app``.

    :param app: the application
    :param serving: the OpenAI routes' server (the engine service, its tokenizer, vocabulary and
        context length, and the prompt checks the completion routes make)
    :param config: the server settings (the served model's name, the chat template)
    """
    version = package_version()
    service = serving.service

    @app.get("/version")
    async def get_version():
        return {"version": version}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        if body.model is not None and body.model != config.model_name:
            return _unknown_model(body.model, config)
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "give exactly one of prompt or messages", param="prompt")
        try:
            ids = await asyncio.to_thread(_token_ids, serving, body)
        except Refused as refused:
            return refused.response
        answer = {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = await asyncio.to_thread(_token_strs, service.tokenizer, ids)
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        if body.model is not None and body.model != config.model_name:
            return _unknown_model(body.model, config)
        vocab = service.info.vocab_size if service.info is not None else len(service.tokenizer)
        outside = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if outside is not None:
            return error_response(400, f"the token id {outside} is outside the vocabulary of {vocab}", param="tokens")
        text = await asyncio.to_thread(service.tokenizer.decode, body.tokens)
        return {"prompt": text}


def _unknown_model(model: str, config: ServeConfig):
    return error_response(400, f"the model {model!r} is not served here; use {config.model_name!r}", param="model")


def _token_ids(serving: OpenAIServing, body: TokenizeBody) -> list[int]:
    """The ids the completion routes would serve for this prompt or these messages; raises
    :class:`Refused` (400) for what they would refuse before tokenizing: text that is not valid
    Unicode, or that has more tokens than the model's context holds (a text of any length would
    otherwise cost the server its tokenization and an answer four times its size)."""
    if body.messages is not None:
        return serving.chat_prompt_ids(body.messages, body.add_generation_prompt, body.add_special_tokens,
                                       tools=body.tools)
    return serving.encode(body.prompt or "", body.add_special_tokens is not False, "prompt")


def _token_strs(tokenizer, ids: list[int]) -> list[str]:
    """The tokens as the tokenizer writes them (its ``convert_ids_to_tokens``; a tokenizer without it: each
    token decoded alone)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return [str(t) for t in convert(ids)]
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
