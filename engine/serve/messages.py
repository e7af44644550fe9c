"""The messages between the HTTP side and the engine (as vLLM v1's ``EngineCoreRequest`` and
``EngineCoreOutputs``): one frozen, slotted dataclass per kind, sent whole over the pipe (pickled,
also when the engine runs in a thread of the server's process).

HTTP side to engine (:class:`EngineRequestType`): :class:`AddRequest`, :class:`RecordRejection`,
:class:`CancelRequest`, :class:`Shutdown`.

Engine to HTTP side (:class:`EngineOutputType`): :class:`EngineReady` once the model has loaded, or
:class:`EngineFailed` if it cannot; then a :class:`Tick` after every step, and every heartbeat while
idle, with the step's :class:`TokenEvent` s and the engine's :class:`Snapshot`.

A receiver dispatches on the class (``match``), and one given a message it does not know raises
:class:`UnknownMessage` (``raise unknown_message(...)``) rather than guess at it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, ClassVar

from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import time_to_first_token_s


class EngineRequestType(enum.Enum):
    """The kinds of message the HTTP side sends the engine."""

    ADD = "add"
    REJECT = "reject"
    CANCEL = "cancel"
    STOP = "stop"


class EngineOutputType(enum.Enum):
    """The kinds of message the engine sends the HTTP side."""

    READY = "ready"
    ERROR = "error"
    TICK = "tick"


class UnknownMessage(TypeError):
    """A receiver got a message that is none of the kinds it takes."""


def unknown_message(receiver: str, msg: object, expected: tuple[type, ...]) -> UnknownMessage:
    """The :class:`UnknownMessage` to raise for ``msg``: one sentence naming the kinds ``receiver`` takes."""
    names = [t.__name__ for t in expected]
    kinds = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return UnknownMessage(f"{receiver} got a message it does not know, {type(msg).__name__} {msg!r:.200}, "
                          f"where it takes {kinds}")


# ---------------------------------------------------------------------- payloads
@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the HTTP side needs to know of the engine it talks to."""

    #: the engine's process id (the server's own when the engine runs in a thread)
    pid: int
    #: the KV cache's size, in tokens
    kv_capacity_tokens: int
    #: tokens per KV block
    block_size: int
    #: the longest context the engine serves, in tokens (prompt and completion); None: no limit
    max_model_len: int | None
    #: the tokenizer's vocabulary size, in token ids
    vocab_size: int
    #: the engine's step-time profile (what the HTTP side's controller twin decides on)
    profile: Any
    #: the learned controller's policy status line, for the log; None for any other controller
    controller_note: str | None = None
    #: how the engine computes, for the log: dtype, torch threads, the step's limits
    compute: str = ""
    #: the ids that end a sequence unless a request ignores EOS (the model's and its tokenizer's)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended, as the HTTP side sees it."""

    #: the request's terminal state
    state: RequestState
    #: why it ended ("stop", "length", a rejection's or failure's sentence); None if not given
    finish_reason: str | None
    #: the prompt's length, in tokens
    prompt_len: int
    #: tokens generated, in tokens
    completion_tokens: int
    #: seconds from arrival to the start of its prefill; None if it never started
    queue_s: float | None = None
    #: the controller's predicted time to first token, in seconds; None if it made none
    predicted_ttft_s: float | None = None
    #: the engine's time to first token, in seconds (on the engine's clock); None before a token
    engine_ttft_s: float | None = None
    #: ended because the engine went away (503: another try may succeed), not by the engine's doing
    unavailable: bool = False
    #: prompt tokens found in the prefix cache when it started
    cached_tokens: int = 0

    @classmethod
    def of(cls, r: Request) -> Outcome:
        queue_s = None if r.start_time_s is None else max(0.0, r.start_time_s - r.arrival_time_s)
        ttft = time_to_first_token_s(r) if r.first_token_time_s is not None else None
        return cls(r.state, r.finish_reason, r.prompt_len, len(r.output_token_ids), queue_s, r.predicted_ttft_s, ttft,
                   cached_tokens=r.num_cached_tokens)

    @classmethod
    def failed(cls, reason: str) -> Outcome:
        return cls(RequestState.FAILED, reason, 0, 0, unavailable=True)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The engine's state after a step: its Observation, the requests it has taken from the pipe
    (consistent with the Observation, so the HTTP side's waiting count is exact), the
    controller's admission state and the figures the metrics export."""

    #: the engine's Observation, its values in ``Observation.FIELDS`` order (``observation_of`` rebuilds it)
    obs: tuple
    #: requests taken from the pipe since the engine started, a count
    taken_requests: int
    #: prompt tokens of those requests, in tokens
    taken_tokens: int
    #: the controller's ``admission_state()`` (whatever it returns), for the HTTP side's twin; None if none
    admission_state: Any
    #: requests running, a count
    running: int = 0
    #: requests waiting in the engine, a count
    waiting: int = 0
    #: KV cache in use, in tokens
    kv_used_tokens: int = 0
    #: whether any request is waiting or running
    has_unfinished: bool = False
    #: evictions since the engine started, a count
    evictions: int = 0
    #: the shield's interventions since the engine started, a count
    interventions: int = 0
    #: the twin guard's switches since the engine started, a count
    guard_switches: int = 0
    #: whether the guard has the heuristic decide now
    guarded: bool = False
    #: whether the learned controller runs on its fallback now
    degraded: bool = False
    #: the learned controller's fallbacks since the engine started, a count per cause
    fallbacks: dict[str, int] = field(default_factory=dict)
    #: the controller's decision times since the previous tick, in seconds (at most a few thousand)
    decision_times: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------- HTTP side to engine
@dataclass(frozen=True, slots=True)
class AddRequest:
    """An admitted request for the engine to run."""

    kind: ClassVar[EngineRequestType] = EngineRequestType.ADD

    #: the stream id the HTTP side gave the request (its events carry it back)
    sid: int
    #: the prompt, in token ids
    prompt_ids: list[int]
    #: the request's sampling parameters (an ``engine.real.sampling.SamplingParams``)
    sampling: Any
    #: the most tokens to generate, in tokens
    max_tokens: int
    #: the request's class as controllers see it (a client's ``priority``; 0 by default)
    class_id: int = 0
    #: requests with different salts share no cached prefix (a client's ``cache_salt``)
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class RecordRejection:
    """An arrival the HTTP side refused, for the engine's accounting (it never runs)."""

    kind: ClassVar[EngineRequestType] = EngineRequestType.REJECT

    #: the refused prompt's length, in tokens
    prompt_len: int
    #: the tokens it asked for, in tokens
    max_tokens: int
    #: the controller's refusal (a ``ctrl.base.Rejection``)
    rejection: Any


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """Stop a request (the client went away, or reads too slowly); nothing if it has ended."""

    kind: ClassVar[EngineRequestType] = EngineRequestType.CANCEL

    #: the stream id of the request
    sid: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop serving: the engine loop ends (also put in its own inbox when the HTTP side goes away)."""

    kind: ClassVar[EngineRequestType] = EngineRequestType.STOP


# ---------------------------------------------------------------------- engine to HTTP side
@dataclass(frozen=True, slots=True)
class EngineReady:
    """The model has loaded; the engine serves from now on."""

    kind: ClassVar[EngineOutputType] = EngineOutputType.READY

    #: what the HTTP side needs to know of the engine
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine could not start."""

    kind: ClassVar[EngineOutputType] = EngineOutputType.ERROR

    #: why, in one sentence
    message: str


_EVENT_FIELDS = ("sid", "delta", "finished", "outcome", "logprobs", "prompt_logprobs", "token_ids")
_event_values = attrgetter(*_EVENT_FIELDS)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What one request did in a step: new text, its first token (even when that token shows no
    text yet, so the HTTP side times the first token, not the first text), or its end. The HTTP
    side queues it on the request's stream as it is (a stream's chunks are its events)."""

    #: the request's stream id
    sid: int
    #: the text since the request's previous event (may be empty)
    delta: str
    #: whether the request has ended (this is its last event)
    finished: bool
    #: how it ended, with ``finished``; None before
    outcome: Outcome | None
    #: the entries ``(token_id, logprob, [(alt_id, alt_logprob), ...])`` of the tokens committed since
    #: the previous event (logprobs in nats); None if the request did not ask for them or has none new
    logprobs: list | None
    #: the prompt's entries (the first None), once; None otherwise or if not asked for
    prompt_logprobs: list | None
    #: the ids of the tokens committed since the previous event (a stop token included)
    token_ids: tuple[int, ...] = ()

    def __reduce__(self):
        # one per request and step: pickled as the class and a tuple of its values, which is smaller
        # and several times quicker both ways than the slotted dataclass's own state protocol
        return (TokenEvent, _event_values(self))


assert tuple(TokenEvent.__dataclass_fields__) == _EVENT_FIELDS


@dataclass(frozen=True, slots=True)
class Tick:
    """What a step did, and the engine's state after it (also the idle engine's heartbeat)."""

    kind: ClassVar[EngineOutputType] = EngineOutputType.TICK

    #: the step's events, in the order they happened (empty for a heartbeat)
    events: list[TokenEvent]
    #: the engine's state after the step
    snapshot: Snapshot


#: what the engine takes, and what the HTTP side takes
TO_ENGINE = (AddRequest, RecordRejection, CancelRequest, Shutdown)
FROM_ENGINE = (EngineReady, EngineFailed, Tick)
