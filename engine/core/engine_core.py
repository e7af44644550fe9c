"""EngineCore: one continuous-batching loop shared by the simulator twin and the real engine.

A step, along vLLM's seams: observe, ask the controller for a Decision and check it
(``_decide``), let the scheduler turn it into the step's plan (``Scheduler.schedule``: a fresh
``Batch``), run the plan on the executor, and let the scheduler commit the result
(``Scheduler.update``). The step loop owns nothing else: the requests and the KV pool are the
scheduler's, the figures a controller sees are the statistics' (``ObservationStats``).

With an executor that reads only a batch's counts (``reads_requests = False``, the simulator's),
decoding requests are counted in aggregate (``SteadyDecodes``): the schedule is exactly the one
per-request bookkeeping gives; only the running requests' token counts lag until ``sync()``
(``step()`` syncs unless asked not to).

An evicted request keeps its output tokens by default and recomputes their KV by prefill when it
runs again (vLLM's recompute preemption), so eviction never changes text a client has seen;
``eviction="reset"`` discards its progress instead (the paper's model, for reproductions).

Nothing a controller, an executor or a callback does ends the loop: a controller that raises or
answers nonsense gets a conservative Decision for that step, a failing executor fails that step's
requests, a failing callback is skipped; each is counted and logged once per cause.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

from tidegate.ctrl.base import (
    LEADING_OUTPUTS, UNLIMITED, Controller, Decision, Observation, Rejection, ReplicaProfile, retry_after_s,
)
from tidegate.ctrl.slo_flow import predicted_ttft_s
from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.clock import Clock
from tidegate.engine.core.decision import bounded, plainly_usable, real_number
from tidegate.engine.core.executor import Batch, Executor
from tidegate.engine.core.metrics import EngineMetrics
from tidegate.engine.core.request import Request, RequestState, unservable_reason
from tidegate.engine.core.scheduler import Scheduler, count_error
from tidegate.engine.core.stats import ObservationStats
from tidegate.engine.core.steady_decodes import leading_outputs, running_outputs

#: ``recompute``: an evicted request keeps its tokens and re-prefills them (vLLM); ``reset``: its
#: progress is discarded (the paper's model)
EVICTION_MODES = ("recompute", "reset")


class _Ask:
    """The type of ``ASK``, add_request's default: ask the controller."""


ASK = _Ask()


class EngineCore:
    """The scheduling loop around a block pool, a controller and an executor.

    :param controller: decides activations, batch size and admission.
    :param executor: runs each step's batch (simulated or real).
    :param clock: ``VirtualClock`` for simulation, ``WallClock`` for the real engine.
    :param kv_capacity_tokens: KV capacity M in tokens.
    :param block_size: tokens per KV block.
    :param rate_window_s: time constant of the arrival and completion rate estimates.
    :param on_token: called as ``on_token(request, token_id)`` for every committed output token
        (token_id is None in simulation); the server streams from it.
    :param on_finish: called once with each request that reaches a terminal state.
    :param eviction: ``recompute`` (default): an evicted request keeps its output tokens and
        recomputes their KV by prefill when it runs again; ``reset``: its progress is discarded
        and it starts over (the paper's model, for reproducing it).
    :param prefix_caching: a request starts with the blocks of its prompt's longest cached prefix
        and prefills only the rest (``BlockPool``); it counts only those tokens as its prefill in
        the queue's work, the controller's admission and its predicted TTFT.
    :param ttft_profile: the replica's step model, for the predicted TTFT's compute bound on the prefill
        ahead (``ctrl.slo_flow.predicted_ttft_s``): the prediction each request records, whose errors
        become ``Observation.ttft_error_p95_s``, is then the one slo-flow judges arrivals on.
        ``build_engine`` passes the replica's profile.
    """

    def __init__(
        self,
        controller: Controller,
        executor: Executor,
        clock: Clock,
        kv_capacity_tokens: int,
        block_size: int = 16,
        rate_window_s: float = 10.0,
        on_token: Callable[[Request, int | None], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        record_steps: bool = True,
        eviction: str = "recompute",
        prefix_caching: bool = True,
        ttft_profile: ReplicaProfile | None = None,
    ) -> None:
        if eviction not in EVICTION_MODES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_MODES)}, got {eviction!r}")
        self.controller = controller
        self.ttft_profile = ttft_profile
        self.clock = clock
        self.eviction = eviction
        self.pool = BlockPool(kv_capacity_tokens, block_size, prefix_caching)
        self.metrics = EngineMetrics(record_steps=record_steps)
        #: the statistics the controller's Observation is made from (``stats.current``: as of now)
        self.stats = ObservationStats(self.pool.capacity_tokens, block_size, rate_window_s)
        #: times a controller raised or answered something unusable, by cause
        self.controller_errors: dict[str, int] = {}
        #: times an ``on_token`` or ``on_finish`` callback raised, by cause
        self.callback_errors: dict[str, int] = {}
        #: steps whose executor (or the commit of its result) raised, by cause
        self.step_errors: dict[str, int] = {}
        #: the requests, each step's plan and the update from its result
        self.scheduler = Scheduler(self.pool, clock, self.stats, self.metrics, executor, eviction == "reset",
                                   self.callback_errors)
        self.executor = executor
        self.on_token = on_token
        self.on_finish = on_finish
        self._token_budget = 8192  # the last applied token budget, for TTFT predictions
        self._running_cap = UNLIMITED  # the last applied running cap
        self.step_index = 0

    @property
    def obs(self) -> Observation:
        """The engine's figures as of the last event (its own: a controller gets copies)."""
        return self.stats.current

    @property
    def executor(self) -> Executor:
        """What runs the steps; one may be swapped in between steps."""
        return self._executor

    @executor.setter
    def executor(self, executor: Executor) -> None:
        self._executor = executor
        self.scheduler.executor = executor
        self.scheduler.lists_requests = getattr(executor, "reads_requests", True)

    @property
    def on_token(self) -> Callable[[Request, int | None], None] | None:
        """Called as ``on_token(request, token_id)`` for every committed output token."""
        return self.scheduler.on_token

    @on_token.setter
    def on_token(self, on_token: Callable[[Request, int | None], None] | None) -> None:
        self.scheduler.on_token = on_token

    @property
    def waiting(self) -> deque[Request]:
        """The queue, in the order requests start (the scheduler's)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """The running requests, in activation order (the scheduler's)."""
        return self.scheduler.running

    # ------------------------------------------------------------------ arrivals
    def add_request(self, request: Request, admission: Rejection | None | _Ask = ASK) -> Rejection | None:
        """Queue an arrival, unless it can never fit or the controller refuses it.

        :param admission: ``ASK`` (default) asks the controller now. A server that decides at
            arrival, outside the engine's thread, passes its decision instead: None (admitted)
            or the Rejection it already answered with, which is recorded here.
        """
        now = self.clock.now()
        never = unservable_reason(request.prompt_len, request.max_tokens, self.pool.capacity_tokens)
        stats = self.stats
        if never is not None or not isinstance(admission, _Ask):  # no observation follows: keep the last one's rates
            stats.settle_arrival_rates()
        sched = self.scheduler
        stats.arrived(now, request.prompt_len, not sched.waiting and not sched.running)
        self.metrics.on_arrival(request)
        if never is not None:
            return self._reject(request, never, 0.0)
        prefill = sched.prefill_tokens(request)
        rejection = self.admit(request, prefill) if isinstance(admission, _Ask) else admission
        stats.admitted(request.prompt_len, rejection is None)
        if rejection is not None:
            return self._reject(request, rejection.reason, rejection.retry_after_s)
        # from the latest observation: admit() has just made it, or the last step did
        request.predicted_ttft_s = predicted_ttft_s(stats.current, prefill, self._token_budget,
                                                    running_cap=self._running_cap, profile=self.ttft_profile)
        self.scheduler.queue(request, prefill)
        return None

    def observe(self) -> Observation:
        """The Observation as of now: a fresh copy, as the controller gets at an arrival."""
        self._observe(self.clock.now(), slots=True)
        return self.stats.snapshot()

    def admit(self, request: Request, prefill_tokens: int | None = None) -> Rejection | None:
        """The controller's decision on an arrival, from the latest observation; changes nothing.

        :param prefill_tokens: what the controller is told the arrival must prefill: its prompt
            less the cached prefix (``Scheduler.prefill_tokens``); its whole prompt when not given.

        A controller that raises or answers neither None nor a Rejection accepts the arrival,
        unless the queue holds ``controller.max_waiting`` requests already.
        """
        try:
            slots = self.controller.reads_slot_wait()
        except Exception:
            slots = True
        self._observe(self.clock.now(), slots)
        obs = self.stats.snapshot()
        try:
            prompt = request.prompt_len if prefill_tokens is None else prefill_tokens
            verdict = self.controller.admit(obs, prompt, request.max_tokens)
        except Exception as exc:
            self._count_error(self.controller_errors, f"controller.admit raised {type(exc).__name__}", exc)
        else:
            if verdict is None:
                return None
            if isinstance(verdict, Rejection):
                return self._usable_rejection(verdict, obs)
            self._count_error(self.controller_errors, f"controller.admit returned {type(verdict).__name__}, "
                                                      "not a Rejection or None")
        try:
            max_waiting = self.controller.max_waiting
            full = max_waiting is not None and obs.num_waiting >= max_waiting
        except Exception:
            full = False
        if full:
            return Rejection(f"queue is full ({obs.num_waiting} waiting)", retry_after_s(obs))
        return None

    def _usable_rejection(self, rejection: Rejection, obs: Observation) -> Rejection:
        """``rejection`` with a str reason and a finite, non-negative retry-after."""
        try:
            reason, wait = rejection.reason, rejection.retry_after_s
            if type(rejection) is Rejection and type(reason) is str and type(wait) is float \
                    and 0.0 <= wait < math.inf:
                return rejection
            seconds = real_number(wait)
        except Exception:
            reason, seconds = None, None
        if seconds is None or not 0.0 <= seconds < math.inf:
            self._count_error(self.controller_errors, "controller.admit gave an unusable retry_after_s")
            seconds = retry_after_s(obs)
        return Rejection(reason if type(reason) is str else "refused by the controller", seconds)

    def cancel(self, request: Request) -> None:
        """Cancel a waiting or running request; its blocks are freed at the start of the next step."""
        self.scheduler.cancel(request)

    @property
    def has_unfinished(self) -> bool:
        sched = self.scheduler
        return bool(sched.waiting or sched.running or sched.to_cancel)

    # ------------------------------------------------------------------ the step
    def step(self, sync: bool = True) -> list[Request]:
        """Run one engine step; returns the requests that reached a terminal state in it.

        ``on_finish`` runs for each of them, also when the step itself fails.

        :param sync: bring the running requests' token counts up to date after the step (see
            ``sync``); a driver that reads only the engine's observation, queue lengths, KV pool
            and ended requests between steps passes False and calls ``sync()`` when it stops.
        """
        ended: list[Request] = []
        try:
            self._step(ended)
        finally:
            if sync and self.scheduler.steady.count:
                self.scheduler.sync()
            if ended:
                self._notify_finished(ended)
        return ended

    #: how many steps the last ``run_steady`` ran (``tidegate.engine.sim.steady``)
    steady_steps = 0
    #: ``run_steady`` runs nothing before this tick (a request ends too soon after it)...
    _steady_retry_tick = 0
    #: ...nor while the next arrival is this one (it comes too soon)
    _steady_retry_until = -1.0

    def sync(self) -> None:
        """Write the current token counts into the requests in steady decode (they lag while the
        engine steps with ``sync=False``; everything else is always current)."""
        self.scheduler.sync()

    def _step(self, ended: list[Request]) -> None:
        now = self.clock.now()
        sched = self.scheduler
        if sched.to_cancel:
            sched.apply_cancellations(ended)
        if sched.waiting:
            self._expire(now, ended)

        self.stats.step_started(self._observe(now).kv_used_tokens)
        batch = sched.schedule(self._decide())
        try:
            result = self._executor.execute(batch)
            if result.duration_s is not None:
                self.clock.advance(result.duration_s)
            sched.update(batch, result, ended)
        except Exception as exc:  # the step's requests fail; the engine keeps serving
            self._count_error(self.step_errors, f"step failed: {type(exc).__name__}", exc)
            sched.fail(batch, f"step failed: {type(exc).__name__}: {exc}", ended)
        self._finish_step(now, batch)

    def _expire(self, now: float, ended: list[Request]) -> None:
        """Expire the requests that waited past the controller's queue timeout without starting."""
        try:
            timeout = self.controller.queue_timeout_s
        except Exception:
            return
        if timeout is None:
            return
        try:
            seconds = real_number(timeout)
        except Exception:
            seconds = None
        if seconds is None:
            self._count_error(self.controller_errors, "controller.queue_timeout_s is not a number")
            return
        self.scheduler.expire(now, seconds, ended)

    def _finish_step(self, start: float, batch: Batch) -> None:
        end = self.clock.now()
        duration = end - start
        self.stats.step_ended(duration, batch.num_tokens)
        self.metrics.prefill_tokens += batch.num_tokens - batch.num_decodes
        sched = self.scheduler
        self.metrics.on_step(end, duration, self.pool.used_tokens, len(sched.waiting),
                             len(sched.running), batch.num_tokens)
        self.step_index += 1

    def _notify_finished(self, ended: list[Request]) -> None:
        """``on_finish`` for every request that ended; one that raises does not stop the others."""
        on_finish = self.on_finish
        if on_finish is None:
            return
        for r in ended:
            try:
                on_finish(r)
            except Exception as exc:
                self._count_error(self.callback_errors, f"on_finish raised {type(exc).__name__}", exc)

    def _count_error(self, errors: dict[str, int], cause: str, exc: BaseException | None = None) -> None:
        """Count an error by cause; log the first of each cause."""
        count_error(errors, cause, exc)

    def _observe(self, now: float, slots: bool = False) -> Observation:
        """The engine's state into its statistics; returns ``stats.current`` (the engine's own).

        :param slots: fill ``most_output_tokens`` and ``short_output_tokens`` where an arrival would
            wait for a slot (``slot_outputs``); otherwise they read 0. Admission's TTFT prediction needs
            them (where the controller's admission reads them, ``Controller.reads_slot_wait``), the
            step's decision does not (slo-flow's rate, budget and cap, and the learned features, read
            no slot wait), and filling them at every step cost the simulator 15% of its speed on the
            A100 preset, where the queue at 1 x lambda_max keeps the running cap full."""
        sched = self.scheduler
        waiting, running = sched.waiting, sched.running
        most = short = 0
        leading: tuple[int, ...] = ()
        held = len(waiting) + len(running)
        if slots and held >= self._running_cap:
            # an arrival now needs the (held + 1 - cap)-th slot to free: the outputs up to that one
            most, short, leading = self.slot_outputs(sched.steady.tick, int(held + 1 - self._running_cap))
        return self.stats.observe(now, self.step_index, self.pool.used_tokens, len(waiting), len(running),
                                  sched.waiting_prompt_tokens, sched.running_prompt_tokens,
                                  waiting[0].prompt_len if waiting else 0, sched.evicted_last_step, most, short,
                                  leading)

    def slot_outputs(self, tick: int, slots: int = LEADING_OUTPUTS) -> tuple[int, int, tuple[int, ...]]:
        """``Observation.most_output_tokens``, ``short_output_tokens`` and ``leading_outputs`` (the first
        ``slots`` of them at most: an arrival that needs the k-th slot reads the k-th): the steady decodes'
        outputs from their lags at decode ``tick``, not a pass over them."""
        sched = self.scheduler
        most, least = running_outputs(sched.steady, sched.explicit, tick)
        leading = leading_outputs(sched.steady, sched.explicit, tick, max(min(slots, LEADING_OUTPUTS), 1))
        return most, self.stats.outputs.short_above(least), leading

    # ------------------------------------------------------------------ the decision
    def _decide(self) -> Decision:
        """The Decision this step applies: the controller's when it is usable (numbers within
        bounds), else the conservative one. A controller that promises its decision whatever the
        observation (``Controller.steady_decision``) is taken at its word: no Observation is made
        for it."""
        controller = self.controller
        try:
            d = controller.steady_decision()
        except Exception:
            d = None
        if type(d) is Decision and plainly_usable(d):
            self._token_budget, self._running_cap = d.token_budget, d.running_cap
            return d
        try:
            d = controller.decide(self.stats.snapshot())
        except Exception as exc:
            return self._conservative(f"controller.decide raised {type(exc).__name__}", exc)
        try:
            if type(d) is Decision:
                if plainly_usable(d):
                    self._token_budget, self._running_cap = d.token_budget, d.running_cap
                    return d  # the common case: usable as it is
            elif not isinstance(d, Decision):
                return self._conservative(f"controller.decide returned {type(d).__name__}, not a Decision")
            checked = bounded(d)
            if isinstance(checked, str):
                return self._conservative(f"controller.decide gave {checked}")
            self._token_budget, self._running_cap = checked.token_budget, checked.running_cap
            return checked
        except Exception as exc:  # a field that fails to read, convert or compare
            return self._conservative(f"controller.decide gave an unusable Decision ({type(exc).__name__})", exc)

    def _conservative(self, cause: str, exc: BaseException | None = None) -> Decision:
        """The decision of a step whose controller could not answer: no activation while anything
        runs (the queue head when nothing does, so the engine never stalls), no eviction, the last
        applied token budget and running cap."""
        self._count_error(self.controller_errors, cause, exc)
        return Decision(0 if self.running else 1, self._token_budget, max(self._running_cap, 1), 1.0)

    def _reject(self, r: Request, reason: str, retry_after_s: float) -> Rejection:
        r.state = RequestState.REJECTED
        r.finish_reason = reason
        r.retry_after_s = retry_after_s
        r.finish_time_s = self.clock.now()
        self.stats.refused()
        self.metrics.on_terminal(r)
        self._notify_finished([r])
        return Rejection(reason, retry_after_s)
