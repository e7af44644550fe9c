"""The engine side of the server: the engine loop, in a process of its own (as vLLM v1 separates
its API server from EngineCore), talking to the HTTP side over a pipe.

The HTTP side never shares a GIL with model steps. The messages both ways are the typed ones of
:mod:`engine.serve.messages`: the engine takes :class:`AddRequest`, :class:`RecordRejection`,
:class:`CancelRequest` and :class:`Shutdown`; it answers :class:`EngineReady` once the model has
loaded (or :class:`EngineFailed` if it cannot), then a :class:`Tick` after every step, and every
``HEARTBEAT_S`` while idle, with the step's :class:`TokenEvent` s and its :class:`Snapshot`. An
event comes with new text, with a request's first token (even when that token shows no text yet,
so the HTTP side times the first token, not the first text) and at the end.

For tests and embedding the same loop also runs in a thread of the server's process.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from tidegate.ctrl.base import Controller, Observation
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.serve.cores import engine_threads, free_cores
from tidegate.engine.serve.messages import (
    AddRequest, CancelRequest, EngineFailed, EngineInfo, EngineReady, Outcome, RecordRejection, Shutdown, Snapshot,
    Tick, TokenEvent, unknown_message,
)
from tidegate.engine.twin.guard import TwinGuard

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from tidegate.engine.serve.config import ServeConfig

log = logging.getLogger("tidegate.engine")

#: seconds between two ticks of an idle engine (its heartbeat)
HEARTBEAT_S = 0.05
#: decision times kept per tick for the histogram
_MAX_TIMES = 4096
#: ended requests the engine keeps (for tests and debugging); the rest are dropped as the server runs
KEEP_ENDED_REQUESTS = 10_000


_OBS_SLOTS = Observation.FIELDS


def observation_of(values: tuple) -> Observation:
    """An Observation with the values of a Snapshot's ``obs``."""
    obs = Observation()
    for name, v in zip(_OBS_SLOTS, values):
        setattr(obs, name, v)
    return obs


class _Track:
    """What of one request the engine has sent: its tokens, and its logprobs (whether it asked for
    them, how many entries have gone out, whether its prompt's are still to send)."""

    __slots__ = ("sid", "request", "logprobs", "logprobs_sent", "prompt_logprobs_due", "tokens_sent")

    def __init__(self, sid: int, sampling) -> None:
        self.sid = sid
        self.request: Request | None = None
        self.logprobs = getattr(sampling, "logprobs", None) is not None
        self.logprobs_sent = 0
        self.prompt_logprobs_due = getattr(sampling, "prompt_logprobs", None) is not None
        self.tokens_sent = 0


class TimedController:
    """Wraps the controller to time each decision; everything else passes through."""

    def __init__(self, inner: Controller) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["times"] = []

    def decide(self, obs):
        t = time.perf_counter()
        d = self._inner.decide(obs)
        times = self.times
        if len(times) < _MAX_TIMES:
            times.append(time.perf_counter() - t)
        return d

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def apply_queue_timeout(controller: Controller, queue_timeout_s: float | None) -> None:
    """The server's queue timeout, or the controller's own where that is tighter (the shield's
    "tighter of" rule); None keeps the controller's."""
    if queue_timeout_s is None:
        return
    own = controller.queue_timeout_s
    controller.queue_timeout_s = queue_timeout_s if own is None else min(own, queue_timeout_s)


def controller_parts(controller) -> tuple[Any, Any]:
    """(the shield, the learned controller inside it) of a controller, None for what it is not."""
    shield = controller if hasattr(controller, "interventions") else None
    inner = getattr(controller, "inner", None)
    learned = inner if inner is not None and hasattr(inner, "fallbacks") else None
    return shield, learned


class EngineLoop:
    """The LLM and its serving loop, fed by a pipe.

    :param config: the server settings
    :param conn: this side of the pipe
    :param model_and_tokenizer: an already loaded ``(model, tokenizer)`` (in-process only)
    :param llm: an engine with the :class:`engine.real.llm.LLM` interface to serve instead of loading one
    :param guard: the runtime twin guard: True builds one when the controller is the shielded learned
        one (``config.guard`` permitting), False never, or a ``TwinGuard`` of this engine's controller
    """

    def __init__(self, config: ServeConfig, conn: Connection, model_and_tokenizer=None, llm=None,
                 guard: TwinGuard | bool = True) -> None:
        self.conn = conn
        if llm is None:
            from tidegate.engine.real.llm import LLM

            llm = LLM(config.model, kv_capacity_tokens=config.kv_capacity_tokens, block_size=config.block_size,
                      controller=config.controller, device=config.device, dtype=config.dtype,
                      max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                      model_and_tokenizer=model_and_tokenizer, record_steps=False, profile=config.profile,
                      prefix_caching=config.prefix_caching)
        if config.max_model_len is not None:  # the operator's cap on the model's context
            llm.max_model_len = min(llm.max_model_len or config.max_model_len, config.max_model_len)
        self.llm = llm
        self.core = llm.core
        if config.threads is not None:
            import torch

            torch.set_num_threads(config.threads)
        controller = self.core.controller
        apply_queue_timeout(controller, config.queue_timeout_s)
        self.shield, self.learned = controller_parts(controller)
        self.timed = TimedController(controller)
        self.core.controller = self.timed
        if guard is True:
            self.guard = _guard_for(llm, controller) if config.guard else None
        else:
            self.guard = guard or None
        if self.guard is not None:
            self._feed_guard(self.guard)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._stop = False
        self._requests: dict[int, Request] = {}
        self._events: list[TokenEvent] = []
        #: requests that have not had an event since they were added: the first token must make one
        self._before_first: dict[int, _Track] = {}
        self._taken = (0, 0)
        self.info = EngineInfo(os.getpid(), self.core.pool.capacity_tokens, self.core.pool.block_size,
                               llm.max_model_len, llm.executor.vocab_size, llm.profile,
                               getattr(getattr(controller, "inner", None), "policy_status", None),
                               _compute_note(llm), frozenset(getattr(llm.executor, "eos_token_ids", ())))

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Serve until told to stop or the other side of the pipe goes away."""
        threading.Thread(target=self._receive, name="tidegate-engine-inbox", daemon=True).start()
        self._send(EngineReady(self.info))
        last_tick = 0.0
        while not self._stop:
            self._drain_inbox()
            if self._stop:
                break
            if self.llm.has_unfinished:
                try:
                    self.llm.step()
                except Exception:  # a bug outside the executor: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all()
                self._tick_guard()
                self._send_tick()
                last_tick = time.monotonic()
            else:
                self._tick_guard()
                if self._events or time.monotonic() - last_tick >= HEARTBEAT_S:
                    self._send_tick()
                    last_tick = time.monotonic()
                if self.wake.wait(HEARTBEAT_S):
                    self.wake.clear()

    def _receive(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the HTTP side is gone: nobody to serve
                msg = Shutdown()
            self.inbox.put(msg)
            self.wake.set()
            if isinstance(msg, Shutdown):
                return

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):  # the HTTP side is gone
            self._stop = True

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        """Act on one message from the HTTP side; :class:`UnknownMessage` for one it does not know."""
        match msg:
            case AddRequest():
                self._add(msg.sid, msg.prompt_ids, msg.sampling, msg.max_tokens, msg.class_id, msg.cache_salt)
                self._taken = (self._taken[0] + 1, self._taken[1] + len(msg.prompt_ids))
            case RecordRejection():
                r = Request(f"rejected-{self._taken[0]}", self.core.clock.now(), msg.prompt_len, msg.max_tokens)
                self.core.add_request(r, admission=msg.rejection)
            case CancelRequest():
                r = self._requests.get(msg.sid)
                if r is not None and not r.state.is_terminal:
                    self.llm.cancel(r)
            case Shutdown():
                self._stop = True
            case _:
                raise unknown_message("the engine", msg, (AddRequest, RecordRejection, CancelRequest, Shutdown))

    def _add(self, sid: int, ids, sampling, max_tokens: int, class_id: int = 0, cache_salt: str | None = None) -> None:
        track = _Track(sid, sampling)

        def on_delta(r: Request, delta: str, finished: bool) -> None:
            if finished:
                self._requests.pop(sid, None)
                self._event(track, r, delta, Outcome.of(r))
            elif delta:
                self._event(track, r, delta, None)

        try:
            r = self.llm.add_request(ids, sampling, max_tokens, request_id=f"req-{sid}", on_delta=on_delta,
                                     admission=None, class_id=class_id, cache_salt=cache_salt)
        except ValueError as exc:  # checked on arrival already; the engine's own check has the last word
            self._events.append(TokenEvent(sid, "", True, Outcome(RequestState.REJECTED, str(exc), len(ids), 0),
                                           None, None))
            return
        if r.state.is_terminal:
            if not any(e.sid == sid for e in self._events):
                self._events.append(TokenEvent(sid, "", True, Outcome.of(r), None, None))
        else:
            track.request = r
            self._requests[sid] = r
            self._before_first[sid] = track

    def _event(self, track: _Track, r: Request, delta: str, outcome: Outcome | None) -> None:
        """Queue an event of ``r`` for the next tick, with the logprobs it has not yet sent."""
        self._before_first.pop(track.sid, None)
        logprobs = prompt_logprobs = None
        if track.logprobs:
            entries = getattr(r, "logprobs", None)
            if entries and len(entries) > track.logprobs_sent:
                logprobs = entries[track.logprobs_sent:]
                track.logprobs_sent = len(entries)
        if track.prompt_logprobs_due:
            prompt_logprobs = getattr(r, "prompt_logprobs", None)
            if prompt_logprobs is not None:
                prompt_logprobs = list(prompt_logprobs)  # the event may outlive this step (engine thread)
            track.prompt_logprobs_due = prompt_logprobs is None and outcome is None
        ids = r.output_token_ids
        token_ids = tuple(ids[track.tokens_sent:])
        track.tokens_sent = len(ids)
        self._events.append(TokenEvent(track.sid, delta, outcome is not None, outcome, logprobs, prompt_logprobs,
                                       token_ids))

    def _first_token_events(self) -> None:
        """An event for each request whose first token came without visible text (an incomplete
        character, a held-back stop string prefix)."""
        started = [t for t in self._before_first.values() if t.request is not None and t.request.output_token_ids]
        for track in started:
            self._event(track, track.request, "", None)

    def _fail_all(self) -> None:
        for r in list(self.core.running) + list(self.core.waiting):
            self.core.cancel(r)

    def _send_tick(self) -> None:
        if self._before_first:
            self._first_token_events()
        core = self.core
        core.metrics.retain(KEEP_ENDED_REQUESTS)
        obs = core.observe()
        shield, learned = self.shield, self.learned
        times = self.timed.times
        self.timed.__dict__["times"] = []
        snap = Snapshot(
            obs=tuple(getattr(obs, name) for name in _OBS_SLOTS), taken_requests=self._taken[0],
            taken_tokens=self._taken[1], admission_state=_admission_state(self.timed),
            running=len(core.running), waiting=len(core.waiting), kv_used_tokens=core.pool.used_tokens,
            has_unfinished=core.has_unfinished, evictions=core.metrics.evictions,
            interventions=getattr(shield, "interventions", 0) if shield is not None else 0,
            guard_switches=self.guard.switches if self.guard is not None else 0,
            guarded=bool(self.guard is not None and self.guard.guarded),
            degraded=bool(getattr(learned, "degraded", False)) if learned is not None else False,
            fallbacks=dict(learned.fallbacks) if learned is not None else {}, decision_times=times)
        events, self._events = self._events, []
        self._send(Tick(events, snap))

    # ------------------------------------------------------------------ the runtime guard
    def _feed_guard(self, guard: TwinGuard) -> None:
        """Hand every request that ends to the guard as well (after the LLM's own hook)."""
        llm_on_finish = self.core.on_finish

        def on_finish(r: Request) -> None:
            if llm_on_finish is not None:
                llm_on_finish(r)
            if self.guard is guard:  # a guard dropped after a failure is fed no more
                guard.on_finish(r)

        self.core.on_finish = on_finish

    def _tick_guard(self) -> None:
        guard = self.guard
        if guard is None:
            return
        try:
            guard.maybe_check(self.core.clock.now(), background=True)
        except Exception:  # the guard must never take the engine loop down
            log.exception("twin guard failed; the controller keeps its current mode")
            self.guard = None


def _admission_state(controller) -> Any:
    try:
        get = getattr(controller, "admission_state", None)
        return get() if get is not None else None
    except Exception:
        log.exception("the controller's admission_state() failed")
        return None


def _guard_for(llm, controller) -> TwinGuard | None:
    """A twin guard for a shielded learned controller on the LLM's profile; None for any other."""
    inner = getattr(controller, "inner", None)
    profile = getattr(llm, "profile", None)
    if profile is None or not callable(getattr(inner, "set_guarded", None)):
        return None
    return TwinGuard(profile, controller)


def _compute_note(llm) -> str:
    """``fp32 on cpu, 1 torch thread, steps of up to 2048 tokens and 128 requests``."""
    import torch

    executor, profile = llm.executor, llm.profile
    if getattr(executor, "dtype", None) is None:  # an engine of another kind, served through the same interface
        return ""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(executor.dtype,
                                                                                         str(executor.dtype))
    threads = torch.get_num_threads()
    return (f"{dtype} on {executor.device}, {threads} torch thread{'s' * (threads != 1)}, steps of up to "
            f"{profile.max_num_batched_tokens} tokens and {profile.max_num_seqs} requests")


def engine_main(config: ServeConfig, conn: Connection) -> None:
    """The engine process: load the model, then serve the pipe until told to stop or orphaned.

    It ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): the server decides
    when it stops, by a ``stop`` message or by going away.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.engine_nice:
        try:
            os.nice(config.engine_nice)
        except OSError as exc:  # not permitted here: serve at the server's priority
            logging.getLogger(__name__).warning("the engine process keeps its priority (nice failed: %s)", exc)
    # the cores free now, counted before this process loads anything (torch's default, one thread per core
    # whether busy or not, slows each step many times over on a shared machine)
    threads = config.threads or engine_threads(free_cores())
    import torch

    torch.set_num_threads(threads)
    # the policy's worker thread must get the GIL within its budget even while a guard replay runs
    sys.setswitchinterval(0.0005)
    try:
        loop = EngineLoop(config, conn)
    except Exception as exc:
        message = str(exc) if isinstance(exc, ValueError) else \
            f"the engine could not start: {type(exc).__name__}: {exc}"
        try:
            conn.send(EngineFailed(message))
        except OSError:
            pass
        return
    # the model, torch and the tokenizer live as long as the process: out of the collector's reach,
    # a full collection no longer walks them in the middle of a step (about 85 ms with torch loaded)
    gc.collect()
    gc.freeze()
    loop.run()
