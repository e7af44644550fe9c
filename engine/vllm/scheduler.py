"""vLLM's scheduler with a tidegate controller at every step.

``--scheduler-cls tidegate.engine.vllm.scheduler.TidegateScheduler`` (or ``TidegateAsyncScheduler``
when vLLM schedules asynchronously; its CPU build never does). At each ``schedule()``:

1. observe: vLLM's waiting and running requests and KV blocks into tidegate's ``ObservationStats``
   (``VllmObserver``), which arrivals, first tokens, completions, preemptions and step times feed;
2. decide: the controller's Decision, checked and in time, or a conservative one (``CheckedDecider``);
3. apply: ``max_num_active_reqs = running + activations`` (at most the running cap and vLLM's own
   limit), ``max_num_scheduled_tokens = token budget`` (at most vLLM's configured budget, and only
   with chunked prefill: without it a budget below a prompt would never schedule it);
4. let vLLM's own ``schedule()`` run: chunked prefill, prefix caching and preemption by recompute
   are vLLM's, untouched;
5. after ``update_from_output()``: the step's duration (from the start of ``schedule()``) and one
   row of the step log.

After each decision the step's Observation, the controller's admission state and the engine's
counters go to the record the API process reads (``channel``): its middleware answers 429 from
them, and puts the counters on ``/metrics``. The arrivals it refused come back through the same
channel, so the controller's arrival rate counts them, as in tidegate's own engine.

A bad setting or an unsupported vLLM ends start-up with one line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import deque
from typing import Any, NoReturn

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tidegate.ctrl.base import Controller, Decision
from tidegate.ctrl.theory import decode_token_s
from tidegate.engine.core.builder import rate_window_s
from tidegate.engine.sim.online import OnlineProfile
from tidegate.engine.vllm.channel import (
    EngineCounters, EngineRecordWriter, RefusalReader, default_channel, remove_stale_channels,
)
from tidegate.engine.vllm.config import (
    PluginConfigError, ReplicaLimits, build_plugin_controller, read_plugin_config, replica_profile,
    share_vllm_log_handlers,
)
from tidegate.engine.vllm.decider import CheckedDecider
from tidegate.engine.vllm.observer import VllmObserver
from tidegate.engine.vllm.step_log import StepLog, StepRow
from tidegate.engine.vllm.version import UnsupportedVllmError, check_vllm_version

log = logging.getLogger(__name__)

#: the statuses of a request that ended by itself (the others were aborted, ignored or failed)
COMPLETED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                       RequestStatus.FINISHED_REPETITION})


def _refuse(exc: Exception) -> NoReturn:
    """End vLLM's start-up with one line on stderr (no traceback from the engine process)."""
    sys.stderr.write(f"tidegate: error: {exc}\n")
    sys.stderr.flush()
    raise SystemExit(2)


class TidegateSchedulerMixin:
    """The plugin's part of the scheduler; mixed before vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    # until start-up has set them (vLLM may free requests from its own __init__ paths)
    _observer: VllmObserver | None = None
    _decider: CheckedDecider | None = None
    _guard: Any = None
    _step_log: StepLog | None = None
    _publisher: EngineRecordWriter | None = None
    _refusals: RefusalReader | None = None
    _online: OnlineProfile | None = None
    _counters: EngineCounters | None = None
    #: the controller (None: ``vllm``, vLLM's own scheduling)
    tidegate_controller: Controller | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            check_vllm_version()
        except UnsupportedVllmError as exc:
            _refuse(exc)
        super().__init__(*args, **kwargs)
        try:
            self._start_tidegate()
        except PluginConfigError as exc:
            _refuse(exc)

    def _start_tidegate(self) -> None:
        s: Any = self
        share_vllm_log_handlers()
        config = read_plugin_config(s.vllm_config.additional_config)
        pool = s.kv_cache_manager.block_pool
        limits = ReplicaLimits(kv_capacity_tokens=(pool.num_gpu_blocks - 1) * s.block_size, block_size=s.block_size,
                               max_num_seqs=s.max_num_running_reqs,
                               max_num_batched_tokens=s.max_num_scheduled_tokens)
        profile = replica_profile(config, limits)
        controller = build_plugin_controller(config, profile)
        # the step model refitted from this replica's steps, which the controller reads through its profile
        self._online = profile if isinstance(profile, OnlineProfile) and controller is not None else None
        self.tidegate_limits = limits
        self.tidegate_controller = controller
        self._configured_tokens = s.max_num_scheduled_tokens
        self._configured_active = min(s.max_num_active_reqs, s.max_num_running_reqs)
        self._chunked_prefill = bool(s.scheduler_config.enable_chunked_prefill)
        if config.step_log:
            self._step_log = StepLog(config.step_log)
        if controller is not None or self._step_log is not None:
            self._observer = VllmObserver(limits.kv_capacity_tokens, limits.block_size, rate_window_s(profile),
                                          profile)
        if controller is not None:
            self._decider = CheckedDecider(controller, config.decide_timeout_s, limits.max_num_batched_tokens,
                                           limits.max_num_seqs)
            # an env answering the policy's calls is the policy being trained or judged: no guard hands its
            # intervals to the prior behind its back
            self._guard = None if config.action_channel else _guard_for(profile, controller)
            # vLLM's engine process is a child of its API process, which names the channel the same way
            channel = config.channel or default_channel(os.getppid())
            remove_stale_channels(channel)
            self._publisher = EngineRecordWriter(channel, limits)
            self._refusals = RefusalReader(channel)
            self._counters = EngineCounters()
            self._shield = controller if hasattr(controller, "interventions") else None
            inner = getattr(controller, "inner", None)
            self._learned = inner if inner is not None and hasattr(inner, "fallbacks") else None
            log.info("tidegate: the engine publishes its observations to %s", self._publisher.path)
        self._arrivals = 0
        self._steps: deque[tuple[Any, StepRow, float]] = deque()  # scheduled, not yet committed
        self._step_index = 0
        log.info("tidegate: controller %r on vLLM's scheduler (KV %d tokens in blocks of %d, at most %d running, "
                 "%d tokens a step%s)", config.controller, limits.kv_capacity_tokens, limits.block_size,
                 limits.max_num_seqs, limits.max_num_batched_tokens,
                 f"; step log {config.step_log}" if config.step_log else "")

    # ------------------------------------------------------------------ vLLM's hooks
    def add_request(self, request: Any) -> None:
        s: Any = self
        new = request.request_id not in s.requests
        super().add_request(request)  # type: ignore[misc]
        if new and self._observer is not None:
            self._observer.arrived(request)
            self._arrivals += 1

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        s: Any = self
        observer = self._observer
        if observer is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        start = time.perf_counter()
        step = self._step_index
        self._step_index += 1
        if self._refusals is not None:
            for prompt in self._refusals.new():
                observer.refused(prompt)
        obs = observer.observe(step, s.waiting, s.kv_holding_waiting, s.running, s.kv_cache_manager.usage)
        row = StepRow(step, obs.now_s, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, obs.num_waiting, obs.num_running,
                      obs.kv_used_tokens, observer.kv_capacity_tokens, block_size=s.block_size)
        if self._decider is not None:
            self._apply(self._decider.decide(obs), row)
            row.fallback = self._decider.last_fallback or ""
            row.decide_s = self._decider.last_wait_s
            self._publish(obs, row.decide_s)
        else:  # vLLM's own scheduling: its configured limits apply
            row.token_budget = s.max_num_scheduled_tokens
            row.running_cap = min(s.max_num_active_reqs, s.max_num_running_reqs)
        own = time.perf_counter()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        after = time.perf_counter()
        observer.scheduled(output, s.requests, s.running, row)
        self._steps.append((output, row, start))
        row.plugin_s = (own - start) + (time.perf_counter() - after)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        observer = self._observer
        if observer is None:
            return outputs
        end = time.perf_counter()
        steps = self._steps
        while steps and steps[0][0] is not scheduler_output:  # never happens: vLLM commits steps in order
            steps.popleft()
        if not steps:
            return outputs
        _, row, start = steps.popleft()
        row.real_s = end - start
        s: Any = self
        observer.committed(scheduler_output, s.requests, row.real_s)
        online = self._online
        if online is not None and online.step(row.tokens, row.kv_tokens_read, row.real_s, row.decode_tokens,
                                              row.prefills):
            self._refitted(online)
        if self._guard is not None:
            self._tick_guard(observer.now())
        if self._step_log is not None and row.tokens:
            row.plugin_s += time.perf_counter() - end
            self._step_log.write(row)
        return outputs

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        observer = self._observer
        if observer is not None:
            ended = observer.finished(request, request.status in COMPLETED)
            if ended is not None and self._guard is not None:
                self._guard.on_finish(ended)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        super().shutdown()  # type: ignore[misc]

    # ------------------------------------------------------------------ the decision
    def _apply(self, d: Decision, row: StepRow) -> None:
        """Set vLLM's admission, running cap and token budget for this step from ``d``."""
        s: Any = self
        running = len(s.running) + s.num_waiting_for_streaming_input
        activations = d.activation_budget
        if d.class_budgets is not None:  # vLLM's queue has no classes: their sum
            activations = min(activations, sum(d.class_budgets.values()))
        if d.kv_reserve_ratio is not None and activations > 0:
            fit = self._activations_reserved(d.kv_reserve_ratio, activations)
            activations = fit if running else max(fit, 1)  # nothing runs: the head starts, never a stall
        cap = min(d.running_cap, self._configured_active)
        s.max_num_active_reqs = max(min(running + activations, cap), 0)
        tokens = min(d.token_budget, self._configured_tokens) if self._chunked_prefill else self._configured_tokens
        s.max_num_scheduled_tokens = tokens
        row.activation_budget = max(min(activations, cap - running), 0)
        row.token_budget = tokens
        row.running_cap = cap
        if self._observer is not None:
            self._observer.token_budget = tokens
            self._observer.running_cap = cap

    def _activations_reserved(self, ratio: float, most: int) -> int:
        """How many of the first ``most`` waiting requests can start with ``ratio`` of every running and
        started request's remaining ``max_tokens`` reserved in the KV cache (tidegate's reservation)."""
        s: Any = self
        bs = s.block_size
        capacity = self.tidegate_limits.kv_capacity_tokens

        def reservation(r: Any) -> int:
            future = math.ceil(ratio * max(r.max_tokens - r.num_output_tokens, 0))
            return -(-(r.num_tokens + future) // bs) * bs

        reserved = sum(reservation(r) for r in s.running)
        n = 0
        for queue in (s.kv_holding_waiting, s.waiting):
            for r in queue:
                reserved += reservation(r)
                if n >= most or reserved > capacity:
                    return n
                n += 1
        return n

    def _publish(self, obs: Any, decide_s: float) -> None:
        """The step's Observation, the admission state and the counters, for the API process."""
        publisher, counters, decider = self._publisher, self._counters, self._decider
        if publisher is None or decider is None or counters is None:
            return
        counters.decided(decide_s)
        shield, learned, guard = self._shield, self._learned, self._guard
        try:
            state = decider.controller.admission_state()
            if shield is not None:
                counters.interventions = shield.interventions
            if learned is not None:
                counters.degraded = bool(learned.degraded)
                counters.fallbacks = {**decider.fallbacks, **learned.fallbacks}
            else:
                counters.fallbacks = decider.fallbacks
            if guard is not None:
                counters.guard_switches, counters.guarded = guard.switches, bool(guard.guarded)
            publisher.publish(obs, state, self._arrivals, counters)
        except Exception:  # the API process then admits on a stale record (and counts it)
            log.exception("tidegate: publishing the step's observation failed; the API process no longer sees "
                          "the engine's state")
            self._publisher = None

    def _refitted(self, online: OnlineProfile) -> None:
        """The step model was refitted: the guard's twin takes it, the API process gets it with the next record."""
        if self._guard is not None:
            self._guard.profile = online.current
        if self._counters is not None:
            self._counters.profile_fits = online.fits
            self._counters.fitted = online.current
        fit, fitted = online.last_fit or {}, online.current
        (log.info if online.fits == 1 else log.debug)(
            "tidegate: step model refitted on the last %d steps (MAPE %.1f%%): %.3g s a step, %.3g s a prefill "
            "token, %.3g s a decode token, %.3g s a KV token read", fit.get("points", 0), 100 * fit.get("mape", 0.0),
            fitted.base_s, fitted.per_token_s, decode_token_s(fitted), fitted.per_kv_token_s)

    def _tick_guard(self, now_s: float) -> None:
        try:
            self._guard.maybe_check(now_s, background=True)
        except Exception:  # the guard must never take vLLM's engine down
            log.exception("tidegate: the runtime guard failed; the controller keeps its current mode")
            self._guard = None

    @property
    def tidegate_fallbacks(self) -> dict[str, int]:
        """Steps that took the conservative decision, by cause."""
        return dict(self._decider.fallbacks) if self._decider is not None else {}


class TidegateScheduler(TidegateSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` with a tidegate controller (vLLM's CPU build; ``--no-async-scheduling``)."""


class TidegateAsyncScheduler(TidegateSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with a tidegate controller (async scheduling, vLLM's default on CUDA)."""


def _guard_for(profile: Any, controller: Controller) -> Any:
    """The runtime twin guard of a shielded learned controller, as ``tidegate serve`` makes it; None
    for any other controller."""
    inner = getattr(controller, "inner", None)
    if not callable(getattr(inner, "set_guarded", None)):
        return None
    from tidegate.engine.twin.guard import TwinGuard

    return TwinGuard(profile, controller)
