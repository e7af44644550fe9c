"""The typed messages between the HTTP side and the engine: each pickles round trip equal (they
cross a pipe), is frozen and slotted, carries its kind; a receiver given a message it does not
know fails with one sentence instead of unpacking it by position."""

from __future__ import annotations

import dataclasses
import logging
import pickle

import pytest

from tidegate.ctrl.base import Rejection
from tidegate.engine.core.request import RequestState
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.serve import messages as m
from tidegate.engine.serve.config import ServeConfig
from tidegate.engine.serve.engine_proc import EngineLoop
from tidegate.engine.serve.metrics import ServerMetrics
from tidegate.engine.serve.service import EngineService, _Engine

OUTCOME = m.Outcome(RequestState.FINISHED, "length", 5, 3, queue_s=0.01, predicted_ttft_s=0.2, engine_ttft_s=0.25)
SNAPSHOT = m.Snapshot(obs=(1.5, 2, 3), taken_requests=4, taken_tokens=40, admission_state={"rate": 2.0}, running=2,
                      waiting=1, kv_used_tokens=96, has_unfinished=True, evictions=1, interventions=2,
                      guard_switches=1, guarded=True, fallbacks={"nan": 1}, decision_times=[1e-5, 2e-5])
ENTRIES = [(17, -0.5, [(17, -0.5), (3, -1.25)]), (4, -0.1, [(4, -0.1)])]
EVENTS = [m.TokenEvent(7, " hi", False, None, ENTRIES, [None, (5, -2.0, [])]),
          m.TokenEvent(8, "", False, None, None, None),
          m.TokenEvent(7, "!", True, OUTCOME, None, None)]

#: one of each message kind (the Any fields hold values that compare by value)
MESSAGES = [
    m.AddRequest(3, [1, 2, 3], {"temperature": 0.0}, 16),
    m.RecordRejection(120, 16, ("watermark", 1.0)),
    m.CancelRequest(3),
    m.Shutdown(),
    m.EngineReady(m.EngineInfo(1234, 4096, 16, 2048, 259, {"ttft_slo_s": 0.5}, "policy v1")),
    m.EngineFailed("the engine could not start: OSError: no such model"),
    m.Tick(EVENTS, SNAPSHOT),
    m.Tick([], m.Snapshot((0,), 0, 0, None)),
]
PAYLOADS = [OUTCOME, m.Outcome.failed("the engine stopped"), SNAPSHOT, *EVENTS, MESSAGES[4].info]


def _message_classes() -> set[type]:
    return {v for v in vars(m).values() if dataclasses.is_dataclass(v) and v.__module__ == m.__name__}


def test_every_kind_is_covered_here():
    assert {type(x) for x in MESSAGES + PAYLOADS} == _message_classes()
    assert set(m.TO_ENGINE) | set(m.FROM_ENGINE) | {m.TokenEvent, m.Outcome, m.Snapshot, m.EngineInfo} \
        == _message_classes()


@pytest.mark.parametrize("msg", MESSAGES + PAYLOADS, ids=lambda x: type(x).__name__)
def test_messages_pickle_round_trip_equal(msg):
    for protocol in (pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(msg, protocol=protocol))
        assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("cls", sorted(_message_classes(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_messages_are_frozen_slotted_and_documented(cls):
    assert "__slots__" in vars(cls) and cls.__dataclass_params__.frozen and cls.__doc__
    one = next(x for x in MESSAGES + PAYLOADS if type(x) is cls)
    assert not hasattr(one, "__dict__")
    for f in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(one, f.name, None)


def test_each_queue_carries_one_class_per_kind():
    assert [c.kind for c in m.TO_ENGINE] == list(m.EngineRequestType)
    assert [c.kind for c in m.FROM_ENGINE] == list(m.EngineOutputType)
    assert all("kind" not in {f.name for f in dataclasses.fields(c)} for c in m.TO_ENGINE + m.FROM_ENGINE)


def test_the_real_payloads_cross_the_pipe():
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=5, stop=["\n"], logprobs=2)
    add = pickle.loads(pickle.dumps(m.AddRequest(1, [5, 6], sampling, 8)))
    assert add.sampling == sampling and add.prompt_ids == [5, 6]
    rej = pickle.loads(pickle.dumps(m.RecordRejection(10, 4, Rejection("the queue is full", 2.0)))).rejection
    assert (rej.reason, rej.retry_after_s) == ("the queue is full", 2.0)


def test_token_events_pickle_about_as_small_as_the_tuples_they_replace():
    events = [m.TokenEvent(i, " tok", False, None, None, None) for i in range(64)]
    tuples = [(e.sid, e.delta, e.finished, e.outcome, e.logprobs, e.prompt_logprobs) for e in events]
    size = len(pickle.dumps(events, pickle.HIGHEST_PROTOCOL))
    tuple_size = len(pickle.dumps(tuples, pickle.HIGHEST_PROTOCOL))
    assert size <= tuple_size + 8 * len(events), (size, tuple_size)


def _one_sentence(text: str) -> None:
    assert text.count(". ") == 0 and "\n" not in text and "does not know" in text, text


@pytest.mark.parametrize("msg", [("add", 1, [1, 2], None, 4), ("stop",), m.Tick([], SNAPSHOT), None],
                         ids=["old-add", "old-stop", "wrong-way", "none"])
def test_the_engine_refuses_a_message_it_does_not_know(msg):
    loop = EngineLoop.__new__(EngineLoop)  # dispatch touches no state before it knows the kind
    with pytest.raises(m.UnknownMessage) as err:
        loop._handle(msg)
    _one_sentence(str(err.value))
    assert str(err.value).startswith("the engine got a message it does not know")
    assert "AddRequest, RecordRejection, CancelRequest or Shutdown" in str(err.value)


@pytest.mark.parametrize("msg", [("tick", [], SNAPSHOT), m.Shutdown(), m.EngineReady(MESSAGES[4].info)],
                         ids=["old-tick", "wrong-way", "late-ready"])
def test_the_server_refuses_a_message_it_does_not_know(msg):
    service = EngineService(ServeConfig(), ServerMetrics("m"))
    with pytest.raises(m.UnknownMessage) as err:
        service._dispatch(_Engine(None), msg)
    _one_sentence(str(err.value))
    assert "where it takes Tick" in str(err.value)


class _Conn:
    """A pipe end that yields the given messages, then reports the other side gone."""

    def __init__(self, *msgs) -> None:
        self.msgs = list(msgs)

    def recv(self):
        if not self.msgs:
            raise EOFError
        return self.msgs.pop(0)


def test_the_reader_stops_an_engine_that_sends_an_unknown_message(caplog):
    service = EngineService(ServeConfig(), ServerMetrics("m"))
    engine = _Engine(_Conn(m.Tick([], SNAPSHOT), ("tick", [], SNAPSHOT), m.Tick([], SNAPSHOT)))
    service._engine, service._alive, service._stopping = engine, True, True  # no restart
    with caplog.at_level(logging.ERROR, logger="tidegate.server"):
        service._read(engine)
    assert engine.lost and service._snapshot == SNAPSHOT
    assert engine.conn.msgs == [m.Tick([], SNAPSHOT)]  # nothing read past the unknown message
    assert engine.outbox.get_nowait() == m.Shutdown()
    assert any("got a message it does not know, tuple" in r.getMessage() for r in caplog.records)
