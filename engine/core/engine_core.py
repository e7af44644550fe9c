"""EngineCore: one continuous-batching loop shared by the simulator twin and the real engine.

A step: ask the controller for a Decision, activate up to that many waiting requests, make
room by evicting the most recently activated requests (LIFO) while the pool cannot hold the
step's tokens, build the batch (decodes, then prefill chunks, within the token budget), run the
executor, commit tokens and finish requests.

With an executor that reads only a batch's counts (``reads_requests = False``, the simulator's),
a request that has started to decode is counted in aggregate, its decodes "steady", until it
ends, is evicted or the decodes must rotate: a step's work then grows with the requests that
start, end, prefill or need a KV block in it, not with the running set (see ``_join_steady``).
The schedule is exactly the one per-request bookkeeping gives; only the running requests' token
counts lag until ``sync()`` (``step()`` syncs unless asked not to).

An evicted request keeps its output tokens by default and recomputes their KV by prefill when it
runs again (vLLM's recompute preemption), so eviction never changes text a client has seen;
``eviction="reset"`` discards its progress instead (the paper's model, for reproductions).

Nothing a controller, an executor or a callback does ends the loop: a controller that raises or
answers nonsense gets a conservative Decision for that step, a failing executor fails that step's
requests, a failing callback is skipped; each is counted and logged once per cause.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from heapq import heappop, heappush
from operator import attrgetter
from typing import Callable

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation, Rejection, retry_after_s
from tidegate.ctrl.slo_flow import predicted_ttft_s
from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.clock import Clock
from tidegate.engine.core.decision import bounded, plainly_usable, real_number
from tidegate.engine.core.executor import Batch, Executor
from tidegate.engine.core.metrics import EngineMetrics
from tidegate.engine.core.request import Request, RequestState, unservable_reason
from tidegate.engine.core.slo import time_per_output_token_s, time_to_first_token_s
from tidegate.engine.core.stats import ObservationStats

_log = logging.getLogger(__name__)

#: ``recompute``: an evicted request keeps its tokens and re-prefills them (vLLM); ``reset``: its
#: progress is discarded (the paper's model)
EVICTION_MODES = ("recompute", "reset")


class _Ask:
    """The type of ``ASK``, add_request's default: ask the controller."""


ASK = _Ask()
_FINISHED = RequestState.FINISHED
_RUNNING = RequestState.RUNNING
_by_activation = attrgetter("activation_seq")


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
    ) -> None:
        if eviction not in EVICTION_MODES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_MODES)}, got {eviction!r}")
        self.controller = controller
        self.executor = executor
        self.clock = clock
        self.eviction = eviction
        self._reset_on_eviction = eviction == "reset"
        self.pool = BlockPool(kv_capacity_tokens, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.metrics = EngineMetrics(record_steps=record_steps)
        #: the statistics the controller's Observation is made from (``stats.current``: as of now)
        self.stats = ObservationStats(self.pool.capacity_tokens, block_size, rate_window_s)
        self.on_token = on_token
        self.on_finish = on_finish
        self._waiting_prompt_tokens = 0  # tokens the waiting requests must prefill
        self._running_prompt_tokens = 0  # prompt tokens of the running requests
        self._activation_seq = 0
        self._cancel: list[Request] = []
        # running requests whose last committed token left them short of a block (see _make_room)
        self._needs_block: list[Request] = []
        # running requests whose decodes are not counted in aggregate, in activation order
        self._explicit: list[Request] = []
        self._steady = 0  # running requests in steady decode (see _join_steady)
        self._steady_base = 0  # their sum of prompt_len - decode_lag: they hold base + steady * tick tokens
        self._tick = 0  # decode tick: steps whose batch held the steady decodes
        self._steady_ends: list[tuple[int, int, Request]] = []  # heap: (tick it ends at, activation_seq, r)
        # steady requests by the tick, modulo the block size, at which their next token starts a block
        self._steady_blocks: list[list[Request]] = [[] for _ in range(block_size)]
        self._rotating = False  # the last batch served only some of the decodes
        self._steady_first = (0, 0)  # (tick, steady requests joined at it with one output token)
        self._evicted_last_step = 0
        self._decode_offset = 0  # round-robin start of the decodes served when the budget cuts them
        self._token_budget = 8192  # the last applied token budget, for TTFT predictions
        self._late_after_s: float | None = None  # the last applied late_after_s
        self._running_cap = UNLIMITED  # the last applied running cap
        self.step_index = 0
        #: times a controller raised or answered something unusable, by cause
        self.controller_errors: dict[str, int] = {}
        #: times an ``on_token`` or ``on_finish`` callback raised, by cause
        self.callback_errors: dict[str, int] = {}
        #: steps whose executor (or the commit of its result) raised, by cause
        self.step_errors: dict[str, int] = {}

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
        #: whether the executor reads the batch's requests, not only its counts (``Executor``)
        self._lists_requests = getattr(executor, "reads_requests", True)

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
        stats.arrived(now, request.prompt_len)
        self.metrics.on_arrival(request)
        if never is not None:
            return self._reject(request, never, 0.0)
        rejection = self.admit(request) if isinstance(admission, _Ask) else admission
        stats.admitted(request.prompt_len, rejection is None)
        if rejection is not None:
            return self._reject(request, rejection.reason, rejection.retry_after_s)
        # from the latest observation: admit() has just made it, or the last step did
        request.predicted_ttft_s = predicted_ttft_s(stats.current, request.prompt_len, self._token_budget)
        self.waiting.append(request)
        self._waiting_prompt_tokens += request.prompt_len
        return None

    def observe(self) -> Observation:
        """The Observation as of now: a fresh copy, as the controller gets at each step."""
        self._observe(self.clock.now())
        return self.stats.snapshot()

    def admit(self, request: Request) -> Rejection | None:
        """The controller's decision on an arrival, from the latest observation; changes nothing.

        A controller that raises or answers neither None nor a Rejection accepts the arrival,
        unless the queue holds ``controller.max_waiting`` requests already.
        """
        self._observe(self.clock.now())
        obs = self.stats.snapshot()
        try:
            verdict = self.controller.admit(obs, request.prompt_len, request.max_tokens)
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
        if not request.state.is_terminal and not request.cancel_requested:
            request.cancel_requested = True
            self._cancel.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._cancel)

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
            if sync and self._steady:
                self.sync()
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
        if not self._steady:
            return
        tick = self._tick
        for r in self.running:
            lag = r.decode_lag
            if lag is not None:
                out = tick - lag
                r.num_output_tokens = out
                r.num_computed_tokens = r.prompt_len + out - 1

    def _step(self, ended: list[Request]) -> None:
        now = self.clock.now()
        if self._cancel:
            self._apply_cancellations(ended)
        if self.waiting:
            try:
                timeout = self.controller.queue_timeout_s
            except Exception:
                timeout = None
            if timeout is not None:
                self._expire(now, timeout, ended)

        self.stats.step_started(self._observe(now).kv_used_tokens)
        decision = self._decide(self.stats.snapshot())
        if self.waiting:
            self._activate(decision)
        self._evicted_last_step = 0
        self._make_room()
        self._late_after_s = decision.late_after_s
        batch = self._build_batch(decision.token_budget, decision.late_after_s)

        try:
            result = self._executor.execute(batch)
            if result.duration_s is not None:
                self.clock.advance(result.duration_s)
            self._commit(batch, result, ended)
        except Exception as exc:  # the step's requests fail; the engine keeps serving
            self._count_error(self.step_errors, f"step failed: {type(exc).__name__}", exc)
            self._fail_batch(batch, f"step failed: {type(exc).__name__}: {exc}", ended)
        self._finish_step(now, batch)

    def _finish_step(self, start: float, batch: Batch) -> None:
        end = self.clock.now()
        duration = end - start
        self.stats.step_ended(duration, batch.num_tokens)
        self.metrics.on_step(end, duration, self.pool.used_tokens, len(self.waiting),
                             len(self.running), batch.num_tokens)
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
        seen = errors.get(cause, 0)
        errors[cause] = seen + 1
        if not seen:
            _log.warning("engine: %s (logged once, counted from now on)", cause, exc_info=exc)

    def _observe(self, now: float) -> Observation:
        """The engine's state into its statistics; returns ``stats.current`` (the engine's own)."""
        waiting = self.waiting
        return self.stats.observe(now, self.step_index, self.pool.used_tokens, len(waiting), len(self.running),
                                  self._waiting_prompt_tokens, self._running_prompt_tokens,
                                  waiting[0].prompt_len if waiting else 0, self._evicted_last_step)

    # ------------------------------------------------------------------ the decision
    def _decide(self, obs: Observation) -> Decision:
        """The Decision this step applies: the controller's when it is usable (numbers within
        bounds), else the conservative one."""
        try:
            d = self.controller.decide(obs)
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

    # ------------------------------------------------------------------ activation and eviction
    def _activate(self, decision: Decision) -> None:
        running, waiting, pool = self.running, self.waiting, self.pool
        room = decision.running_cap - len(running)
        if decision.class_budgets is not None:
            self._activate_by_class(decision.class_budgets, room)
            return
        budget = min(decision.activation_budget, room)
        if budget <= 0:
            return
        ratio = decision.kv_reserve_ratio
        reserved = self._reserved_tokens(ratio) if ratio is not None else 0
        while budget > 0 and waiting:
            r = waiting[0]
            if ratio is not None:
                need = self._reservation(r, ratio)
                if reserved + need > pool.capacity_tokens:
                    break
            if not pool.grow(r, r.prompt_len + r.num_output_tokens):
                break
            waiting.popleft()
            self._start(r)
            budget -= 1
            if ratio is not None:
                reserved += need

    def _activate_by_class(self, class_budgets: dict[int, int], room: int) -> None:
        left = {k: v for k, v in class_budgets.items() if v > 0}
        if not left or room <= 0:
            return
        kept: deque[Request] = deque()
        waiting = self.waiting
        while waiting and left and room > 0:
            r = waiting.popleft()
            allowance = left.get(r.class_id, 0)
            if allowance > 0 and self.pool.grow(r, r.num_tokens):
                self._start(r)
                room -= 1
                if allowance == 1:
                    del left[r.class_id]
                else:
                    left[r.class_id] = allowance - 1
            else:
                kept.append(r)
        kept.extend(waiting)
        self.waiting = kept

    def _reservation(self, r: Request, ratio: float) -> int:
        future = math.ceil(ratio * (r.max_tokens - r.num_output_tokens))
        return self.pool.blocks_for(r.prompt_len + r.num_output_tokens + future) * self.pool.block_size

    def _reserved_tokens(self, ratio: float) -> int:
        self.sync()
        return sum(self._reservation(r, ratio) for r in self.running)

    def _start(self, r: Request) -> None:
        r.state = _RUNNING
        if not r.ever_activated:
            r.ever_activated = True
            r.start_time_s = self.clock.now()
        r.activation_seq = self._activation_seq
        self._activation_seq += 1
        self._waiting_prompt_tokens -= r.prompt_len + r.num_output_tokens
        self._running_prompt_tokens += r.prompt_len
        self.running.append(r)
        self._explicit.append(r)

    def _make_room(self) -> None:
        """Evict the most recently activated requests while the step's decodes do not fit.

        A running request holds blocks for its whole sequence from activation on, so only a
        request whose last committed token started a block needs one more, and exactly one:
        ``_commit`` lists the listed ones, and a steady one is looked at every ``block_size``
        ticks (``_steady_blocks``). They grow in activation order, the order of ``running``.
        """
        candidates = self._needs_block
        tick = self._tick
        due = self._steady_blocks[tick % self.pool.block_size] if self._steady else []
        if not candidates and not due:
            return
        bs_tokens = self.pool.block_size
        growing = []
        if candidates:
            self._needs_block = []
            growing = [r for r in candidates if r.state is _RUNNING and r.decode_lag is None
                       and r.prompt_len + r.num_output_tokens > len(r.block_ids) * bs_tokens]
        if due:  # one joined with its block in hand (a recompute's prefill) may be due at once
            growing += [r for r in due if r.prompt_len + tick - (r.decode_lag or 0) > len(r.block_ids) * bs_tokens]
        if not growing:
            return
        growing.sort(key=_by_activation)
        need = len(growing)
        pool = self.pool
        evicted = False
        while need > pool.num_free_blocks:
            victim = self.running.pop()
            lag = victim.decode_lag
            if victim.prompt_len + (victim.num_output_tokens if lag is None else tick - lag) \
                    > len(victim.block_ids) * bs_tokens:
                need -= 1
            self._evict(victim)
            evicted = True
        pool.add_one_block([r for r in growing if r.state is _RUNNING] if evicted else growing)

    @staticmethod
    def _due(heap: list[tuple[int, int, Request]], tick: int) -> list[Request]:
        """Pop the entries of ``heap`` due by ``tick``; the requests they still stand for (an entry
        outlives its request's time in steady decode: ended, evicted or re-activated ones are skipped)."""
        due = []
        while heap and heap[0][0] <= tick:
            _, seq, r = heappop(heap)
            if r.decode_lag is not None and r.activation_seq == seq and r.state is _RUNNING:
                due.append(r)
        return due

    def _evict(self, r: Request) -> None:
        """Send a running request back to the front of the queue, its KV freed. It keeps its output
        tokens and re-prefills them when it runs again; in ``reset`` mode its progress is discarded."""
        if r.decode_lag is not None:
            self._leave_steady(r)
        else:
            explicit = self._explicit
            if explicit and explicit[-1] is r:  # the newest running request, as eviction picks
                explicit.pop()
            else:
                explicit.remove(r)
        wasted = r.num_computed_tokens
        r.wasted_tokens += wasted
        r.num_evictions += 1
        self.pool.free(r)
        r.num_computed_tokens = 0
        if self._reset_on_eviction:
            r.num_output_tokens = 0
            r.output_token_ids = []
            self.executor.release(r)  # its sampling state starts over too
        r.state = RequestState.WAITING
        self.waiting.appendleft(r)
        self._waiting_prompt_tokens += r.prompt_len + r.num_output_tokens
        self._running_prompt_tokens -= r.prompt_len
        self._evicted_last_step += 1
        self.stats.evicted()
        self.metrics.on_eviction(wasted)

    # ------------------------------------------------------------------ the batch
    def _build_batch(self, token_budget: int, late_after_s: float | None = None) -> Batch:
        """Decodes (a request with one token pending and an output token to feed), then prefill
        chunks of the other requests' pending tokens (the prompt, or after an eviction the prompt
        and the kept output), never more than ``token_budget`` tokens in all. When the decodes
        alone exceed the budget, which of them run rotates from step to step.

        Prefill chunks go in activation order; with ``late_after_s``, requests still without a
        first token that many seconds after their arrival (late: their TTFT SLO is missed
        whatever happens next) come after the others, in activation order among themselves.

        Steady decodes are counted, not listed: ``batch.num_decodes`` includes them, and
        ``batch.requests`` starts with the listed decodes (none while any decode is steady)."""
        batch = Batch()
        prefilling = self._add_decodes(batch, token_budget)
        n_decodes = batch.num_decodes
        left = token_budget - n_decodes
        if late_after_s is not None and len(prefilling) > 1:
            cutoff_s = self.clock.now() - late_after_s
            prefilling.sort(key=lambda r: r.first_token_time_s is None and r.arrival_time_s < cutoff_s)
        reqs, counts = batch.requests, batch.num_new_tokens
        kv_read = 0
        pending = 0
        prefill = 0
        pairs = 0
        for r in prefilling:
            chunk = r.prompt_len + r.num_output_tokens - r.num_computed_tokens
            pending += chunk
            if left <= 0:
                continue
            if chunk > left:
                chunk = left
            reqs.append(r)
            counts.append(chunk)
            kv_read += r.num_computed_tokens + chunk
            pairs += chunk * r.num_computed_tokens + chunk * (chunk + 1) // 2
            left -= chunk
            prefill += chunk
        batch.num_tokens = n_decodes + prefill
        batch.num_prefills = len(reqs) - (n_decodes - self._steady)
        batch.prefill_pairs = pairs
        self.stats.prefill_pending(pending - prefill)
        batch.kv_tokens_read += kv_read
        return batch

    def _add_decodes(self, batch: Batch, token_budget: int) -> list[Request]:
        """Put the step's decodes in ``batch`` (steady ones counted, the others listed, rotated
        when they exceed the budget); returns the listed requests that prefill, in activation order."""
        steady = self._steady
        if steady and (self.on_token is not None or self._lists_requests):
            self._dissolve_steady()
            steady = 0
        reqs = batch.requests
        kv_read = 0
        prefilling: list[Request] = []
        decode, prefill_next = reqs.append, prefilling.append
        for r in self._explicit:
            out = r.num_output_tokens
            computed = r.num_computed_tokens
            if out and computed + 1 == r.prompt_len + out:
                decode(r)
                kv_read += computed
            else:
                prefill_next(r)
        n_listed = len(reqs)
        n_decodes = n_listed + steady
        self._rotating = n_decodes > token_budget
        if self._rotating:
            if steady:  # rotation picks among all decodes in running order: list them
                self._dissolve_steady()
                reqs.clear()
                return self._add_decodes(batch, token_budget)
            kv_read = self._rotate_decodes(reqs, token_budget)
            n_decodes = n_listed = token_budget
        else:
            kv_read += n_listed  # each decode reads its new token too
            if steady:  # each steady decode reads its prompt and output, the new token included
                kv_read += self._steady_base + steady * self._tick
        batch.num_new_tokens.extend([1] * n_listed)
        self.stats.decodes_read(kv_read)
        batch.num_decodes = n_decodes
        batch.kv_tokens_read = kv_read
        first = 0
        for r in reqs:  # the listed decodes (all of the list so far)
            first += r.num_output_tokens == 1
        if steady:
            fresh_tick, fresh = self._steady_first
            if fresh_tick == self._tick:
                first += fresh
        batch.first_decodes = first
        return prefilling

    def _rotate_decodes(self, decodes: list[Request], budget: int) -> int:
        """Keep ``budget`` of ``decodes`` (in place), starting where the last cut stopped; returns
        the KV tokens they read."""
        start = self._decode_offset % len(decodes)
        kept = (decodes[start:] + decodes[:start])[:budget]
        self._decode_offset = (start + budget) % len(decodes)
        decodes[:] = kept
        return sum(r.num_computed_tokens for r in kept) + budget

    def _commit(self, batch: Batch, result, ended: list[Request]) -> None:
        """Count each batch request's new tokens; one that reached the end of its sequence (every
        decode, and a prefill's last chunk) gets an output token and may finish. Requests the
        token leaves short of a block are listed for the next ``_make_room``."""
        now = self.clock.now()
        token_ids = result.token_ids
        on_token = self.on_token
        requests, counts = batch.requests, batch.num_new_tokens
        n_decodes = batch.num_decodes - self._steady
        needs_block, bs_tokens = self._needs_block, self.pool.block_size
        first = 0
        any_done = self._commit_steady(now, ended) if self._steady else False
        if token_ids is None and on_token is None and n_decodes:
            any_done |= self._commit_decodes(requests[:n_decodes], now, ended)
            first = n_decodes
        for i in range(first, len(requests)):
            r = requests[i]
            if r.state is not _RUNNING:
                continue
            r.num_computed_tokens += counts[i]
            if r.num_computed_tokens < r.prompt_len + r.num_output_tokens:
                continue  # a prefill chunk that did not reach the end of the sequence
            r.num_output_tokens += 1
            tok = None
            if token_ids is not None:
                tok = token_ids[i]
                r.output_token_ids.append(tok)
            if r.first_token_time_s is None:
                self._first_token(r, now)
            if on_token is not None:
                try:
                    on_token(r, tok)
                except Exception as exc:
                    self._count_error(self.callback_errors, f"on_token raised {type(exc).__name__}", exc)
            out = r.num_output_tokens
            if out >= r.max_tokens:
                self._end(r, _FINISHED, "length", now, ended)
                any_done = True
            elif r.target_output_len is not None and out >= r.target_output_len:
                self._end(r, _FINISHED, "stop", now, ended)
                any_done = True
            elif r.prompt_len + out > len(r.block_ids) * bs_tokens:
                needs_block.append(r)
        if result.stopped or result.failed:
            any_done |= self._end_stopped_and_failed(result, now, ended)
        joined = (requests and token_ids is None and on_token is None and not self._rotating
                  and not self._lists_requests and self._join_steady(requests))
        if any_done:
            self.running = [r for r in self.running if r.state is _RUNNING]
        if any_done or joined:
            self._explicit = [r for r in self._explicit if r.state is _RUNNING and r.decode_lag is None]

    # ------------------------------------------------------------------ steady decodes
    def _join_steady(self, requests: list[Request]) -> bool:
        """Count the listed requests that now decode in aggregate; returns whether any joined.

        A steady request's output length is ``tick - decode_lag``: every step whose batch holds
        the steady decodes advances the tick, and a steady request decodes in every such step,
        since it leaves the aggregate when it ends, is evicted or the decodes must rotate. Its end
        and its KV blocks are due at ticks known now (``_steady_ends``, ``_steady_blocks``).
        """
        tick, bs_tokens = self._tick, self.pool.block_size
        joined = False
        for r in requests:
            if r.state is not _RUNNING or r.decode_lag is not None:
                continue
            out = r.num_output_tokens
            if not out or r.num_computed_tokens + 1 != r.prompt_len + out:
                continue  # prefilling still
            lag = tick - out
            r.decode_lag = lag
            self._steady += 1
            self._steady_base += r.prompt_len - lag
            heappush(self._steady_ends, (_end_tokens(r) + lag, r.activation_seq, r))
            if out == 1:  # its next decode is its first (Batch.first_decodes)
                fresh_tick, fresh = self._steady_first
                self._steady_first = (tick, fresh + 1 if fresh_tick == tick else 1)
            # its tokens start blocks at ticks t with prompt_len + t - lag = 1 modulo the block size
            self._steady_blocks[(1 + lag - r.prompt_len) % bs_tokens].append(r)
            joined = True
        return joined

    def _commit_steady(self, now: float, ended: list[Request]) -> bool:
        """Every steady request decoded one token: advance the tick and end those due now, in
        activation order (the order of ``running``). Returns whether any ended."""
        self._tick = tick = self._tick + 1
        heap = self._steady_ends
        if not heap or heap[0][0] > tick:
            return False
        for r in self._due(heap, tick):
            self._end(r, _FINISHED, "length" if _end_tokens(r) == r.max_tokens else "stop", now, ended)
        return True

    def _leave_steady(self, r: Request) -> None:
        """Take ``r`` out of the steady decodes, its token counts made current."""
        lag = r.decode_lag
        assert lag is not None
        out = self._tick - lag
        r.num_output_tokens = out
        r.num_computed_tokens = r.prompt_len + out - 1
        r.decode_lag = None
        self._steady -= 1
        self._steady_base -= r.prompt_len - lag
        fresh_tick, fresh = self._steady_first
        if out == 1 and fresh_tick == self._tick:
            self._steady_first = (fresh_tick, fresh - 1)
        self._steady_blocks[(1 + lag - r.prompt_len) % self.pool.block_size].remove(r)

    def _dissolve_steady(self) -> None:
        """List every running request again (before a rotation of the decodes, or when tokens must
        be seen one by one)."""
        self.sync()
        for r in self.running:
            r.decode_lag = None
        self._steady = self._steady_base = 0
        self._steady_ends = []
        self._steady_first = (0, 0)
        for due in self._steady_blocks:
            due.clear()
        self._explicit = list(self.running)

    def _end_stopped_and_failed(self, result, now: float, ended: list[Request]) -> bool:
        """End the running requests the executor stopped (EOS, a stop string) or failed; returns
        whether it ended any."""
        any_done = False
        for r in result.stopped:
            if r.state is _RUNNING:
                self._end(r, _FINISHED, "stop", now, ended)
                any_done = True
        for r, reason in result.failed:
            if r.state is _RUNNING:
                self._end(r, RequestState.FAILED, reason, now, ended)
                any_done = True
        return any_done

    def _commit_decodes(self, decodes: list[Request], now: float, ended: list[Request]) -> bool:
        """``_commit`` for decodes (one token each, which ends their sequence) when there is no
        token id to store and no ``on_token`` to call: the simulator's common case, kept lean.
        Returns whether a request finished."""
        needs_block, bs_tokens = self._needs_block, self.pool.block_size
        any_done = False
        for r in decodes:
            if r.state is not _RUNNING:
                continue
            r.num_computed_tokens += 1
            out = r.num_output_tokens + 1
            r.num_output_tokens = out
            if r.first_token_time_s is None:
                self._first_token(r, now)
            if out >= r.max_tokens:
                self._end(r, _FINISHED, "length", now, ended)
                any_done = True
            elif r.target_output_len is not None and out >= r.target_output_len:
                self._end(r, _FINISHED, "stop", now, ended)
                any_done = True
            elif r.prompt_len + out > len(r.block_ids) * bs_tokens:
                needs_block.append(r)
        return any_done

    def _first_token(self, r: Request, now: float) -> None:
        """Record ``r``'s first token and how late its admission prediction ran."""
        r.first_token_time_s = now
        if r.predicted_ttft_s is not None:
            ttft = now - r.arrival_time_s
            if self._late_after_s is not None and r.start_time_s is not None:
                # late requests prefill last by the controller's choice: past the SLO, the wait of a
                # running request is the order's doing, not the prediction's error; the queue wait
                # before its activation is the prediction's to foresee, however long
                ttft = min(ttft, max(self._late_after_s, r.start_time_s - r.arrival_time_s))
            self.stats.first_token(now, ttft - r.predicted_ttft_s)

    # ------------------------------------------------------------------ endings
    def _end(self, r: Request, state: RequestState, reason: str, now: float, ended: list[Request]) -> None:
        if r.decode_lag is not None:
            self._leave_steady(r)
        if r.state is _RUNNING:
            self._running_prompt_tokens -= r.prompt_len
        r.state = state
        r.finish_reason = reason
        r.finish_time_s = now
        if r.ever_activated:  # running, or evicted with state the executor still keeps
            self.pool.free(r)
            self.executor.release(r)
        ended.append(r)
        if state is _FINISHED:
            self._record_completion(r, now)
        else:
            self.metrics.on_terminal(r)

    def _record_completion(self, r: Request, now: float) -> None:
        self.stats.completed(now, r.prompt_len, r.num_output_tokens, time_to_first_token_s(r),
                             time_per_output_token_s(r, end_s=now))
        self.metrics.on_terminal(r)

    def _reject(self, r: Request, reason: str, retry_after_s: float) -> Rejection:
        r.state = RequestState.REJECTED
        r.finish_reason = reason
        r.retry_after_s = retry_after_s
        r.finish_time_s = self.clock.now()
        self.stats.refused()
        self.metrics.on_terminal(r)
        self._notify_finished([r])
        return Rejection(reason, retry_after_s)

    def _apply_cancellations(self, ended: list[Request]) -> None:
        now = self.clock.now()
        cancelled = {id(r) for r in self._cancel if not r.state.is_terminal}
        if not cancelled:
            self._cancel.clear()
            return
        for r in self._cancel:
            if r.state is RequestState.WAITING:
                self._waiting_prompt_tokens -= r.prompt_len + r.num_output_tokens
            if not r.state.is_terminal:
                self._end(r, RequestState.CANCELLED, "cancelled", now, ended)
        self._cancel.clear()
        self.waiting = deque(r for r in self.waiting if id(r) not in cancelled)
        self.running = [r for r in self.running if id(r) not in cancelled]
        self._explicit = [r for r in self._explicit if id(r) not in cancelled]

    def _expire(self, now: float, timeout_s: object, ended: list[Request]) -> None:
        """Expire requests that waited past the queue timeout without ever starting."""
        try:
            seconds = real_number(timeout_s)
        except Exception:
            seconds = None
        if seconds is None:
            self._count_error(self.controller_errors, "controller.queue_timeout_s is not a number")
            return
        cutoff_s = now - seconds
        waiting = self.waiting
        resumed = []
        while waiting:
            r = waiting[0]
            if r.ever_activated:  # evicted requests already started serving: they do not expire
                resumed.append(waiting.popleft())
            elif r.arrival_time_s < cutoff_s:
                waiting.popleft()
                self._waiting_prompt_tokens -= r.prompt_len
                self._end(r, RequestState.EXPIRED, f"queue timeout of {seconds:.3g} s", now, ended)
            else:
                break
        waiting.extendleft(reversed(resumed))

    def _fail_batch(self, batch: Batch, reason: str, ended: list[Request]) -> None:
        now = self.clock.now()
        steady = [r for r in self.running if r.decode_lag is not None]  # the batch's first decodes
        for r in steady + batch.requests:
            if r.state is _RUNNING:
                self._end(r, RequestState.FAILED, reason, now, ended)
        self.running = [r for r in self.running if r.state is _RUNNING]
        self._explicit = [r for r in self._explicit if r.state is _RUNNING]


def _end_tokens(r: Request) -> int:
    """The output length at which ``r`` ends for certain: ``max_tokens``, or the target length."""
    target = r.target_output_len
    return target if target is not None and target < r.max_tokens else r.max_tokens
