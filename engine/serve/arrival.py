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
from tidegate.engine.serve.protocol import SamplingBody, error_response


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
    def of(cls, body: SamplingBody, chat: bool, max_tokens: int | None, **fields) -> Ask:
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        return cls(chat, max_tokens, n=body.n, stream=body.stream, include_usage=include_usage, **fields)


def refuse_unserved(body: SamplingBody) -> None:
    """Raises :class:`Refused` (400) for a parameter the body sets that this server does not serve."""
    unserved = body.unserved()
    if unserved is not None:
        param, why = unserved
        raise bad_request(why, param)


#: keyword arguments of SamplingParams this engine has (newer parameters may be missing)
_SAMPLING_FIELDS = frozenset(inspect.signature(SamplingParams).parameters)
#: the request parameter each engine parameter comes from, where the names differ
_PARAM_OF = {"prompt_logprobs": "logprobs", "logprobs": "logprobs"}


def sampling_params(body: SamplingBody, ask: Ask, vocab_size: int) -> SamplingParams:
    """The engine's sampling parameters of a request; raises :class:`Refused` (400, naming the
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
            raise bad_request(f"stop_token_ids holds ids outside the vocabulary of {vocab_size}", "stop_token_ids")
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
        raise bad_request(f"{param} is not supported by this engine yet", param)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(str(exc).rstrip("."), named_param(str(exc), kwargs)) from None


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
