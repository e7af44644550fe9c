"""What an arrival asks for, as the engine takes it.

:class:`Ask` is what a client asked for beyond the sampling; :func:`sampling_params` turns a body into
the engine's sampling parameters. A request the server will not serve raises :class:`Refused`, which
carries its error response.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from fastapi.responses import Response

from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.serve.constraints import structured_output, tool_output
from tidegate.engine.serve.protocol import FieldError, SamplingBody, error_response
from tidegate.engine.serve.tools import ForcedTools, ParsedTools


class Refused(Exception):
    """An arrival answered at once with an error response, without reaching the engine."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def bad_request(message: str, param: str | None = None) -> Refused:
    """A 400 with OpenAI's error body naming ``param``, to raise."""
    return Refused(error_response(400, message, param=param))


@dataclass
class Ask:
    """What a client asked for beyond the sampling: how many choices, which logprobs, echo, streaming,
    and vLLM's extras of the answer."""

    chat: bool
    max_tokens: int | None
    #: choices in the answer, per prompt
    n: int = 1
    #: engine requests per prompt; the n of them with the highest cumulative logprob are the answer
    best_of: int = 1
    #: alternatives per token in the answer's logprobs; None: no logprobs
    logprobs: int | None = None
    #: whether the prompt's text goes before each choice's text (completions' ``echo``; chat's: the
    #: last message's content, when it is the assistant's)
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    #: usage in every chunk (``stream_options.continuous_usage_stats``)
    continuous_usage: bool = False
    #: tokens per streamed chunk after the first
    stream_interval: int = 1
    #: vLLM's ``prompt_logprobs``: alternatives per prompt token; None: none
    prompt_logprobs: int | None = None
    #: ``token_ids`` (and ``prompt_token_ids``) in the answer
    return_token_ids: bool = False
    #: logprobs name tokens ``token_id:<id>`` instead of by their text
    tokens_as_ids: bool = False
    #: the response id's suffix (vLLM's ``request_id``); None: a new one
    request_id: str | None = None
    #: the request's class as the controller sees it (vLLM's ``priority``)
    priority: int = 0
    #: requests with different salts share no cached prefix (vLLM's ``cache_salt``); None: no salt
    cache_salt: str | None = None
    #: chat's rendered prompt, in the answer (``return_prompt_text``)
    prompt_text: str | None = None
    #: the tool calls the request forces, or the parser of the model's own (``engine.serve.tools``); None: text
    tools: ForcedTools | ParsedTools | None = None

    @classmethod
    def of(cls, body: SamplingBody, chat: bool, max_tokens: int | None, **fields) -> Ask:
        options = body.stream_options
        include_usage = bool(body.stream and options and options.include_usage)
        return cls(chat, max_tokens, n=body.choices, stream=body.streamed, include_usage=include_usage,
                   continuous_usage=bool(include_usage and options and options.continuous_usage_stats),
                   stream_interval=body.stream_interval or 1, prompt_logprobs=body.prompt_logprobs,
                   return_token_ids=bool(body.return_token_ids), tokens_as_ids=bool(body.return_tokens_as_token_ids),
                   request_id=body.request_id, priority=body.priority or 0, cache_salt=body.cache_salt, **fields)


def refuse_unserved(body: SamplingBody) -> None:
    """Raises :class:`Refused` (400) for a parameter the body sets that this server does not serve."""
    unserved = body.unserved()
    if unserved is not None:
        param, why = unserved
        raise bad_request(why, param)


#: keyword arguments of SamplingParams this engine has (newer parameters may be missing)
_SAMPLING_FIELDS = frozenset(inspect.signature(SamplingParams).parameters)
#: the request parameter each engine parameter comes from, where the names differ
_PARAM_OF = {"logprobs": "logprobs", "bad_words_token_ids": "bad_words"}
def sampling_params(body: SamplingBody, ask: Ask, vocab_size: int, tokenizer=None,
                    defaults: dict | None = None) -> SamplingParams:
    """The engine's sampling parameters of a request; raises :class:`Refused` (400, naming the
    parameter) for a value the engine refuses or a parameter it does not have.

    :param tokenizer: turns ``bad_words`` into token ids (as vLLM does)
    :param defaults: the values of the sampling parameters a body leaves out (or sends as null), as the model's
        ``generation_config.json`` gives them (``model.sampling_defaults``); the rest default to OpenAI's
    """
    defaults = defaults or {}

    def given(name: str, neutral):
        value = getattr(body, name)
        return value if value is not None else defaults.get(name, neutral)

    top_k = given("top_k", 0)
    kwargs: dict = dict(temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=max(top_k or 0, 0),
                        seed=body.seed, stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                        ignore_eos=bool(body.ignore_eos))
    # only what differs from the engine's neutral default, so an engine without a parameter
    # still serves the clients that send it at its default
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_p", 0.0), ("min_tokens", 0), ("include_stop_str_in_output", False),
                          ("skip_special_tokens", True)):
        value = given(name, None)
        if value is not None and value != neutral:
            kwargs[name] = value
    kwargs.update(_token_lists(body, vocab_size, tokenizer))
    if ask.logprobs is not None or ask.best_of > ask.n:  # best_of ranks by cumulative logprob
        kwargs["logprobs"] = ask.logprobs or 0
    if body.logprob_token_ids is not None:
        if ask.logprobs is None:
            raise bad_request("logprob_token_ids needs logprobs", "logprob_token_ids")
        kwargs["logprob_token_ids"] = list(body.logprob_token_ids)
    prompt_logprobs = [k for k in (ask.prompt_logprobs, ask.logprobs if ask.echo and not ask.chat else None)
                       if k is not None]
    if prompt_logprobs:
        kwargs["prompt_logprobs"] = max(prompt_logprobs)
    forced = ask.tools if isinstance(ask.tools, ForcedTools) else None
    try:
        structured = structured_output(body) if forced is None else tool_output(body, forced)
    except FieldError as exc:
        raise bad_request(str(exc).rstrip("."), exc.param) from None
    if isinstance(ask.tools, ParsedTools):
        kwargs.pop("skip_special_tokens", None)  # a model's call tags may be special tokens: the parser reads them
        kwargs["skip_special_tokens"] = False
    if structured is not None:
        kwargs["structured_outputs"] = structured
    missing = [name for name in kwargs if name not in _SAMPLING_FIELDS]
    if missing:
        param = "best_of" if missing[0] == "logprobs" and ask.logprobs is None else _PARAM_OF.get(missing[0],
                                                                                                  missing[0])
        raise bad_request(f"{param} is not supported by this engine yet", param)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(str(exc).rstrip("."), named_param(str(exc), kwargs)) from None


def _token_lists(body: SamplingBody, vocab_size: int, tokenizer) -> dict:
    """The sampling parameters that name tokens: ``stop_token_ids``, ``allowed_token_ids``, ``bad_words`` (as token
    ids) and ``logit_bias``, those the body sets."""
    kwargs: dict = {}
    if body.stop_token_ids:
        if any(t < 0 or t >= vocab_size for t in body.stop_token_ids):
            raise bad_request(f"stop_token_ids holds ids outside the vocabulary of {vocab_size}", "stop_token_ids")
        kwargs["stop_token_ids"] = list(body.stop_token_ids)
    if body.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(body.allowed_token_ids)
    if body.bad_words:
        kwargs["bad_words_token_ids"] = _bad_words(tokenizer, body.bad_words)
    if body.logit_bias:
        kwargs["logit_bias"] = _logit_bias(body.logit_bias, vocab_size)
    return kwargs


def _bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """``bad_words`` as the token-id sequences the engine bans, tokenized as vLLM tokenizes them."""
    from tidegate.engine.real.sampling import bad_words_token_ids

    if any(not w.strip() for w in words):
        raise bad_request("bad_words must not hold empty or whitespace-only words (vLLM strips a word's leading "
                          "whitespace, which leaves nothing to ban)", "bad_words")
    try:
        return bad_words_token_ids(tokenizer, words)
    except (UnicodeError, TypeError, ValueError) as exc:
        raise bad_request(f"bad_words cannot be tokenized ({type(exc).__name__})", "bad_words") from None


def named_param(message: str, names) -> str | None:
    """The request parameter an engine's error message names (the longest name it holds)."""
    named = [n for n in sorted(names, key=len, reverse=True) if n in message]
    return _PARAM_OF.get(named[0], named[0]) if named else None


#: the most digits a token id given as text may have (no vocabulary reaches 10^12 tokens)
_MAX_ID_DIGITS = 12


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as string keys) with int keys, each within the vocabulary."""
    out = {}
    for key, value in bias.items():
        # ASCII digits only: int() would also read " 5 ", "5_0" and other scripts' digits
        if not (key.isascii() and key.isdigit()) or len(key) > _MAX_ID_DIGITS:
            shown = key if len(key) <= 20 else key[:20] + "..."
            raise bad_request(f"logit_bias keys must be token ids (decimal digits), got {shown!r}", "logit_bias")
        tid = int(key)
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias holds token id {tid}, outside the vocabulary of {vocab_size}", "logit_bias")
        out[tid] = value
    return out


def nth_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """The sampling of a completion's ``i``-th choice: a seeded request's choices get seeds of their
    own (seed + i, as vLLM), so they differ yet reproduce."""
    if i == 0 or sampling.seed is None:
        return sampling
    seed = sampling.seed + i if sampling.seed + i < 2**64 else sampling.seed - i
    return dataclasses.replace(sampling, seed=seed)
