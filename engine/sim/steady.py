"""The simulator's fast path: the stretches in which only steady decodes run, stepped in one call.

With an executor that reads only a batch's counts (the simulator's, ``reads_requests = False``),
the scheduler counts the requests that decode steadily in aggregate (``engine.core.steady_decodes``).
Between two events that need the scheduler (an arrival, an end, an expiry, a block the pool
lacks) every step is then the same: the steady decodes, one token each. :func:`run_steady` runs
those steps without asking the controller or observing, each exactly as ``EngineCore.step(False)``
would, and leaves the engine as stepping one by one leaves it (``tests/test_steady_runs.py``).
It applies only to executors that read counts, so it lives with the simulator; ``replay`` takes it
as its ``fast_forward``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from tidegate.ctrl.base import UNLIMITED, Decision
from tidegate.engine.core.decision import plainly_usable, real_number
from tidegate.engine.core.executor import Batch, StepResult
from tidegate.engine.core.request import Request

if TYPE_CHECKING:
    from tidegate.engine.core.engine_core import EngineCore

_by_activation = attrgetter("activation_seq")

#: the fewest steps ``run_steady`` expects to run (by the next end, and the next arrival at the
#: mean step time) for it to run any: below, setting the stretch up costs more than it saves
MIN_STEADY_RUN = 4


def run_steady(core: EngineCore, until_s: float, max_steps: int | None = None) -> list[Request]:
    """Run the steps in which nothing but the steady decodes can happen, each exactly as
    ``step(False)`` would, without asking the controller or observing; returns the requests
    that reached a terminal state (only a failing step ends any). ``steady_steps`` says how
    many ran: none when the next step could do anything else.

    Requests may wait while the queue's head cannot start (the running cap is reached, or the
    pool lacks the blocks for its prompt: steady steps only take blocks, so it cannot start
    before the stretch ends). It stops before a step that starts at or after ``until_s`` (the
    next arrival), in which a request ends or expires, that needs a block the pool does not
    have, past ``max_steps``, or when the controller does not promise its decision
    (``Controller.steady_decision``). Afterwards the observation reads as after stepping one by one.
    """
    core.steady_steps = 0
    sched, steady_set = core.scheduler, core.scheduler.steady
    if (sched.explicit or not steady_set.count or steady_set.tick < core._steady_retry_tick
            or until_s == core._steady_retry_until):  # the common misses, kept cheap
        return []
    start_with = _steady_start(core, until_s)
    if start_with is None:
        return []
    d, expires_after = start_with
    clock, pool, execute, heap, stats = core.clock, core.pool, core._executor.execute, steady_set.ends, core.stats
    blocks, bs, steady, base = steady_set.blocks, core.pool.block_size, steady_set.count, steady_set.base
    limit = UNLIMITED if max_steps is None else max_steps
    ended: list[Request] = []
    ran, seen = 0, None  # seen: what the last step's observation saw (``_observe_steady``)
    try:
        while ran < limit:
            now, tick = clock.now(), steady_set.tick
            if now >= until_s or (heap and heap[0][0] <= tick + 1):
                break
            if expires_after is not None and expires_after[0] < now - expires_after[1]:
                break  # the queue's first request expires in this step
            held = pool.used_tokens
            if blocks[tick % bs] and not _grow_steady(core, tick):
                break  # an eviction: the full step does it
            stats.kv_steps += held
            batch = Batch()
            batch.num_tokens = batch.num_decodes = steady
            batch.kv_tokens_read = kv_read = base + steady * tick
            seen = (now, held, stats.decode_kv_steps, sched.evicted_last_step)
            sched.evicted_last_step = 0
            stats.decode_kv_steps += kv_read
            fresh = steady_set.first
            batch.first_decodes = fresh[1] if fresh[0] == tick else 0
            ran += 1
            try:
                result = execute(batch)
                if result.duration_s is not None:
                    clock.advance(result.duration_s)
                outcome: StepResult | Exception = result
            except Exception as exc:
                outcome = exc
            if isinstance(outcome, Exception) or result.token_ids is not None or result.stopped or result.failed:
                _steady_step_ends(core, seen, batch, outcome, ended)
                seen = None  # that step's observation is made
                break
            steady_set.tick = tick + 1
            core._finish_step(now, batch)
    finally:
        if ran:
            core.steady_steps = ran
            _after_steady(core, d, seen, ended)
    return ended


def _grow_steady(core: EngineCore, tick: int) -> bool:
    """``Scheduler.make_room`` for a step in which only steady decodes run: the blocks due at ``tick``,
    in activation order; False, and nothing given, when the pool has too few (an eviction)."""
    bs = core.pool.block_size
    growing = [r for r in core.scheduler.steady.blocks[tick % bs]
               if r.prompt_len + tick - (r.decode_lag or 0) > len(r.block_ids) * bs]
    if len(growing) > core.pool.num_free_blocks:
        return False
    if growing:
        growing.sort(key=_by_activation)
        core.pool.add_one_block(growing)
    return True


def _steady_step_ends(core: EngineCore, seen: tuple[float, int, float, int], batch: Batch, outcome,
                      ended: list[Request]) -> None:
    """A steady step whose executor raised (``outcome`` the exception) or said more than a
    duration (``outcome`` the StepResult: token ids, stopped or failed requests), finished as
    a full step finishes it, after the observation its start made (``seen``, see
    ``_observe_steady``): a commit that raises fails the step's requests too."""
    _observe_steady(core, *seen)
    if not isinstance(outcome, BaseException):
        try:
            core.scheduler.update(batch, outcome, ended)
            outcome = None
        except Exception as exc:
            outcome = exc
    if outcome is not None:  # the step's requests fail, the engine keeps serving
        core._count_error(core.step_errors, f"step failed: {type(outcome).__name__}", outcome)
        core.scheduler.fail(batch, f"step failed: {type(outcome).__name__}: {outcome}", ended)
    core._finish_step(seen[0], batch)


def _after_steady(core: EngineCore, d: Decision, seen: tuple[float, int, float, int] | None,
                  ended: list[Request]) -> None:
    """What the steps ``run_steady`` ran leave as full steps leave it: the decision's settings,
    and the observation as the last step's start made it (``seen``; None: made already)."""
    core._token_budget, core._running_cap = d.token_budget, d.running_cap
    core.scheduler.late_after_s = d.late_after_s
    core.scheduler.rotating = False
    if seen is not None:
        _observe_steady(core, *seen)
        core.stats.current.step_index = core.step_index - 1
    if ended:
        core._notify_finished(ended)


def _observe_steady(core: EngineCore, start: float, used: int, decoded: float, evicted: int) -> None:
    """The observation a steady step starting at ``start`` made: ``used`` KV tokens held (before
    its blocks), its KV steps counted, ``decoded`` the decodes' KV steps before its own,
    ``evicted`` the evictions of the step before it."""
    obs, stats = core._observe(start), core.stats
    obs.kv_used_tokens = used
    obs.evicted_last_step = evicted
    if stats.kv_completions > 0:
        obs.occupied_kv_workload = stats.kv_steps / stats.kv_completions
        obs.decode_kv_workload = decoded / stats.kv_completions
    obs.running_prefill_tokens = 0


def _steady_start(core: EngineCore, until_s: float) -> tuple[Decision, tuple[float, float] | None] | None:
    """The decision a steady stretch runs under and the queue's first expiry, when one may
    start now and is not too short to be worth it (``MIN_STEADY_RUN``)."""
    heap, tick = core.scheduler.steady.ends, core.scheduler.steady.tick
    if heap and heap[0][0] <= tick + MIN_STEADY_RUN:
        core._steady_retry_tick = heap[0][0]  # a stretch this short is cheaper stepped one by one
        return None
    if until_s - core.clock.now() < MIN_STEADY_RUN * core.stats.current.mean_step_time_s:
        core._steady_retry_until = until_s  # nor before the next arrival, as the gap only shrinks
        return None
    d = _steady_decision(core)
    expiry = _first_expiry(core) if d is not None else False
    if d is None or expiry is False:
        return None
    return d, expiry if isinstance(expiry, tuple) else None


def _steady_decision(core: EngineCore) -> Decision | None:
    """The controller's promised decision while only steady decodes run, when the engine may
    step without asking: nothing is cancelled or short of a block (``run_steady`` has seen
    that some decode steadily and none is listed), the decodes fit the token budget, the
    decision is one ``_decide`` takes as it is, and the queue's head, if any, cannot start."""
    sched = core.scheduler
    if sched.to_cancel or sched.needs_block or sched.on_token is not None or sched.lists_requests:
        return None
    try:
        d = core.controller.steady_decision()
        if type(d) is not Decision or not plainly_usable(d) or d.token_budget < sched.steady.count:
            return None
    except Exception:
        return None
    if core.waiting:
        head = core.waiting[0]
        if (d.kv_reserve_ratio is not None or min(d.activation_budget, d.running_cap - len(core.running)) > 0
                and sched.blocks_to_start(head) <= core.pool.num_free_blocks):
            return None
    return d


def _first_expiry(core: EngineCore) -> tuple[float, float] | None | bool:
    """(arrival, queue timeout) of the first waiting request that never started, which
    ``_expire`` looks at first; None when nothing can expire; False when the timeout is not
    a number (each full step counts that as a controller error)."""
    if not core.waiting:
        return None
    try:
        timeout = core.controller.queue_timeout_s
    except Exception:
        return None
    if timeout is None:
        return None
    try:
        seconds = real_number(timeout)
    except Exception:
        return False
    if seconds is None:
        return False
    for r in core.waiting:
        if not r.ever_activated:
            return r.arrival_time_s, seconds
    return None
