"""The HTTP side's handle on the engine: it starts the engine process, decides arrivals, hands
admitted requests over a pipe, and puts each request's text into its bounded :class:`Stream`.

An arrival is decided on at once, in this process, by a twin of the engine's controller on the
engine's latest :class:`~engine.serve.engine_proc.Snapshot` (its Observation and the controller's
admission state), with every request handed over since that snapshot counted as waiting: one
exact count, so ``max_waiting`` holds under any interleaving.

If the engine process dies or stops answering for ``engine_timeout_s``, every open stream ends
with an error, new arrivals get 503 and ``/ready`` says so while a new engine process starts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from tidegate.ctrl.base import Rejection
from tidegate.engine.core.request import RequestState
from tidegate.engine.core.stats import FrontArrivals
from tidegate.engine.real.llm import check_prompt
from tidegate.engine.serve.engine_proc import EngineLoop, apply_queue_timeout, engine_main, observation_of
from tidegate.engine.serve.messages import (
    AddRequest, CancelRequest, EngineFailed, EngineInfo, EngineReady, Outcome, RecordRejection, Shutdown, Snapshot,
    Tick, TokenEvent, UnknownMessage, unknown_message,
)
from tidegate.engine.serve.metrics import ServerMetrics

if TYPE_CHECKING:
    from tidegate.engine.serve.config import ServeConfig

log = logging.getLogger("tidegate.server")

#: seconds between restarts of an engine that fails to start, at most
_MAX_RESTART_WAIT_S = 30.0


class EngineUnavailable(Exception):
    """The engine is not running (starting again, or the server is stopping)."""


class Stream:
    """What the engine hands one HTTP request: its :class:`TokenEvent` s as they come (``delta``,
    ``finished``, ``logprobs``, ``prompt_logprobs``), then the end and its :class:`Outcome`.
    ``logprobs`` are the entries of the tokens committed since the previous chunk and
    ``prompt_logprobs`` those of the prompt (once), when the request asked for them; None otherwise.

    :param event: set when chunks arrive; the streams of one completion's choices share one
    """

    __slots__ = ("loop", "event", "chunks", "result", "limit", "overflowed", "arrival_s", "first_token_s",
                 "last_token_s", "admitted", "sid", "max_tokens")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int, event: asyncio.Event | None = None) -> None:
        self.loop = loop
        self.event = event or asyncio.Event()
        self.chunks: deque[TokenEvent] = deque()
        self.result: Outcome | None = None
        self.limit = limit
        self.overflowed = False
        self.arrival_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.admitted = False
        self.sid = -1
        self.max_tokens: int | None = None


def _set_events(streams: list[Stream]) -> None:
    for stream in streams:
        stream.event.set()


def _wake(streams: list[Stream]) -> None:
    """One wake-up of each event loop per tick for every stream that got data (not one per token)."""
    by_loop: dict[int, list[Stream]] = {}
    for s in streams:
        by_loop.setdefault(id(s.loop), []).append(s)
    for group in by_loop.values():
        try:
            group[0].loop.call_soon_threadsafe(_set_events, group)
        except RuntimeError:  # that loop has closed: nobody waits on these streams
            pass


class _Engine:
    """One engine process (or thread) and the pipe to it."""

    def __init__(self, conn, process=None, thread=None, local: EngineLoop | None = None) -> None:
        self.conn = conn
        self.process = process
        self.thread = thread
        self.local = local
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.last_message_s = time.monotonic()
        self.lost = False
        self.info: EngineInfo | None = None
        self.seen = {"evictions": 0, "interventions": 0, "guard_switches": 0}
        self.seen_fallbacks: dict[str, int] = {}

    def send(self, msg) -> None:
        self.outbox.put(msg)

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()


class EngineService:
    """The engine as the HTTP side sees it.

    :param config: the server settings (``engine_process``: a process of its own, or a thread here)
    :param metrics: the server's Prometheus metrics
    :param model_and_tokenizer: an already loaded ``(model, tokenizer)``; the engine then runs in a
        thread of this process
    """

    def __init__(self, config: ServeConfig, metrics: ServerMetrics, model_and_tokenizer=None) -> None:
        self.config = config
        self.metrics = metrics
        self.in_process = model_and_tokenizer is not None or not config.engine_process
        self._model_and_tokenizer = model_and_tokenizer
        self.draining = False
        self.in_flight = 0
        self.restarts = 0
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        #: what a request that leaves out a sampling parameter gets (the model's generation_config.json)
        self.sampling_defaults: dict[str, float] = {}
        self.mirror: Any = None
        self._lock = threading.Lock()
        self._streams: dict[int, Stream] = {}
        self._sids = itertools.count()
        self._engine: _Engine | None = None
        self._alive = False
        self._stopping = False
        self._snapshot: Snapshot | None = None
        self._submitted = (0, 0)
        # arrivals judged here (FrontArrivals), and refusals since the latest snapshot came
        self._front = FrontArrivals()
        self._refused_unseen = 0
        self._admit_errors = 0
        #: requests that ended finished (not cancelled, refused or failed) since the service started
        self.finished_total = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine and wait until it serves; raises ValueError (one sentence) if it cannot."""
        engine = self._launch()
        info = engine.info
        assert info is not None
        self.info = info
        from tidegate.ctrl import build_controller

        self.mirror = build_controller(self.config.controller, info.profile)
        apply_queue_timeout(self.mirror, self.config.queue_timeout_s)
        if self.in_process and engine.local is not None:
            self.tokenizer = engine.local.llm.tokenizer
        else:
            from tidegate.engine.real.model import load_tokenizer

            self.tokenizer = load_tokenizer(self.config.model)
        if self.config.generation_config == "auto":
            from tidegate.engine.real.model import sampling_defaults

            self.sampling_defaults = sampling_defaults(self.config.model)
            if self.sampling_defaults:
                log.info("requests that leave them out get the model's generation_config.json sampling defaults: %s "
                         "(--generation-config vllm: none)", self.sampling_defaults)
        self._adopt(engine)
        threading.Thread(target=self._watch, name="tidegate-engine-watch", daemon=True).start()

    def _launch(self) -> _Engine:
        """A new engine, ready to serve."""
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        if self.in_process:
            local = EngineLoop(self.config, there, self._model_and_tokenizer)
            thread = threading.Thread(target=local.run, name="tidegate-engine", daemon=True)
            engine = _Engine(here, thread=thread, local=local)
            thread.start()
        else:
            process = ctx.Process(target=engine_main, args=(self.config, there), name="tidegate-engine",
                                  daemon=True)
            process.start()
            there.close()
            engine = _Engine(here, process=process)
        try:
            ready = here.poll(self.config.engine_start_timeout_s)
            msg = here.recv() if ready else EngineFailed(f"the engine did not start within "
                                                         f"{self.config.engine_start_timeout_s:g} s")
        except (EOFError, OSError):
            code = engine.process.exitcode if engine.process is not None else None
            msg = EngineFailed(f"the engine process exited while starting (exit code {code})")
        match msg:
            case EngineReady():
                engine.info = msg.info
            case EngineFailed():
                engine.kill()
                raise ValueError(msg.message)
            case _:
                engine.kill()
                raise ValueError(str(unknown_message("the server starting the engine", msg,
                                                     (EngineReady, EngineFailed))))
        engine.last_message_s = time.monotonic()
        return engine

    def _adopt(self, engine: _Engine) -> None:
        with self._lock:
            self._engine = engine
            self._submitted = (0, 0)
            self._snapshot = None
            self._refused_unseen = 0
            self._alive = True
        threading.Thread(target=self._read, args=(engine,), name="tidegate-engine-read", daemon=True).start()
        threading.Thread(target=self._write, args=(engine,), name="tidegate-engine-write", daemon=True).start()
        self.metrics.engine_up.set(1)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        engine = self._engine
        if engine is None:
            return
        engine.send(Shutdown())
        if engine.process is not None:
            engine.process.join(timeout_s)
            engine.kill()
        elif engine.thread is not None:
            engine.thread.join(timeout_s)
        self._lose(engine, "the server is stopping")

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def engine_pid(self) -> int | None:
        engine = self._engine
        return engine.info.pid if engine is not None and engine.info is not None and self._alive else None

    @property
    def local(self) -> EngineLoop | None:
        """The engine loop when it runs in this process (tests reach into it), else None."""
        engine = self._engine
        return engine.local if engine is not None else None

    def status(self) -> dict:
        """What ``/health`` reports beyond ok: the engine's pid, and who decides."""
        out: dict[str, Any] = {"engine_pid": self.engine_pid, "engine_restarts": self.restarts}
        snap = self._snapshot
        if snap is not None:
            if snap.degraded:
                causes = ", ".join(sorted(snap.fallbacks)) or "no policy"
                out["controller"] = f"degraded: the slo-flow fallback decides ({causes})"
            elif snap.guarded:
                out["controller"] = "guarded: the slo-flow heuristic decides"
        return out

    def load_gauges(self) -> dict[str, float]:
        """The load gauges ``/metrics`` exports (``num_requests_waiting``, ``num_requests_running``,
        ``kv_cache_usage_perc``, ``num_preemptions_total``) as of the latest tick, by the gateway's names, and
        the requests finished whole so far; empty before the first tick."""
        snap, info = self._snapshot, self.info
        if snap is None or info is None:
            return {}
        return {"waiting": float(snap.waiting), "running": float(snap.running),
                "kv_usage": snap.kv_used_tokens / info.kv_capacity_tokens, "preemptions": float(snap.evictions),
                "finished": float(self.finished_total)}

    @property
    def degraded(self) -> bool:
        snap = self._snapshot
        return bool(snap is not None and snap.degraded)

    def idle(self) -> bool:
        """Nothing handed over, waiting, running or holding KV (as of the latest tick)."""
        snap = self._snapshot
        return (snap is not None and not snap.has_unfinished and snap.kv_used_tokens == 0
                and snap.taken_requests == self._submitted[0] and not self._streams)

    # ------------------------------------------------------------------ arrivals (the HTTP loop)
    def check_request(self, prompt_ids: list[int], max_tokens: int) -> None:
        """Raise ValueError (one sentence) for a request the engine can never run."""
        info = self.info
        assert info is not None
        check_prompt(prompt_ids, max_tokens, info.vocab_size, info.kv_capacity_tokens, info.max_model_len)

    @property
    def max_model_len(self) -> int | None:
        return self.info.max_model_len if self.info is not None else None

    def admission(self, prompt_len: int, max_tokens: int) -> Rejection | None:
        """The controller's answer on the engine's latest snapshot, counting the requests handed
        over since then as waiting, and those and the arrivals refused since then in its busy period."""
        now = time.monotonic()
        self._front.judged(now)
        snap = self._snapshot
        if snap is None:
            return None
        obs = observation_of(snap.obs)
        in_transit = self._submitted[0] - snap.taken_requests
        self._front.count(obs, in_transit + self._refused_unseen + 1, now)
        obs.num_waiting += in_transit
        obs.waiting_prompt_tokens += self._submitted[1] - snap.taken_tokens
        mirror = self.mirror
        try:
            setter = getattr(mirror, "set_admission_state", None)
            if setter is not None:
                setter(snap.admission_state)
            return mirror.admit(obs, prompt_len, max_tokens)
        except Exception:  # admission must never fail a request with a 500
            if not self._admit_errors:
                log.exception("the controller's admit() failed; arrivals are accepted (logged once)")
            self._admit_errors += 1
            return None

    def submit(self, stream: Stream, prompt_ids: list[int], sampling, max_tokens: int, class_id: int = 0,
               cache_salt: str | None = None) -> None:
        """Hand an admitted request to the engine; raises :class:`EngineUnavailable` while it is down.

        :param class_id: the request's class as the controller sees it (a client's ``priority``)
        :param cache_salt: the client's ``cache_salt``: requests with different salts share no cached prefix
        """
        with self._lock:
            engine = self._engine
            if not self._alive or engine is None:
                raise EngineUnavailable("the engine is restarting")
            sid = next(self._sids)
            stream.sid = sid
            stream.max_tokens = max_tokens
            self._streams[sid] = stream
            self._submitted = (self._submitted[0] + 1, self._submitted[1] + len(prompt_ids))
            engine.send(AddRequest(sid, prompt_ids, sampling, max_tokens, class_id, cache_salt))
        stream.admitted = True
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def record_rejection(self, prompt_len: int, max_tokens: int, rejection: Rejection) -> None:
        self._refused_unseen += 1
        engine = self._engine
        if engine is not None and self._alive:
            engine.send(RecordRejection(prompt_len, max_tokens, rejection))

    def cancel(self, stream: Stream) -> None:
        engine = self._engine
        if engine is not None and stream.result is None:
            engine.send(CancelRequest(stream.sid))

    def done(self, stream: Stream) -> None:
        """The HTTP side has finished with a stream."""
        if stream.admitted:
            stream.admitted = False
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    # ------------------------------------------------------------------ the pipe (its own threads)
    def _write(self, engine: _Engine) -> None:
        while True:
            msg = engine.outbox.get()
            if msg is None:
                return
            try:
                engine.conn.send(msg)
            except (OSError, ValueError):  # the engine is gone; the reader notices
                return

    def _read(self, engine: _Engine) -> None:
        while True:
            try:
                msg = engine.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that cannot be read: the engine is not trustworthy
                log.exception("unreadable message from the engine")
                engine.kill()
                break
            engine.last_message_s = time.monotonic()
            try:
                self._dispatch(engine, msg)
            except UnknownMessage as exc:  # the two sides disagree on what they say: not trustworthy
                log.error("%s; stopping the engine", exc)
                engine.send(Shutdown())  # an engine thread cannot be killed
                engine.kill()
                break
        if self._stopping:
            reason = "the server is stopping"
        elif engine.process is not None:
            engine.process.join(1.0)
            reason = f"the engine process stopped (exit code {engine.process.exitcode})"
        else:
            reason = "the engine stopped"
        self._lose(engine, reason)

    def _dispatch(self, engine: _Engine, msg) -> None:
        """Act on one message from a serving engine; :class:`UnknownMessage` for one it does not know."""
        match msg:
            case Tick():
                self._on_tick(engine, msg.events, msg.snapshot)
            case _:
                raise unknown_message("the server", msg, (Tick,))

    def _on_tick(self, engine: _Engine, events: list[TokenEvent], snap: Snapshot) -> None:
        now = time.perf_counter()
        touched: list[Stream] = []
        overflowed: list[int] = []
        with self._lock:
            if engine is not self._engine or engine.lost:
                return
            streams = self._streams
            for event in events:
                sid, finished, outcome = event.sid, event.finished, event.outcome
                stream = streams.get(sid)
                if stream is None:
                    continue
                # every event but a bare end brings tokens (the first one even without visible text)
                if event.delta or not finished or (stream.last_token_s is None and outcome is not None
                                             and outcome.completion_tokens):
                    self._on_token(stream, now)
                if finished:
                    del streams[sid]
                    stream.result = outcome
                    self._on_finished(outcome, stream, now)
                elif stream.overflowed:
                    continue
                elif len(stream.chunks) >= stream.limit:  # the client reads too slowly: end its stream
                    stream.overflowed = True
                    overflowed.append(sid)
                    continue
                stream.chunks.append(event)
                touched.append(stream)
            self._snapshot = snap
            self._refused_unseen = 0
        for sid in overflowed:
            engine.send(CancelRequest(sid))
        if touched:
            _wake(touched)
        self._export(engine, snap)

    def _on_token(self, stream: Stream, now: float) -> None:
        if stream.last_token_s is None:
            self.metrics.ttft.observe(now - stream.arrival_s)
            stream.first_token_s = now
        else:
            self.metrics.itl.observe(now - stream.last_token_s)
        stream.last_token_s = now

    def _on_finished(self, o: Outcome, stream: Stream, now: float) -> None:
        m = self.metrics
        if o.state is RequestState.FINISHED:
            self.finished_total += 1
        prefill = None if o.engine_ttft_s is None or o.queue_s is None else max(0.0, o.engine_ttft_s - o.queue_s)
        first, last = stream.first_token_s, stream.last_token_s
        decode = None if first is None or last is None else last - first
        m.request_finished(reason=o.finish_reason if o.state is RequestState.FINISHED else o.state.value,
                           prompt_tokens=o.prompt_len, generation_tokens=o.completion_tokens,
                           max_tokens=stream.max_tokens, e2e_s=now - stream.arrival_s, queue_s=o.queue_s,
                           prefill_s=prefill, decode_s=decode)
        if o.engine_ttft_s is not None:
            m.prompt_tokens.inc(o.prompt_len)
            m.generation_tokens.inc(o.completion_tokens)
            if o.predicted_ttft_s is not None and self.info is not None:
                m.ttft_prediction_error.observe(abs(o.engine_ttft_s - o.predicted_ttft_s))
                slo = self.info.profile.ttft_slo_s
                if (o.engine_ttft_s <= slo) != (o.predicted_ttft_s <= slo):
                    m.ttft_prediction_wrong_side.inc()

    def _export(self, engine: _Engine, snap: Snapshot) -> None:
        m = self.metrics
        m.running.set(snap.running)
        m.waiting.set(snap.waiting)
        if self.info is not None:
            m.kv_usage.set(snap.kv_used_tokens / self.info.kv_capacity_tokens)
        seen = engine.seen
        for name, counter in (("evictions", m.evictions), ("interventions", m.shield_interventions),
                              ("guard_switches", m.guard_switches)):
            value = getattr(snap, name)
            if value > seen[name]:
                counter.inc(value - seen[name])
            seen[name] = value
        for cause, count in snap.fallbacks.items():
            before = engine.seen_fallbacks.get(cause, 0)
            if count > before:
                m.fallback(cause, count - before)
            engine.seen_fallbacks[cause] = count
        m.guarded.set(1 if snap.guarded else 0)
        m.degraded.set(1 if snap.degraded else 0)
        for t in snap.decision_times:
            m.decision_time.observe(t)

    # ------------------------------------------------------------------ failure and restart
    def _lose(self, engine: _Engine, reason: str) -> None:
        """The engine is gone: end every open stream with an error, then start a new engine."""
        with self._lock:
            if engine.lost:
                return
            engine.lost = True
            current = engine is self._engine
            if current:
                self._alive = False
                streams = list(self._streams.values())
                self._streams.clear()
            else:
                streams = []
        engine.outbox.put(None)
        ended = Outcome.failed(f"{reason}; the request was not completed")
        for stream in streams:
            stream.result = ended
            stream.chunks.append(TokenEvent(stream.sid, "", True, ended, None, None))
        if streams:
            _wake(streams)
        if not current:
            return
        self.metrics.engine_up.set(0)
        if self._stopping:
            return
        log.error("%s: %d open streams ended; starting a new engine", reason, len(streams))
        threading.Thread(target=self._restart, name="tidegate-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        wait = 1.0
        while not self._stopping:
            try:
                engine = self._launch()
            except Exception as exc:
                log.error("the engine did not start again (%s); next try in %.0f s", exc, wait)
                time.sleep(wait)
                wait = min(2 * wait, _MAX_RESTART_WAIT_S)
                continue
            if self._stopping:
                engine.send(Shutdown())
                return
            self.restarts += 1
            self.metrics.engine_restarts.inc()
            self._adopt(engine)
            log.warning("engine serving again (pid %s)", engine.info.pid if engine.info else "?")
            return

    def _watch(self) -> None:
        """Kill an engine that has sent nothing (not even its idle heartbeat) for ``engine_timeout_s``."""
        timeout = self.config.engine_timeout_s
        while not self._stopping:
            time.sleep(min(1.0, timeout / 4))
            engine = self._engine
            if engine is None or engine.lost or not self._alive:
                continue
            silent = time.monotonic() - engine.last_message_s
            if silent > timeout:
                log.error("the engine sent nothing for %.1f s; stopping it", silent)
                if engine.process is not None:
                    engine.kill()  # the reader sees the pipe close and ends its streams
                else:
                    self._lose(engine, f"the engine stopped answering for {silent:.0f} s")
