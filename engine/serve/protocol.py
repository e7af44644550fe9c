"""The OpenAI wire format: request bodies, response bodies, server-sent events and error bodies.

Nothing here knows about the engine; :mod:`engine.serve.serving` and :mod:`engine.serve.answer` translate.
Bodies are strict, as OpenAI's are: a ``"stream": "yes"`` or a ``"max_tokens": true`` is a 400, and
so is a field the API does not have. OpenAI's metadata fields (``user``, ``metadata``, ``store``,
...) are accepted and ignored; the parameters of features this server lacks (tools, structural
tags, ``suffix``) are refused by name (:meth:`SamplingBody.unserved`).
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tidegate.ctrl.base import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S
# the engine's own bounds (logprobs, top_logprobs; logprob_token_ids), checked here before a request reaches it
from tidegate.engine.real.sampling import MAX_LOGPROB_TOKEN_IDS, MAX_LOGPROBS

#: The event that ends every stream.
SSE_DONE = "data: [DONE]\n\n"
#: The most choices (``n``, ``best_of``) one request may ask for.
MAX_CHOICES = 16
#: The most prompts one completion may batch (each is ``best_of`` engine requests; the arrival is admitted as a whole).
MAX_PROMPTS = 64
#: the most stop strings a request may give, and the longest one: every generated token of every
#: choice is checked against each of them inside the engine's step, so an unbounded list would let
#: one request slow every other request's tokens (OpenAI takes 4; vLLM sets no bound)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
#: the most ids ``stop_token_ids`` or ``allowed_token_ids`` may list (a vocabulary's size: no list needs more)
MAX_TOKEN_ID_LIST = 1 << 18
#: the most ids those lists may name over every engine request of one arrival (each choice of each prompt is
#: an engine request that carries its own copy)
MAX_TOKEN_IDS_AN_ARRIVAL = 1 << 20
#: A logprob of -inf on the wire (JSON has no infinity), as vLLM writes it.
_MIN_LOGPROB = -9999.0

_STRICT = ConfigDict(strict=True, extra="forbid")
#: a list's items are checked up to the first that fails: a body of millions of bad items is one error, not
#: millions (each of which FastAPI would turn into a dict)
_FAIL_FAST = Field(fail_fast=True)
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


# ---------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = False
    #: usage in every chunk, as vLLM's extension
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks; nothing to obfuscate here


_Ids = Annotated[list[Annotated[int, Field(ge=0)]], _FAIL_FAST]
_Words = Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                   Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]


class SamplingBody(BaseModel):
    """The fields both completion bodies share: the model, the length limit, the sampling settings,
    and vLLM's extensions (every field of vLLM's request models is here: :data:`VLLM_FIELDS` says
    what each does in this server). A ``null`` is taken wherever vLLM takes one, as the default."""

    model_config = _STRICT

    #: None: the served model, as vLLM
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | _Words | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    logit_bias: dict[str, _Bias] | None = None
    # vLLM's sampling parameters beyond OpenAI's
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # vLLM asks only > 0; the bounds keep logits / penalty finite in float32 (a 1e-300 is 0 there)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_tokens: int | None = Field(0, ge=0)
    stop_token_ids: Annotated[_Ids, Field(max_length=MAX_TOKEN_ID_LIST)] | None = None
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False
    allowed_token_ids: Annotated[_Ids, Field(min_length=1, max_length=MAX_TOKEN_ID_LIST)] | None = None
    #: bounded as ``stop`` is: each word is tokenized, and every generated token is checked against them
    bad_words: _Words | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    #: with logprobs: these ids' logprobs at each token, in place of the most likely ones
    logprob_token_ids: Annotated[_Ids, Field(max_length=MAX_LOGPROB_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = True
    #: changes the text of slow (Python) tokenizers only; this server's are fast or bytes, as vLLM's v1
    spaces_between_special_tokens: bool | None = True
    #: keep only this many prompt tokens (-1: as many as the context holds), from ``truncation_side``
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    #: None: the route's default (completions add BOS, chat leaves it to the template)
    add_special_tokens: bool | None = None
    #: lower is earlier; reaches the controller as the request's class
    priority: int | None = 0
    #: the response's id is ``cmpl-<request_id>`` (``chatcmpl-`` for chat), as vLLM
    request_id: str | None = Field(None, min_length=1, max_length=256)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    #: tokens per streamed chunk (the first and the last chunk go at once)
    stream_interval: int | None = Field(None, ge=1)
    # beam search's length penalty: changes nothing without beam search, as in vLLM
    length_penalty: float | None = 1.0
    # structured output (``constraints.structured_output``): OpenAI's, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # refused when set (see unserved)
    use_beam_search: bool | None = False
    watermarking: bool | None = None
    repetition_detection: dict[str, Any] | None = None
    # OpenAI's metadata: accepted, and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's fields that change nothing in this engine (VLLM_FIELDS says why): accepted, and ignored
    session_id: str | None = None
    #: requests with different salts share no cached prefix (a tenant's own salt keeps others from
    #: timing its prompts through the cache)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = Field(None, ge=-1)
    routed_experts_prompt_start: int | None = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] | None = "tensors"
    return_mm_kwargs: bool | None = None

    def unserved(self) -> tuple[str, str] | None:
        """``(parameter, why)`` for a parameter of a feature this server does not serve; None if all are served."""
        for name, tagged in (("response_format", (self.response_format or {}).get("type") == "structural_tag"),
                             ("structured_outputs", (self.structured_outputs or {}).get("structural_tag") is not None)):
            if tagged:
                return name, "structural tags are not served (JSON schemas, JSON objects, regex, choice, grammars are)"
        if self.use_beam_search:
            return "use_beam_search", "beam search is not served"
        if self.watermarking:
            return "watermarking", "watermarking is not served"
        if self.repetition_detection and self.repetition_detection.get("max_pattern_size"):
            return "repetition_detection", "repetition detection is not served"
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:
            return "truncation_side", "truncation_side needs truncate_prompt_tokens"
        return None

    @property
    def choices(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def streamed(self) -> bool:
        return bool(self.stream)


class CompletionBody(SamplingBody):
    #: one prompt (a text or token ids) or a batch of them (texts or token-id lists)
    prompt: (str | Annotated[list[str], Field(min_length=1, fail_fast=True)] | Annotated[_Ids, Field(min_length=1)]
             | Annotated[list[Annotated[_Ids, Field(min_length=1)]], Field(min_length=1, fail_fast=True)])
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    prompt_embeds: Any = None

    def unserved(self) -> tuple[str, str] | None:
        if self.suffix is not None:
            return "suffix", "suffix (text after the insertion point) is not served"
        if self.prompt_embeds is not None:
            return "prompt_embeds", "prompt embeddings (prompt_embeds) are not served"
        if self.best_of is not None and self.best_of < self.choices:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.choices})"
        if self.best_of is not None and self.best_of > 1 and self.stream:
            return "best_of", "best_of cannot be streamed; send stream: false"
        return super().unserved()

def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call of a message with its ``function.arguments`` JSON text as an object (``{}`` when it is empty or no
    JSON object)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
    except ValueError:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


class ChatMessage(BaseModel):
    # Lenient about extra fields: clients send back the assistant messages they were given, with
    # fields (refusal, annotations, audio) that have no meaning in a prompt.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[dict[str, Any]], _FAIL_FAST] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Annotated[list[dict[str, Any]], _FAIL_FAST] | None = None

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
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tool_calls:  # their arguments as objects, as templates take them (vLLM parses them too)
            out["tool_calls"] = [_parsed_arguments(call) for call in self.tool_calls]
        return out


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: Annotated[list[Literal["text"]], _FAIL_FAST] | None = None
    #: the answer begins with the last message's content when that message is the assistant's (vLLM)
    echo: bool | None = False
    # what the chat template is given
    add_generation_prompt: bool | None = True
    #: the last (assistant) message is left open, and the answer goes on from it
    continue_final_message: bool | None = False
    documents: Annotated[list[dict[str, str]], _FAIL_FAST] | None = None
    #: a template for this request only (as vLLM: taken when the server trusts request templates)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: handed to the chat template as ``reasoning_effort``, as vLLM does
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    #: the rendered prompt in the answer (``prompt_text``; streamed: in the first chunk)
    return_prompt_text: bool | None = None
    # what changes nothing for a text model without a reasoning parser (VLLM_FIELDS says why): ignored
    include_reasoning: bool | None = True
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    #: the calls a request forces (``engine.serve.tools``): a named function, or "required"; "auto" is refused
    tools: list[Any] | None = None
    tool_choice: Any = None
    #: with "required": false allows one call only
    parallel_tool_calls: bool | None = None
    # refused when set (see unserved)
    functions: list[Any] | None = None
    function_call: Any = None

    def unserved(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "the legacy functions are not served; send tools"
        if self.function_call not in (None, "none"):
            return "function_call", "the legacy function_call is not served; send tool_choice"
        if not all(m.text_parts_only() for m in self.messages):
            return "messages", "only text content parts are served"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", ("continue_final_message and add_generation_prompt cannot both be "
                                              "true; send add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            return "continue_final_message", "continue_final_message needs the last message to be the assistant's"
        return super().unserved()

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given besides the messages (vLLM's ``chat_template_kwargs``,
        ``documents``, ``reasoning_effort`` and the request's ``tools``)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:
            kwargs["tools"] = self.tools
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


#: What this server does with each field of vLLM's request models (``CompletionRequest``,
#: ``ChatCompletionRequest`` and their ``stream_options``): ``served`` (implemented), ``ignored``
#: (accepted; it changes nothing in this engine, the reason given) or ``refused`` (400 naming the
#: field when set to anything but its neutral value; the README lists these as not served).
#: ``tests/test_vllm_fields.py`` checks it against the installed vLLM's models.
VLLM_FIELDS: dict[str, dict[str, str]] = {
    "both": {
        **dict.fromkeys((
            "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed",
            "stop", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
            "truncate_prompt_tokens", "truncation_side", "allowed_token_ids", "prompt_logprobs", "bad_words",
            "add_special_tokens", "priority", "request_id", "return_tokens_as_token_ids", "return_token_ids",
            "stream_interval", "echo", "stream_options.include_usage", "stream_options.continuous_usage_stats",
            "logprob_token_ids", "cache_salt", "response_format", "structured_outputs",
        ), "served"),
        "user": "ignored: OpenAI's metadata",
        "use_beam_search": "refused: beam search, when true",
        "watermarking": "refused: watermarking, when true",
        "repetition_detection": "refused: repetition detection, when on",
        "length_penalty": "ignored: beam search's; vLLM ignores it without beam search too",
        "spaces_between_special_tokens": "ignored: changes the text of slow tokenizers only, as in vLLM v1",
        "session_id": "ignored: an identity for routers; one replica has nothing to route",
        "kv_transfer_params": "ignored: disaggregated prefill's; no KV connector here",
        "ec_transfer_params": "ignored: encoder-cache transfer's; no connector here",
        "vllm_xargs": "ignored: arguments of custom logits processors; none are installed",
        "thinking_token_budget": "ignored: needs a reasoning parser; none is configured",
        "routed_experts_prompt_start": "ignored: mixture-of-experts routing data; none is returned",
        "return_token_offsets": "ignored: vLLM's render routes only",
        "mm_payload": "ignored: multimodal render data; text only",
        "return_mm_kwargs": "ignored: multimodal render data; text only",
    },
    "completions": {
        "prompt": "served",
        "suffix": "refused: insertion",
        "prompt_embeds": "refused: prompt embeddings",
    },
    "chat": {
        **dict.fromkeys((
            "messages", "top_logprobs", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
            "documents", "chat_template", "chat_template_kwargs", "reasoning_effort", "return_prompt_text",
        ), "served"),
        "parallel_tool_calls": "served",
        "tools": "served",
        "tool_choice": "served: a named function or 'required' (structured output); 'auto' with --tool-call-parser",
        "include_reasoning": "ignored: needs a reasoning parser; none is configured",
        "media_io_kwargs": "ignored: multimodal input; text only",
        "mm_processor_kwargs": "ignored: multimodal input; text only",
    },
}


def vllm_field_handling(route: str, field: str) -> str | None:
    """What :data:`VLLM_FIELDS` says of ``field`` on ``route`` (``completions`` or ``chat``); None if unclassified."""
    return VLLM_FIELDS[route].get(field) or VLLM_FIELDS["both"].get(field)


# ---------------------------------------------------------------------------------- response bodies
#: A token's logprob entry as the engine reports it: ``(token_id, logprob, [(alt_id, alt_logprob), ...])``;
#: the logprob (and the alternatives) are None for a prompt's first token, which has no context. A prompt
#: token's entry also ends with the token's rank in the vocabulary.
Entry = tuple  # (int, float | None, list[tuple[int, float]] | None)
#: ``token_id -> (its text, its UTF-8 bytes)``
TokenText = Callable[[int], tuple[str, list[int]]]


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's ``usage``; with ``cached_tokens``, its ``prompt_tokens_details`` too."""
    body: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


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


def completion_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None, chat: bool,
                      extra: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One choice of a non-streamed completion (``finish_reason``: ``"stop"``, ``"length"`` or ``"tool_calls"``).

    :param extra: vLLM's fields the client asked for (``token_ids``, ``prompt_token_ids``, ``prompt_logprobs``)
    :param tool_calls: chat's calls of the message (``engine.serve.tools``)
    """
    if chat:
        message: dict = {"role": "assistant", "content": text}
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**choice, **extra} if extra else choice


def completion_body(rid: str, model_name: str, choices: list[dict], usage: dict, chat: bool,
                    extra: dict | None = None) -> dict:
    """The body of a non-streamed completion.

    :param rid: the response id (``cmpl-...`` or ``chatcmpl-...``)
    :param model_name: the served model's name
    :param choices: as :func:`completion_choice` gives them
    :param usage: token counts, as :func:`usage_body` gives them
    :param chat: a ``chat.completion`` rather than a ``text_completion``
    :param extra: vLLM's top-level fields the client asked for (chat's ``prompt_token_ids``, ``prompt_text``, ...)
    """
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": usage}
    return {**body, **extra} if extra else body


def prompt_logprobs_body(entries: list[Entry], token: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: for each prompt token, None for the first, else ``{token id: {logprob,
    rank, decoded_token}}`` with the prompt's own token and the alternatives asked for.

    :param entries: ``(token, logprob, alternatives, rank)``, the rank the engine found for the token in the
        whole vocabulary (None with the logprob, for the first token)."""
    out: list[dict | None] = []
    for tid, lp, alts, rank in entries:
        if lp is None:
            out.append(None)
            continue
        ranked = list(alts or ())
        one = {str(tid): {"logprob": _wire_logprob(lp), "rank": rank, "decoded_token": token(tid)[0]}}
        for i, (a, alp) in enumerate(ranked):
            one.setdefault(str(a), {"logprob": _wire_logprob(alp), "rank": i + 1, "decoded_token": token(a)[0]})
        out.append(one)
    return out


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class StreamEvents:
    """Formats the server-sent events of one streamed completion; all share its id and creation time.

    :param rid: the response id (``cmpl-...`` or ``chatcmpl-...``)
    :param model_name: the served model's name
    :param chat: ``chat.completion.chunk`` events rather than ``text_completion`` ones
    :param include_usage: the client asked for ``stream_options.include_usage``
    :param continuous_usage: the client asked for ``stream_options.continuous_usage_stats``: every chunk
        carries the usage so far
    """

    def __init__(self, rid: str, model_name: str, chat: bool, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        self.rid = rid
        self.model_name = model_name
        self.chat = chat
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
              role: bool = False, extra: dict | None = None, top: dict | None = None,
              usage: dict | None = None, delta: dict | None = None) -> str:
        """One chunk of choice ``index``: text with the logprobs of its tokens (or, for chat, the
        opening ``role`` delta, or the closing empty delta).

        :param extra: vLLM's fields of the choice (``token_ids``, ``prompt_token_ids``)
        :param top: vLLM's top-level fields (chat's ``prompt_token_ids``, ``prompt_text``)
        :param usage: the usage so far, sent with ``continuous_usage``
        :param delta: chat's delta itself, in place of the text's (a tool call's)
        """
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if extra:
            choice.update(extra)
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = usage if self.continuous_usage else None
        if top:
            body.update(top)
        return sse_event(body)

    def usage(self, usage: dict) -> str:
        """The last event before ``[DONE]`` when the client asked for usage: no choices, only the counts."""
        return sse_event({"id": self.rid, "object": self.object, "created": self.created, "model": self.model_name,
                          "choices": [], "usage": usage})


# ---------------------------------------------------------------------------------- errors
def error_body(message: str, type_: str = "invalid_request_error", code: int | str = 400,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


#: the names pydantic gives a union's branches in an error's location (``prompt.list[constrained-int].0``)
_BRANCH_NAMES = ("str", "int", "float", "bool", "none")
_BRANCH_PREFIXES = ("constrained-", "list[", "dict[", "tuple[", "set[", "function-", "literal[")


def _is_branch(part) -> bool:
    return isinstance(part, str) and (part in _BRANCH_NAMES or part.startswith(_BRANCH_PREFIXES))


def validation_message(errors) -> tuple[str, str | None]:
    """``(message, parameter)`` of a body that fails its schema: its first field's error, or where that field
    takes one of several forms (a union: ``prompt`` is a text, texts, token ids or lists of them), the error of
    the form that came nearest (a rule it broke, not a type it is not), its location without the form's name; the
    forms it may take where it is none of them."""
    errors = list(errors)
    if not errors:
        return "invalid request", None
    err = errors[0]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if not loc:
        return err.get("msg", "invalid request"), None
    cut = _branch_at(loc)
    forms = []
    if cut:
        for e in errors:
            at = [p for p in e.get("loc", ()) if p != "body"]
            if _branch_at(at) == cut and at[:cut] == loc[:cut]:
                forms.append((e, at))
    if len(forms) > 1:
        where = ".".join(str(p) for p in loc[:cut])
        broken = [(e, at) for e, at in forms if not str(e.get("type", "")).endswith("_type")]
        if not broken:
            names = dict.fromkeys(str(at[cut]).replace("constrained-", "") for _, at in forms)
            return f"{where} must be one of: {', '.join(names)}", str(loc[0])
        err, at = max(broken, key=lambda pair: len(pair[1]))
        loc = [*loc[:cut], *at[cut + 1:]]
    return _described(err, [str(p) for p in loc])


def _branch_at(loc: list) -> int:
    """Where the name of a union's branch stands in an error's location (0: nowhere)."""
    for i, part in enumerate(loc):
        if i and _is_branch(part):
            return i
    return 0


def _described(err: dict, loc: list[str]) -> tuple[str, str | None]:
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


class FieldError(ValueError):
    """A request's field whose value cannot be served; ``param`` names it (the server answers 400 naming it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": retry_after_header(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)
