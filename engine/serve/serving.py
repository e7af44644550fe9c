"""The arrival of a completion: its prompt tokenized and checked, the request checked, admitted
and fanned out into one engine request per choice.

The HTTP side never runs engine code. An arrival is checked and decided on at once (a twin of the
controller's ``admit`` on the engine's latest snapshot), so a refused request gets its 429 without
queueing; an accepted one is handed to the engine process through a pipe, and its text comes back
through a bounded per-stream buffer.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from tidegate.engine.serve.answer import AnswerWriter, Choice, abandon
from tidegate.engine.serve.arrival import (
    Ask,
    Refused,
    bad_request,
    named_param,
    nth_sampling,
    refuse_unserved,
    sampling_params,
)
from tidegate.engine.serve.constraints import structured_field, wants_structured_output
from tidegate.engine.real.structured import check_grammar, grammar_tokenizer
from tidegate.engine.serve.chat import chat_prompt
from tidegate.engine.serve.protocol import (
    MAX_PROMPTS,
    MAX_TOKEN_IDS_AN_ARRIVAL,
    ChatBody,
    ChatMessage,
    CompletionBody,
    FieldError,
    SamplingBody,
    error_response,
)
from tidegate.engine.serve.service import EngineService, EngineUnavailable, Stream
from tidegate.engine.serve.tools import ForcedTools, forced_tools

if TYPE_CHECKING:
    from tidegate.engine.real.sampling import SamplingParams
    from tidegate.engine.serve.config import ServeConfig


class OpenAIServing:
    """What the completion routes share: admission of an arrival, then its streamed or whole answer
    (written by :class:`engine.serve.answer.AnswerWriter`).

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
        self._llg_tokenizer = None  # the tokenizer as llguidance reads it, for structured output
        self.answers = AnswerWriter(service, self.tokenizer, self.model_name)

    # -- the two routes
    async def create_completion(self, body: CompletionBody, http: HttpRequest) -> Response:
        try:
            refuse_unserved(body)
            prompts = await asyncio.to_thread(self._completion_prompts, body)
        except Refused as refused:
            return refused.response
        ask = Ask.of(body, False, body.max_tokens, best_of=body.best_of or body.choices, logprobs=body.logprobs,
                     echo=bool(body.echo))
        return await self.respond(http, body, prompts, ask)

    async def create_chat_completion(self, body: ChatBody, http: HttpRequest) -> Response:
        try:
            refuse_unserved(body)
            if body.chat_template is not None and not self.config.trust_request_chat_template:
                raise bad_request("a chat_template in the request is taken only when the server runs with "
                                  "--trust-request-chat-template", "chat_template")
            try:
                tools = forced_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                     self.config.tool_call_parser if self.config.enable_auto_tool_choice else None)
            except FieldError as exc:
                raise bad_request(str(exc), exc.param) from None
            ids, text = await asyncio.to_thread(self._chat_prompt, body)
        except Refused as refused:
            return refused.response
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        last = body.messages[-1]
        # vLLM's chat echo: the answer begins with the last message when it is the assistant's own
        echo = last.turn()["content"] if body.echo and last.role == "assistant" else None
        ask = Ask.of(body, True, max_tokens, best_of=body.choices,
                     logprobs=(body.top_logprobs or 0) if body.logprobs else None, echo=echo is not None,
                     prompt_text=text if body.return_prompt_text else None, tools=tools)
        return await self.respond(http, body, [(ids, echo)], ask)

    # -- prompts (run off the event loop)
    def _completion_prompts(self, body: CompletionBody) -> list[tuple[list[int], str | None]]:
        """(token ids, text when echoed) of each of a completion's prompts; raises :class:`Refused`
        for one that is not served."""
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request are served, got {len(batch)}", "prompt")
        return [self._completion_prompt(p, body) for p in batch]

    def _completion_prompt(self, prompt, body: CompletionBody) -> tuple[list[int], str | None]:
        """(token ids, text when echoed) of one of a completion's prompts."""
        echo, special, truncate = bool(body.echo), body.add_special_tokens is not False, body.truncate_prompt_tokens
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", "prompt")
            ids = self._truncated(self.encode(prompt, special, "prompt", check_length=truncate is None), body)
            return ids, (prompt if truncate is None else self.tokenizer.decode(ids)) if echo else None
        ids = self._truncated(list(prompt), body)
        vocab = self.service.info.vocab_size if self.service.info is not None else None
        if vocab is not None and any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"the prompt holds token ids outside the vocabulary of {vocab}", "prompt")
        return ids, self.tokenizer.decode(ids, skip_special_tokens=True) if echo else None

    def _truncated(self, ids: list[int], body: SamplingBody) -> list[int]:
        """The prompt's ids cut to vLLM's ``truncate_prompt_tokens`` (-1: the context), keeping the last
        ones unless ``truncation_side`` is ``right``."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == -1:
            keep = self.service.max_model_len or len(ids)
        if keep >= len(ids):
            return ids
        if keep == 0:
            raise bad_request("truncate_prompt_tokens 0 leaves no prompt", "truncate_prompt_tokens")
        return ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep:]

    def _chat_prompt(self, body: ChatBody) -> tuple[list[int], str]:
        """(token ids, text) of a chat's prompt, rendered with the request's template settings."""
        ids, text = self._render_chat(body.messages, body.chat_template, body.add_generation_prompt is not False,
                                      bool(body.continue_final_message), body.template_kwargs(),
                                      body.add_special_tokens, check_length=body.truncate_prompt_tokens is None)
        return self._truncated(ids, body), text

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        add_special_tokens: bool | None = None, tools: list | None = None) -> list[int]:
        """The token ids of the conversation, as ``/tokenize`` gives them (:meth:`_render_chat`), the ``tools``
        given to its template as the chat route gives them."""
        return self._render_chat(messages, None, add_generation_prompt, template_kwargs={"tools": tools} if tools
                                 else None, add_special_tokens=add_special_tokens)[0]

    def _render_chat(self, messages: list[ChatMessage], chat_template: str | None, add_generation_prompt: bool,
                     continue_final_message: bool = False, template_kwargs: dict | None = None,
                     add_special_tokens: bool | None = None, check_length: bool = True) -> tuple[list[int], str]:
        """(token ids, text) of a conversation (:func:`engine.serve.chat.chat_prompt`; ``chat_template`` None:
        the server's). A template writes the BOS text where the model wants it, so its text is tokenized
        without adding special tokens: one BOS, not two; the tiny model's byte tokenizer has no BOS text, so
        its BOS is added (``add_special_tokens`` None; True or False overrides it, as vLLM's parameter)."""
        try:
            text = chat_prompt(self.tokenizer, messages, chat_template or self.config.chat_template,
                               add_generation_prompt, continue_final_message, template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        special = (not hasattr(self.tokenizer, "apply_chat_template") if add_special_tokens is None
                   else add_special_tokens)
        return self.encode(text, special, "messages", check_length=check_length), text

    def encode(self, text: str, add_special_tokens: bool, param: str, check_length: bool = True) -> list[int]:
        """The token ids of a prompt text; raises :class:`Refused` (400) for a text that is not valid
        Unicode or (``check_length``) is too long to fit, before tokenizing a long one whole."""
        try:
            n_bytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise bad_request("the prompt is not valid Unicode (it holds a lone surrogate)", param) from None
        if check_length:
            self._refuse_too_long(n_bytes, param)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (UnicodeError, TypeError, ValueError) as exc:
            raise bad_request(f"the prompt cannot be tokenized ({type(exc).__name__})", param) from None

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
            raise bad_request(f"the prompt has at least {at_least} tokens, more than the model context of {context} "
                              f"tokens", param)
        if at_least >= info.kv_capacity_tokens:
            raise bad_request(f"the prompt has at least {at_least} tokens; with one generated token that exceeds the "
                              f"KV capacity of {info.kv_capacity_tokens} tokens", param)

    # -- arrival
    async def respond(self, http: HttpRequest, body: SamplingBody, prompts: list[tuple[list[int], str | None]],
                      ask: Ask) -> Response:
        """Admit an arrival, then answer it whole or, once its first token has come (or every choice
        has ended, maybe refused), as a stream of events.

        :param prompts: (token ids, the text echoed before each choice's or None) of each prompt
        """
        choices, refusal = await self.admit(body, prompts, ask)
        if refusal is not None:
            return refusal
        return await self.answers.respond(http, choices, ask, prompts)

    async def admit(self, body: SamplingBody, prompts: list[tuple[list[int], str | None]], ask: Ask):
        """Common arrival path: returns (choices, None) when admitted, one engine request per choice
        (``best_of`` of them per prompt), or (None, response) otherwise."""
        try:
            self._check_open()
            if isinstance(ask.tools, ForcedTools) or wants_structured_output(body):
                # compiling a constraint takes up to seconds for a large one: off the event loop, so that probes
                # and refusals do not wait on it
                sampling = await asyncio.to_thread(self._sampling, body, ask, len(prompts) * ask.best_of)
            else:
                sampling = self._sampling(body, ask, len(prompts) * ask.best_of)
            limits = [self._max_tokens(body, ids, ask) for ids, _ in prompts]
        except Refused as refused:
            return None, refused.response
        # the arrival is judged once, as a whole: the prefill of all its sequences (copies sent together each
        # compute their prompt: a block is cached for others only once computed) and its longest max_tokens.
        # Judged copy by copy, each copy found the arrival's earlier ones queued ahead of it, and an idle server
        # refused an n=8 request as overloaded
        try:
            self._check_admission(sum(len(ids) for ids, _ in prompts) * ask.best_of, max(limits),
                                  len(prompts) * ask.best_of)
        except Refused as refused:
            return None, refused.response
        event = asyncio.Event()
        loop = asyncio.get_running_loop()
        choices: list[Choice] = []
        for p, ((ids, echo), max_tokens) in enumerate(zip(prompts, limits)):
            for i in range(ask.best_of):
                try:
                    stream = Stream(loop, self.config.stream_buffer_chunks, event)
                    self.service.submit(stream, ids, nth_sampling(sampling, i), max_tokens, ask.priority,
                                        ask.cache_salt)
                except EngineUnavailable:
                    abandon(self.service, choices)
                    self.metrics.rejected("engine_down")
                    return None, error_response(503, "the engine is restarting", "unavailable", retry_after_s=5)
                choices.append(Choice(p * ask.best_of + i, stream, p, ids, echo))
        return choices, None

    def _check_open(self) -> None:
        if self.service.draining:
            self.metrics.rejected("shutting_down")
            raise Refused(error_response(503, "the server is shutting down", "unavailable", retry_after_s=5))
        if not self.service.alive:
            self.metrics.rejected("engine_down")
            raise Refused(error_response(503, "the engine is restarting", "unavailable", retry_after_s=5))

    def _sampling(self, body: SamplingBody, ask: Ask, engine_requests: int) -> SamplingParams:
        """The sampling parameters of an arrival of ``engine_requests`` engine requests that this server can serve,
        checked once for all its prompts (``bad_words`` tokenized once, the id lists checked against the vocabulary
        once); raises :class:`Refused` (400) otherwise."""
        if body.model is not None and body.model != self.model_name:
            raise Refused(error_response(400, f"the model {body.model!r} is not served here; use "
                                              f"{self.model_name!r}", "invalid_request_error", "model"))
        _check_id_lists(body, engine_requests)
        vocab = self.service.info.vocab_size if self.service.info is not None else 0
        sampling = sampling_params(body, ask, vocab, self.tokenizer, self.service.sampling_defaults)
        verify = getattr(sampling, "verify", None)  # what depends on the model
        if verify is not None:
            try:
                verify(vocab, eos_token_ids=self.service.info.eos_token_ids if self.service.info is not None else ())
            except ValueError as exc:
                raise bad_request(str(exc).rstrip("."), named_param(str(exc), _CHECKED_PARAMS)) from None
        structured = getattr(sampling, "structured_outputs", None)
        if structured is not None:
            try:
                check_grammar(structured, self._grammar_tokenizer())
            except ValueError as exc:
                param = "tools" if isinstance(ask.tools, ForcedTools) else structured_field(body)
                raise bad_request(str(exc).rstrip("."), param) from None
        return sampling

    def _grammar_tokenizer(self):
        """The model's tokenizer as llguidance reads it, built at the first request with structured output."""
        if self._llg_tokenizer is None:
            info = self.service.info
            self._llg_tokenizer = grammar_tokenizer(self.tokenizer, info.vocab_size if info is not None else 0,
                                                    info.eos_token_ids if info is not None else ())
        return self._llg_tokenizer

    def _max_tokens(self, body: SamplingBody, prompt_ids: list[int], ask: Ask) -> int:
        """The ``max_tokens`` of one prompt's engine requests; raises :class:`Refused` (400) when the prompt and it do
        not fit. A request that sets no ``max_tokens`` gets the default, within the context."""
        default = int(self.service.sampling_defaults.get("max_tokens", self.config.default_max_tokens))
        context = self.service.max_model_len or (len(prompt_ids) + default)
        max_tokens = ask.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(default, context - len(prompt_ids)))
        if (body.min_tokens or 0) > max_tokens:
            raise bad_request(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
        try:
            self.service.check_request(prompt_ids, max_tokens)
        except ValueError as exc:
            raise bad_request(str(exc).rstrip("."), "max_tokens" if "max_tokens" in str(exc) else None) from None
        return max_tokens

    def _check_admission(self, prompt_len: int, max_tokens: int, copies: int = 1) -> None:
        """Raises :class:`Refused` (429) when the server is at its in-flight limit or the controller refuses an
        arrival of ``copies`` engine requests (an arrival alone on the server always fits the limit: larger than
        it, it would be refused at every try)."""
        limit = self.config.max_in_flight
        in_flight = self.service.in_flight
        if in_flight and in_flight + copies > limit:
            self.metrics.rejected("max_in_flight")
            raise Refused(error_response(429, f"the server is at its limit of {limit} requests in flight",
                                         "rate_limited", retry_after_s=1))
        rejection = self.service.admission(prompt_len, max_tokens)
        if rejection is not None:
            self.metrics.rejected(rejection.reason.split(" ")[0].lower())
            self.service.record_rejection(prompt_len, max_tokens, rejection)
            raise Refused(error_response(429, rejection.reason, "rate_limited",
                                         retry_after_s=rejection.retry_after_s))


def _check_id_lists(body: SamplingBody, engine_requests: int) -> None:
    """Refuses (400) id lists that, copied into each of an arrival's engine requests, would name more than
    ``MAX_TOKEN_IDS_AN_ARRIVAL`` ids in all."""
    ids = len(body.stop_token_ids or ()) + len(body.allowed_token_ids or ())
    if ids * engine_requests > MAX_TOKEN_IDS_AN_ARRIVAL:
        raise bad_request(f"stop_token_ids and allowed_token_ids name {ids} ids for each of {engine_requests} engine "
                          f"requests (prompts x best_of or n); at most {MAX_TOKEN_IDS_AN_ARRIVAL} in all are served",
                          "allowed_token_ids" if body.allowed_token_ids else "stop_token_ids")


#: the request parameters that the engine's check of a request (``SamplingParams.verify``) may name
_CHECKED_PARAMS = ("logit_bias", "stop_token_ids", "min_tokens", "allowed_token_ids", "bad_words",
                   "logprob_token_ids")


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
