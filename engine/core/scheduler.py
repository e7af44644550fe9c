"""The scheduler: one engine's requests, each step's plan, and the update from the step's result.

``schedule(decision)`` applies a Decision: it activates up to that many waiting requests, makes
room by evicting the most recently activated requests (LIFO) while the pool cannot hold the step's
tokens, and builds the step's plan, a fresh :class:`Batch` (decodes, then prefill chunks, within
the token budget). The executor runs the plan, and ``update(batch, result, ended)`` commits its
result: tokens counted, first tokens and completions recorded, requests ended. The Decision comes
checked (``EngineCore`` asks the controller); everything the plan and the update change is here.

An evicted request keeps its output tokens by default and recomputes their KV by prefill when it
runs again (vLLM's recompute preemption), so eviction never changes text a client has seen; in
``reset`` mode its progress is discarded instead (the paper's model, for reproductions).

With an executor that reads only a batch's counts (``reads_requests = False``), decoding requests
are counted in aggregate (:class:`SteadyDecodes`): ``running`` stays exact, their token counts lag
until ``sync()``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from operator import attrgetter
from typing import Callable

from tidegate.ctrl.base import Decision
from tidegate.engine.core.batching import Planner
from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.clock import Clock
from tidegate.engine.core.executor import Batch, Executor, StepResult
from tidegate.engine.core.metrics import EngineMetrics
from tidegate.engine.core.prefix import content_block_hashes, token_block_hashes
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import time_per_output_token_s, time_to_first_token_s
from tidegate.engine.core.stats import ObservationStats
from tidegate.engine.core.steady_decodes import SteadyDecodes, end_tokens

_log = logging.getLogger("tidegate.engine.core.engine_core")

_FINISHED = RequestState.FINISHED
_RUNNING = RequestState.RUNNING
_by_activation = attrgetter("activation_seq")
#: the block hashes of a request whose prompt's content nobody knows (shared, never changed)
_NO_HASHES: list[int] = []


def count_error(errors: dict[str, int], cause: str, exc: BaseException | None = None) -> None:
    """Count an error by cause in ``errors``; log the first of each cause."""
    seen = errors.get(cause, 0)
    errors[cause] = seen + 1
    if not seen:
        _log.warning("engine: %s (logged once, counted from now on)", cause, exc_info=exc)


class Scheduler(Planner):
    """The waiting and running requests around a block pool.

    :param pool: the KV blocks.
    :param clock: the engine's clock (activation and end times).
    :param stats: fed with the events of each step (``ObservationStats``).
    :param metrics: the engine's counters.
    :param executor: the executor whose ``release`` ends a request's state.
    :param reset_on_eviction: an evicted request starts over (the paper's model).
    :param callback_errors: where an ``on_token`` that raises is counted.
    """

    def __init__(self, pool: BlockPool, clock: Clock, stats: ObservationStats, metrics: EngineMetrics,
                 executor: Executor, reset_on_eviction: bool, callback_errors: dict[str, int]) -> None:
        self.pool = pool
        self.clock = clock
        self.stats = stats
        self.metrics = metrics
        self.executor = executor
        self.reset_on_eviction = reset_on_eviction
        self.callback_errors = callback_errors
        #: called as ``on_token(request, token_id)`` for every committed output token
        self.on_token: Callable[[Request, int | None], None] | None = None
        #: the executor reads the batch's requests, not only its counts (``Executor``)
        self.lists_requests = True
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in activation order
        self.waiting_prompt_tokens = 0  # tokens the waiting requests must prefill
        self.running_prompt_tokens = 0  # prompt tokens of the running requests
        self.to_cancel: list[Request] = []  # cancelled since the last step
        self.evicted_last_step = 0
        self.late_after_s: float | None = None  # the applied decision's late_after_s
        # running requests whose last committed token left them short of a block (see make_room)
        self.needs_block: list[Request] = []
        # running requests whose decodes are not counted in aggregate, in activation order
        self.explicit: list[Request] = []
        self.steady = SteadyDecodes(pool.block_size)
        self.rotating = False  # the last batch served only some of the decodes
        self._activation_seq = 0
        self.decode_offset = 0  # round-robin start of the decodes served when the budget cuts them

    # ------------------------------------------------------------------ queue
    def queue(self, r: Request, prefill_tokens: int | None = None) -> None:
        """Append an admitted arrival to the queue.

        :param prefill_tokens: what it must prefill (``prefill_tokens(r)``), when already known.
        """
        r.queued_tokens = self.prefill_tokens(r) if prefill_tokens is None else prefill_tokens
        self.waiting.append(r)
        self.waiting_prompt_tokens += r.queued_tokens

    def prefill_tokens(self, r: Request) -> int:
        """The tokens ``r`` must prefill if it started now: its sequence less the prefix it would
        find in the prefix cache."""
        total = r.prompt_len + r.num_output_tokens
        pool = self.pool
        if not pool.prefix_caching:
            return total
        return total - len(self._cache_hits(r)) * pool.block_size

    def _cache_hits(self, r: Request) -> list[int]:
        """The cached blocks ``r`` would start with (its block hashes are made on first use). At
        least one token is left to compute: the step that computes it samples the next token."""
        hashes = r.block_hashes
        if hashes is None:
            bs = self.pool.block_size
            if r.prompt_token_ids is not None:
                hashes = token_block_hashes(r.prompt_token_ids, bs, r.cache_salt)
            elif r.prefix is not None:
                hashes = content_block_hashes(r.prefix[0], r.prefix[1], r.prompt_len, bs)
            else:  # nothing says what the prompt holds
                hashes = _NO_HASHES
            r.block_hashes = hashes
        if not hashes or r.skip_reading_prefix_cache:
            return []
        return self.pool.cached_prefix(hashes, (r.prompt_len + r.num_output_tokens - 1) // self.pool.block_size)

    def blocks_to_start(self, r: Request) -> int:
        """The free blocks waiting ``r`` would take to start now (its cached prefix counted)."""
        pool = self.pool
        total = r.prompt_len + r.num_output_tokens
        if not pool.prefix_caching:
            return pool.extra_blocks_needed(r, total)
        return pool.blocks_to_start(total, self._cache_hits(r))

    def _allocate(self, r: Request) -> bool:
        """Blocks for ``r``'s whole sequence as it starts, its cached prefix counted as computed;
        False (nothing taken) when the pool is short."""
        pool = self.pool
        total = r.prompt_len + r.num_output_tokens
        if not pool.prefix_caching or r.block_hashes is _NO_HASHES:
            return pool.grow(r, total)
        hits = self._cache_hits(r)
        if not pool.allocate(r, total, hits):
            return False
        if hits:
            cached = len(hits) * pool.block_size
            r.num_computed_tokens = cached
            self.metrics.cached_prompt_tokens += cached
            if not r.ever_activated:
                r.num_cached_tokens = cached
        return True

    def cancel(self, r: Request) -> None:
        """Mark ``r`` cancelled; it ends at the start of the next step."""
        if not r.state.is_terminal and not r.cancel_requested:
            r.cancel_requested = True
            self.to_cancel.append(r)

    def sync(self) -> None:
        """Write the current token counts into the requests in steady decode."""
        if self.steady.count:
            self.steady.sync(self.running)

    # ------------------------------------------------------------------ the plan
    def schedule(self, decision: Decision) -> Batch:
        """Apply a (checked) Decision: activations, room for the step's tokens, then the plan."""
        if self.waiting:
            self._activate(decision)
        self.evicted_last_step = 0
        self.make_room()
        self.late_after_s = decision.late_after_s
        return self.build_batch(decision.token_budget, decision.late_after_s)

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
                need = self.reservation(r, ratio)
                if reserved + need > pool.capacity_tokens:
                    break
            if not self._allocate(r):
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
            if allowance > 0 and self._allocate(r):
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

    def reservation(self, r: Request, ratio: float) -> int:
        """The KV tokens ``r`` holds with ``ratio`` of its remaining output budget reserved."""
        future = math.ceil(ratio * (r.max_tokens - r.num_output_tokens))
        return self.pool.blocks_for(r.prompt_len + r.num_output_tokens + future) * self.pool.block_size

    def _reserved_tokens(self, ratio: float) -> int:
        self.sync()
        return sum(self.reservation(r, ratio) for r in self.running)

    def _start(self, r: Request) -> None:
        r.state = _RUNNING
        if not r.ever_activated:
            r.ever_activated = True
            r.start_time_s = self.clock.now()
        r.activation_seq = self._activation_seq
        self._activation_seq += 1
        self.waiting_prompt_tokens -= r.queued_tokens
        self.running_prompt_tokens += r.prompt_len
        self.running.append(r)
        self.explicit.append(r)

    def make_room(self) -> None:
        """Evict the most recently activated requests while the step's decodes do not fit.

        A running request holds blocks for its whole sequence from activation on, so only a
        request whose last committed token started a block needs one more, and exactly one:
        ``update`` lists the listed ones, and a steady one is looked at every ``block_size``
        ticks (``SteadyDecodes.blocks``). They grow in activation order, the order of ``running``.
        """
        candidates = self.needs_block
        steady = self.steady
        tick = steady.tick
        due = steady.blocks[tick % self.pool.block_size] if steady.count else []
        if not candidates and not due:
            return
        bs_tokens = self.pool.block_size
        growing = []
        if candidates:
            self.needs_block = []
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
            self.evict(victim)
            evicted = True
        pool.add_one_block([r for r in growing if r.state is _RUNNING] if evicted else growing)

    def evict(self, r: Request) -> None:
        """Send a running request back to the front of the queue, its KV freed. It keeps its output
        tokens and re-prefills them when it runs again; in ``reset`` mode its progress is discarded."""
        if r.decode_lag is not None:
            self.steady.leave(r)
        else:
            explicit = self.explicit
            if explicit and explicit[-1] is r:  # the newest running request, as eviction picks
                explicit.pop()
            else:
                explicit.remove(r)
        wasted = r.num_computed_tokens
        r.wasted_tokens += wasted
        r.num_evictions += 1
        self.pool.free(r)
        r.num_computed_tokens = 0
        if self.reset_on_eviction:
            r.num_output_tokens = 0
            r.output_token_ids = []
            self.executor.release(r)  # its sampling state starts over too
        r.state = RequestState.WAITING
        self.waiting.appendleft(r)
        r.queued_tokens = self.prefill_tokens(r)
        self.waiting_prompt_tokens += r.queued_tokens
        self.running_prompt_tokens -= r.prompt_len
        self.evicted_last_step += 1
        self.stats.evicted()
        self.metrics.on_eviction(wasted)

    # ------------------------------------------------------------------ the update
    def update(self, batch: Batch, result, ended: list[Request]) -> None:
        """Count each batch request's new tokens; one that reached the end of its sequence (every
        decode, and a prefill's last chunk) gets an output token and may finish. Requests the
        token leaves short of a block are listed for the next ``make_room``."""
        now = self.clock.now()
        token_ids = result.token_ids
        on_token = self.on_token
        steady = self.steady
        requests, counts = batch.requests, batch.num_new_tokens
        n_decodes = batch.num_decodes - steady.count
        first = 0
        any_done = self._update_steady(now, ended) if steady.count else False
        if token_ids is None and on_token is None and n_decodes:
            any_done |= self._update_decodes(requests[:n_decodes], now, ended)
            first = n_decodes
        for i in range(first, len(requests)):
            r = requests[i]
            if r.state is not _RUNNING:
                continue
            r.num_computed_tokens += counts[i]
            if r.block_hashes:  # its prompt's blocks go into the prefix cache as they are computed
                self.pool.register(r)
            if r.num_computed_tokens < r.prompt_len + r.num_output_tokens:
                continue  # a prefill chunk that did not reach the end of the sequence
            any_done |= self._commit_token(r, None if token_ids is None else token_ids[i], now, ended)
        if result.stopped or result.failed:
            any_done |= self._end_stopped_and_failed(result, now, ended)
        joined = (requests and token_ids is None and on_token is None and not self.rotating
                  and not self.lists_requests and steady.join(requests))
        if any_done:
            self.running = [r for r in self.running if r.state is _RUNNING]
        if any_done or joined:
            self.explicit = [r for r in self.explicit if r.state is _RUNNING and r.decode_lag is None]

    def _commit_token(self, r: Request, tok: int | None, now: float, ended: list[Request]) -> bool:
        """``r`` got its next output token (None in simulation): record it, tell ``on_token``, and end
        ``r`` at its length or its trace's output length; returns whether it ended."""
        r.num_output_tokens += 1
        if tok is not None:
            r.output_token_ids.append(tok)
        if r.first_token_time_s is None:
            self._first_token(r, now)
        on_token = self.on_token
        if on_token is not None:
            try:
                on_token(r, tok)
            except Exception as exc:
                count_error(self.callback_errors, f"on_token raised {type(exc).__name__}", exc)
        out = r.num_output_tokens
        if out >= r.max_tokens:
            self.end(r, _FINISHED, "length", now, ended)
            return True
        if r.target_output_len is not None and out >= r.target_output_len:
            self.end(r, _FINISHED, "stop", now, ended)
            return True
        if r.prompt_len + out > len(r.block_ids) * self.pool.block_size:
            self.needs_block.append(r)
        return False

    def _update_steady(self, now: float, ended: list[Request]) -> bool:
        """Every steady request decoded one token: end those due now, in activation order.
        Returns whether any end was due."""
        due = self.steady.advance()
        if due is None:
            return False
        for r in due:
            self.end(r, _FINISHED, "length" if end_tokens(r) == r.max_tokens else "stop", now, ended)
        return True

    def _update_decodes(self, decodes: list[Request], now: float, ended: list[Request]) -> bool:
        """``update`` for decodes (one token each, which ends their sequence) when there is no
        token id to store and no ``on_token`` to call: the simulator's common case, kept lean.
        Returns whether a request finished."""
        needs_block, bs_tokens = self.needs_block, self.pool.block_size
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
                self.end(r, _FINISHED, "length", now, ended)
                any_done = True
            elif r.target_output_len is not None and out >= r.target_output_len:
                self.end(r, _FINISHED, "stop", now, ended)
                any_done = True
            elif r.prompt_len + out > len(r.block_ids) * bs_tokens:
                needs_block.append(r)
        return any_done

    def _end_stopped_and_failed(self, result: StepResult, now: float, ended: list[Request]) -> bool:
        """End the running requests the executor stopped (EOS, a stop string) or failed; returns
        whether it ended any."""
        any_done = False
        for r in result.stopped:
            if r.state is _RUNNING:
                self.end(r, _FINISHED, "stop", now, ended)
                any_done = True
        for r, reason in result.failed:
            if r.state is _RUNNING:
                self.end(r, RequestState.FAILED, reason, now, ended)
                any_done = True
        return any_done

    def _first_token(self, r: Request, now: float) -> None:
        """Record ``r``'s first token and how late its admission prediction ran."""
        r.first_token_time_s = now
        if r.predicted_ttft_s is not None:
            ttft = now - r.arrival_time_s
            if self.late_after_s is not None and r.start_time_s is not None:
                # late requests prefill last by the controller's choice: past the SLO, the wait of a
                # running request is the order's doing, not the prediction's error; the queue wait
                # before its activation is the prediction's to foresee, however long
                ttft = min(ttft, max(self.late_after_s, r.start_time_s - r.arrival_time_s))
            self.stats.first_token(now, ttft - r.predicted_ttft_s, r.predicted_ttft_s)

    # ------------------------------------------------------------------ endings
    def end(self, r: Request, state: RequestState, reason: str, now: float, ended: list[Request]) -> None:
        """Put ``r`` in a terminal state, its blocks and executor state released; appended to ``ended``."""
        if r.decode_lag is not None:
            self.steady.leave(r)
        if r.state is _RUNNING:
            self.running_prompt_tokens -= r.prompt_len
        r.state = state
        r.finish_reason = reason
        r.finish_time_s = now
        if r.ever_activated:  # running, or evicted with state the executor still keeps
            if state is _FINISHED:
                self._cache_output(r)
            self.pool.free(r)
            self.executor.release(r)
        ended.append(r)
        if state is _FINISHED:
            self.stats.completed(now, r.prompt_len, r.num_output_tokens, time_to_first_token_s(r),
                                 time_per_output_token_s(r, end_s=now))
        self.metrics.on_terminal(r)

    def _cache_output(self, r: Request) -> None:
        """Register the full blocks a finished real request computed past its prompt, as vLLM caches
        generated tokens: a conversation that resends this answer in its next turn finds it cached."""
        bs = self.pool.block_size
        done = r.num_computed_tokens // bs
        hashes, prompt = r.block_hashes, r.prompt_token_ids
        if hashes is None or prompt is None or done <= len(hashes):  # no cache, a simulated request, or no full block
            return
        sequence = prompt + r.output_token_ids[:done * bs - len(prompt)]
        r.block_hashes = token_block_hashes(sequence, bs, r.cache_salt, known=hashes)
        self.pool.register(r)

    def apply_cancellations(self, ended: list[Request]) -> None:
        """End the requests cancelled since the last step."""
        now = self.clock.now()
        cancelled = {id(r) for r in self.to_cancel if not r.state.is_terminal}
        if not cancelled:
            self.to_cancel.clear()
            return
        for r in self.to_cancel:
            if r.state is RequestState.WAITING:
                self.waiting_prompt_tokens -= r.queued_tokens
            if not r.state.is_terminal:
                self.end(r, RequestState.CANCELLED, "cancelled", now, ended)
        self.to_cancel.clear()
        self.waiting = deque(r for r in self.waiting if id(r) not in cancelled)
        self.running = [r for r in self.running if id(r) not in cancelled]
        self.explicit = [r for r in self.explicit if id(r) not in cancelled]

    def expire(self, now: float, timeout_s: float, ended: list[Request]) -> None:
        """Expire requests that waited past ``timeout_s`` without ever starting."""
        cutoff_s = now - timeout_s
        waiting = self.waiting
        resumed = []
        while waiting:
            r = waiting[0]
            if r.ever_activated:  # evicted requests already started serving: they do not expire
                resumed.append(waiting.popleft())
            elif r.arrival_time_s < cutoff_s:
                waiting.popleft()
                self.waiting_prompt_tokens -= r.queued_tokens
                self.end(r, RequestState.EXPIRED, f"queue timeout of {timeout_s:.3g} s", now, ended)
            else:
                break
        waiting.extendleft(reversed(resumed))

    def fail(self, batch: Batch, reason: str, ended: list[Request]) -> None:
        """Fail every request of a step that raised (the steady decodes were in it too)."""
        now = self.clock.now()
        steady = [r for r in self.running if r.decode_lag is not None]  # the batch's first decodes
        for r in steady + batch.requests:
            if r.state is _RUNNING:
                self.end(r, RequestState.FAILED, reason, now, ended)
        self.running = [r for r in self.running if r.state is _RUNNING]
        self.explicit = [r for r in self.explicit if r.state is _RUNNING]
