"""The engine side of the server: the engine loop in its own thread, and what it hands each HTTP request.

The HTTP side never runs engine code. An arrival is decided on at once from the engine's latest
observation (:meth:`EngineService.admission`); an accepted one is handed to the engine thread through
a queue, and its text comes back through a bounded per-request :class:`Stream` buffer.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import sys
import threading
import time
from collections import deque

from ctrl.base import Rejection
from engine.core.request import Request, RequestState
from engine.core.slo import time_to_first_token_s
from engine.serve.metrics import ServerMetrics
from engine.twin.guard import TwinGuard

log = logging.getLogger("tidegate.server")


class Stream:
    """What the engine thread hands one HTTP request: text deltas, then the end."""

    __slots__ = ("loop", "event", "chunks", "request", "limit", "overflowed", "arrival_s", "last_token_s",
                 "admitted", "touched")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.chunks: deque[tuple[str, bool]] = deque()
        self.request: Request | None = None
        self.limit = limit
        self.overflowed = False
        self.arrival_s = time.perf_counter()
        self.last_token_s: float | None = None
        self.admitted = False
        self.touched = False  # has data the HTTP side has not been woken for yet


def _set_events(streams: list[Stream]) -> None:
    for stream in streams:
        stream.touched = False
        stream.event.set()


class TimedController:
    """Wraps the controller to time each decision; everything else passes through."""

    def __init__(self, inner, histogram) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["_hist"] = histogram

    def decide(self, obs):
        t = time.perf_counter()
        d = self._inner.decide(obs)
        self._hist.observe(time.perf_counter() - t)
        return d

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


class EngineService:
    """Owns the LLM and runs its engine loop in a thread; every call from HTTP goes through a queue.

    :param llm: the loaded :class:`engine.real.llm.LLM`
    :param metrics: the server's Prometheus metrics
    :param queue_timeout_s: how long a request may wait to start before it ends with 503; None keeps
        the controller's own setting
    :param guard: the runtime twin guard of a learned controller (``engine.twin.guard``): True builds
        one with default settings on the LLM's profile when the controller is the shielded learned
        one, False never; or a ``TwinGuard`` of this engine's controller
    """

    def __init__(self, llm, metrics: ServerMetrics, queue_timeout_s: float | None = None,
                 guard: TwinGuard | bool = True) -> None:
        self.llm = llm
        self.core = llm.core
        self.metrics = metrics
        controller = self.core.controller
        self.core.controller = TimedController(controller, metrics.decision_time)
        if queue_timeout_s is not None:
            self.core.controller.queue_timeout_s = queue_timeout_s
        self.guard = _guard_for(llm, controller) if guard is True else (guard or None)
        if self.guard is not None:
            self._feed_guard(self.guard)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.in_flight = 0
        self.draining = False
        self._stop = False
        self._ids = itertools.count()
        self._seen_evictions = 0
        self._seen_interventions = 0
        self._seen_guard_switches = 0
        self.thread = threading.Thread(target=self._run, name="tidegate-engine", daemon=True)
        self._touched: list[Stream] = []
        # (requests, prompt tokens) handed to the engine thread, and taken by it: each written by
        # one thread only, so their difference is exact without a lock.
        self._submitted = (0, 0)
        self._taken = (0, 0)

    # -- called from the HTTP side
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def admission(self, prompt_len: int, max_tokens: int) -> Rejection | None:
        """The controller's answer on the engine's latest observation (read-only, any thread),
        counting the requests handed over since then as waiting."""
        obs = copy.copy(self.core.obs)
        obs.num_waiting += self._submitted[0] - self._taken[0]
        obs.waiting_prompt_tokens += self._submitted[1] - self._taken[1]
        return self.core.controller.admit(obs, prompt_len, max_tokens)

    def submit(self, stream: Stream, prompt_ids: list[int], sampling, max_tokens: int) -> None:
        self._submitted = (self._submitted[0] + 1, self._submitted[1] + len(prompt_ids))
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        self.inbox.put(("add", stream, prompt_ids, sampling, max_tokens))
        self.wake.set()

    def record_rejection(self, prompt_len: int, max_tokens: int, rejection: Rejection) -> None:
        self.inbox.put(("reject", prompt_len, max_tokens, rejection))
        self.wake.set()

    def cancel(self, stream: Stream) -> None:
        self.inbox.put(("cancel", stream))
        self.wake.set()

    def done(self, stream: Stream) -> None:
        """The HTTP side has finished with a stream."""
        if stream.admitted:
            stream.admitted = False
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    # -- the engine thread
    def _run(self) -> None:
        llm = self.llm
        # The HTTP loop and this thread share the GIL: switch often so a 429 is never held up
        # behind a long stretch of engine bookkeeping.
        sys.setswitchinterval(0.001)
        while not self._stop:
            self._drain_inbox()
            if llm.has_unfinished:
                try:
                    llm.step()
                except Exception:  # a bug outside the executor: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all()
                self._wake_streams()
                self._update_gauges()
                self._tick_guard()
            else:
                self._wake_streams()
                self._update_gauges()
                self._tick_guard()
                self.wake.wait(0.05)
                self.wake.clear()

    def _touch(self, stream: Stream) -> None:
        if not stream.touched:
            stream.touched = True
            self._touched.append(stream)

    def _wake_streams(self) -> None:
        """One wake-up of the HTTP loop per step for every stream that got data (not one per token)."""
        if self._touched:
            touched, self._touched = self._touched, []
            touched[0].loop.call_soon_threadsafe(_set_events, touched)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "add":
                _, stream, ids, sampling, max_tokens = item
                self._add(stream, ids, sampling, max_tokens)
                self._taken = (self._taken[0] + 1, self._taken[1] + len(ids))
            elif kind == "reject":
                _, n, max_tokens, rejection = item
                r = Request(f"rejected-{next(self._ids)}", self.core.clock.now(), n, max_tokens)
                self.core.add_request(r, admission=rejection)
            elif kind == "cancel":
                r = item[1].request
                if r is not None and not r.state.is_terminal:
                    self.llm.cancel(r)

    def _record_prediction(self, r: Request) -> None:
        """How far the engine's TTFT prediction at admission (engine clock) was from the realised TTFT."""
        if r.predicted_ttft_s is None or r.first_token_time_s is None:
            return
        realised = time_to_first_token_s(r)
        self.metrics.ttft_prediction_error.observe(abs(realised - r.predicted_ttft_s))
        slo = self.llm.profile.ttft_slo_s
        if (realised <= slo) != (r.predicted_ttft_s <= slo):
            self.metrics.ttft_prediction_wrong_side.inc()

    def _add(self, stream: Stream, ids, sampling, max_tokens) -> None:
        def on_delta(r: Request, delta: str, finished: bool) -> None:
            now = time.perf_counter()
            if delta:
                if stream.last_token_s is None:
                    self.metrics.ttft.observe(now - stream.arrival_s)
                    self._record_prediction(r)
                else:
                    self.metrics.itl.observe(now - stream.last_token_s)
                stream.last_token_s = now
            if finished:
                self._on_finished(r, stream, now)
            elif len(stream.chunks) >= stream.limit:
                if not stream.overflowed:  # the client reads too slowly: end its stream
                    stream.overflowed = True
                    self.llm.cancel(r)
                return
            stream.chunks.append((delta, finished))
            self._touch(stream)

        try:
            r = self.llm.add_request(ids, sampling, max_tokens, request_id=f"cmpl-{next(self._ids)}",
                                     on_delta=on_delta, admission=None)
        except ValueError as exc:  # checked on arrival already; a race with a resize would land here
            stream.chunks.append((str(exc), True))
            self._touch(stream)
            return
        stream.request = r
        if r.state.is_terminal:  # ended at once (refused by the engine's own checks)
            stream.chunks.append(("", True))
            self._touch(stream)

    def _on_finished(self, r: Request, stream: Stream, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - stream.arrival_s)
        if r.first_token_time_s is not None:
            m.prompt_tokens.inc(r.prompt_len)
            m.generation_tokens.inc(len(r.output_token_ids))
        if r.start_time_s is not None:
            m.queue_time.observe(max(0.0, r.start_time_s - r.arrival_time_s))
        m.finished(r.finish_reason if r.state is RequestState.FINISHED else r.state.value)

    def _fail_all(self) -> None:
        core = self.core
        for r in list(core.running) + list(core.waiting):
            core.cancel(r)

    def _update_gauges(self) -> None:
        # Arrivals are decided on the HTTP side from this observation: keep it current between
        # steps and while idle, or a queue that has drained would still look full.
        self.core.observe()
        core, m = self.core, self.metrics
        m.running.set(len(core.running))
        m.waiting.set(len(core.waiting))
        m.kv_usage.set(core.pool.used_tokens / core.pool.capacity_tokens)
        ev = core.metrics.evictions
        if ev > self._seen_evictions:
            m.evictions.inc(ev - self._seen_evictions)
            self._seen_evictions = ev
        iv = getattr(core.controller, "interventions", None)
        if isinstance(iv, int) and iv > self._seen_interventions:
            m.shield_interventions.inc(iv - self._seen_interventions)
            self._seen_interventions = iv

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
        """Start the guard's replays of a settled window in its thread, apply a finished check, and
        export its state."""
        guard = self.guard
        if guard is None:
            return
        try:
            guard.maybe_check(self.core.clock.now(), background=True)
        except Exception:  # the guard must never take the engine loop down
            log.exception("twin guard failed; the controller keeps its current mode")
            self.guard = None
            return
        m = self.metrics
        if guard.switches > self._seen_guard_switches:
            m.guard_switches.inc(guard.switches - self._seen_guard_switches)
            self._seen_guard_switches = guard.switches
        m.guarded.set(1 if guard.guarded else 0)


def _guard_for(llm, controller) -> TwinGuard | None:
    """A twin guard for a shielded learned controller on the LLM's profile; None for any other."""
    inner = getattr(controller, "inner", None)
    profile = getattr(llm, "profile", None)
    if profile is None or not callable(getattr(inner, "set_guarded", None)):
        return None
    return TwinGuard(profile, controller)
