"""Eviction keeps what a client has seen, every request ends exactly once whatever fails, a step
never exceeds its token budget, and no controller answer takes the engine down."""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Rejection
from tidegate.ctrl.greedy import GreedyController
from tidegate.engine.core.executor import StepResult
from tidegate.engine.core.request import RequestState
from tidegate.engine.sim.executor import SimExecutor
from tests.helpers import make_engine, record_evictions, req, run_until_idle, step_profile

# (arrival step, prompt tokens, output tokens, max_tokens - output tokens)
workloads = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(1, 30), st.integers(0, 6)),
                     min_size=1, max_size=25)
crowded = st.lists(st.tuples(st.integers(0, 8), st.integers(1, 24), st.integers(8, 40), st.integers(0, 6)),
                   min_size=3, max_size=20)  # bursts of long outputs: evictions in most runs


class RandomTokens(SimExecutor):
    """The simulator's step time, with a fresh random token for every sampling row (an unseeded
    temperature-1 sampler: a regenerated token almost never repeats)."""

    reads_requests = True

    def __init__(self, profile, seed: int = 0, fail_p: float = 0.0) -> None:
        super().__init__(profile)
        self.rng = random.Random(seed)
        self.fail_p = fail_p
        self.batches: list[tuple[int, int]] = []  # (tokens, decodes) of every step that ran

    def execute(self, batch):
        if batch.requests and self.rng.random() < self.fail_p:
            raise RuntimeError("device lost")
        self.batches.append((batch.num_tokens, batch.num_decodes))
        ids = [self.rng.randrange(1 << 30) if r.num_computed_tokens + n >= r.num_tokens else None
               for r, n in zip(batch.requests, batch.num_new_tokens)]
        return StepResult(self.step_time_s(batch.num_tokens, batch.kv_tokens_read), ids)


class Budgets(Controller):
    """Greedy activation with a token budget that changes every step (as AIMD controllers do)."""

    def __init__(self, budgets: list[int]) -> None:
        super().__init__()
        self.budgets = budgets
        self.last = 0

    def decide(self, obs):
        self.last = self.budgets[obs.step_index % len(self.budgets)]
        return Decision(token_budget=self.last)


def _check_kv(core):
    bs = core.pool.block_size
    held = sum(len(r.block_ids) for r in core.running)
    assert held + core.pool.num_free_blocks == core.pool.num_blocks
    assert all(not r.block_ids and r.num_computed_tokens == 0 for r in core.waiting)
    for r in core.running:  # the cached tokens fit; a prefill holds blocks for its whole sequence
        assert r.num_computed_tokens <= len(r.block_ids) * bs
        assert not r.is_prefilling or r.num_tokens <= len(r.block_ids) * bs


def _drive(core, workload, cancels=(), max_steps=20_000):
    pending = sorted(enumerate(workload), key=lambda x: x[1][0])
    requests = []
    step = 0
    while pending or core.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, out, extra) = pending.pop(0)
            r = req(i, prompt, out, max_tokens=out + extra, arrival=core.clock.now())
            requests.append(r)
            core.add_request(r)
        for i in cancels:
            if i < len(requests) and step == 3 * i:
                core.cancel(requests[i])
        core.step()
        _check_kv(core)
        step += 1
        assert step < max_steps, "the engine stalled"
    return requests


# ------------------------------------------------------------------ terminal states, exactly once
@given(crowded, st.sampled_from(["greedy", "flow:budget=2", "sglang", "greedy:queue_timeout_s=20"]),
       st.integers(64, 300), st.sampled_from([1, 4, 16]), st.sampled_from(["recompute", "reset"]),
       st.integers(0, 2**16), st.floats(0.0, 0.1), st.lists(st.integers(0, 19), max_size=4))
def test_every_request_ends_once_with_failing_steps_callbacks_and_cancels(workload, spec, capacity, block_size,
                                                                          eviction, seed, fail_p, cancels):
    profile = step_profile(kv_capacity_tokens=capacity, block_size=block_size)
    rng = random.Random(seed)
    finished: list = []

    def on_finish(r):
        finished.append(r)
        if rng.random() < 0.2:
            raise ValueError("client went away")

    def on_token(r, tok):
        if rng.random() < 0.05:
            raise KeyError("stream closed")

    core = make_engine(build_controller(spec, profile), capacity, block_size, eviction=eviction,
                       on_finish=on_finish, on_token=on_token)
    core.executor = RandomTokens(profile, seed, fail_p)
    requests = _drive(core, workload, cancels)
    event(f"evicted: {core.metrics.evictions > 0}, failed: {core.metrics.summary(capacity, 1, 1)['failed'] > 0}")
    counts = Counter(id(r) for r in finished)
    assert all(c == 1 for c in counts.values()), "on_finish fired twice for a request"
    assert set(counts) == {id(r) for r in requests}, "a request ended without on_finish"
    assert all(r.state.is_terminal for r in requests)
    assert len(core.metrics.terminal) == len(requests)
    assert core.pool.num_free_blocks == core.pool.num_blocks
    for r in requests:
        if r.state is RequestState.FINISHED:
            assert r.num_output_tokens == min(r.target_output_len, r.max_tokens) == len(r.output_token_ids)
    assert sum(core.callback_errors.values()) <= len(finished) + sum(r.num_output_tokens for r in requests)


def test_requests_that_ended_before_a_step_fails_still_get_on_finish():
    finished = []
    core = make_engine(GreedyController(), capacity=256, on_finish=finished.append)
    a, b = req("a", 4, 50), req("b", 4, 50)
    core.add_request(a)
    core.add_request(b)
    core.step()
    core.cancel(a)

    def broken(budget, late_after_s=None):
        raise RuntimeError("a bug in the batch builder")
    core.scheduler.build_batch = broken
    with pytest.raises(RuntimeError, match="batch builder"):
        core.step()
    assert finished == [a] and a.state is RequestState.CANCELLED and not a.block_ids


def test_a_raising_on_finish_does_not_stop_the_others(caplog):
    seen = []

    def on_finish(r):
        seen.append(r.request_id)
        raise RuntimeError("boom")

    core = make_engine(GreedyController(), capacity=256, on_finish=on_finish)
    rs = [req(i, 4, 3) for i in range(5)]
    for r in rs:
        core.add_request(r)
    with caplog.at_level(logging.WARNING, logger="tidegate.engine.core.engine_core"):
        run_until_idle(core)
    assert sorted(seen) == sorted(r.request_id for r in rs)
    assert core.callback_errors == {"on_finish raised RuntimeError": 5}
    assert len([m for m in caplog.messages if "on_finish raised" in m]) == 1, "logged once per cause"
    assert all(r.state is RequestState.FINISHED for r in rs)


# ------------------------------------------------------------------ the token budget
@given(st.one_of(workloads, crowded), st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(48, 400),
       st.sampled_from(["recompute", "reset"]))
def test_a_step_never_exceeds_its_token_budget(workload, budgets, capacity, eviction):
    controller = Budgets(budgets)
    core = make_engine(controller, capacity, 4, eviction=eviction)
    seen = []
    inner = core.executor

    class Spy:
        def execute(self, batch):
            assert batch.num_tokens == sum(batch.num_new_tokens) <= controller.last
            assert batch.num_new_tokens[:batch.num_decodes] == [1] * batch.num_decodes
            seen.append(sum(not r.is_prefilling for r in core.running) > batch.num_decodes)
            return inner.execute(batch)

        def release(self, r):
            inner.release(r)

    core.executor = Spy()
    requests = _drive(core, workload)
    event(f"decodes cut: {any(seen)}")
    assert all(r.state in (RequestState.FINISHED, RequestState.REJECTED) for r in requests)
    assert seen


def test_decodes_cut_by_the_budget_take_turns():
    controller = Budgets([100])
    core = make_engine(controller, capacity=1024, block_size=4)
    rs = [req(i, 2, 40) for i in range(10)]
    for r in rs:
        core.add_request(r)
    core.step()  # every prompt in one step: ten decodes from now on
    assert all(not r.is_prefilling for r in rs)
    controller.budgets = [3]
    before = [r.num_output_tokens for r in rs]
    for _ in range(20):  # 60 decode slots over 10 decoding requests
        core.step()
    served = [r.num_output_tokens - b for r, b in zip(rs, before)]
    assert sum(served) == 60 and set(served) == {6}, served


# ------------------------------------------------------------------ recompute eviction
@given(crowded, st.integers(64, 200), st.sampled_from([1, 4, 8]), st.integers(0, 2**16))
def test_recompute_keeps_every_token_a_client_has_seen(workload, capacity, block_size, seed):
    profile = step_profile(kv_capacity_tokens=capacity, block_size=block_size)
    streamed: dict[int, list[int]] = {}
    core = make_engine(GreedyController(max_num_batched_tokens=32), capacity, block_size,
                       on_token=lambda r, tok: streamed.setdefault(id(r), []).append(tok))
    core.executor = executor = RandomTokens(profile, seed)
    evicted = record_evictions(core)
    kept = []
    spy = core.scheduler.evict

    def evict(r):
        out = list(r.output_token_ids)
        spy(r)
        kept.append((r, out))
        assert r.output_token_ids == out and r.num_output_tokens == len(out)
    core.scheduler.evict = evict
    requests = [r for r in _drive(core, workload) if r.state is not RequestState.REJECTED]
    event(f"evicted: {bool(kept)}")
    assert all(r.state is RequestState.FINISHED for r in requests)
    for r, out in kept:
        assert r.output_token_ids[:len(out)] == out, "an eviction changed tokens already streamed"
    for r in requests:
        assert streamed.get(id(r), []) == r.output_token_ids, "each token is streamed once, in order"
        assert r.num_output_tokens == min(r.target_output_len, r.max_tokens)
    # The simulator charges the recompute: every token fed once, plus the discarded KV again.
    fed = sum(t for t, _ in executor.batches)
    assert fed == sum(r.prompt_len + r.num_output_tokens - 1 + r.wasted_tokens for r in requests)
    assert core.metrics.wasted_tokens == sum(before for *_, before, _ in evicted)


def test_an_evicted_request_re_prefills_prompt_and_output_then_decodes():
    core = make_engine(GreedyController(max_num_batched_tokens=100), capacity=32, block_size=4)
    a, b = req("a", 8, 20), req("b", 8, 20)
    for r in (a, b):
        core.add_request(r)
    while b.num_evictions == 0:
        core.step()
    out = b.num_output_tokens
    assert b.state is RequestState.WAITING and b.num_computed_tokens == 0 and out > 0
    assert core.waiting[0] is b and b.is_prefilling
    assert core.obs.waiting_prompt_tokens == 0  # as of the last observation; the next counts the re-prefill
    assert core.observe().waiting_prompt_tokens == b.prompt_len + out
    while b.state is RequestState.WAITING:
        core.step()
    assert b.num_output_tokens == out + 1 and b.num_computed_tokens == b.prompt_len + out
    assert not b.is_prefilling  # one token pending, an output to feed: a decode
    run_until_idle(core)
    assert a.state is b.state is RequestState.FINISHED
    assert a.num_output_tokens == b.num_output_tokens == 20
    assert core.metrics.wasted_tokens == b.wasted_tokens > 0


def test_reset_eviction_discards_progress_as_in_the_paper():
    core = make_engine(GreedyController(max_num_batched_tokens=100), capacity=32, block_size=4, eviction="reset")
    a, b, c = req("a", 8, 20), req("b", 8, 20), req("c", 4, 1)
    for r in (a, b):
        core.add_request(r)
    while b.num_evictions == 0:
        core.step()
    assert b.state is RequestState.WAITING and b.num_computed_tokens == 0 and b.num_output_tokens == 0
    core.add_request(c)
    assert core.waiting[0] is b
    assert core.metrics.wasted_tokens > 0
    run_until_idle(core)
    assert b.num_output_tokens == 20


def test_recompute_finishes_sooner_than_reset_at_overload():
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.sim.simulate import simulate
    from tidegate.engine.workloads import Arrival

    profile = load_profile("a100-llama2-7b")
    arrivals = [Arrival(i * 0.02, 300 + 37 * (i % 11), 200 + 13 * (i % 7), 512) for i in range(400)]
    runs = {mode: simulate(arrivals, profile, build_controller("greedy", profile), eviction=mode).summary
            for mode in ("recompute", "reset")}
    assert runs["recompute"]["completed"] == runs["reset"]["completed"] == 400
    assert runs["recompute"]["evictions"] > 0 and runs["reset"]["evictions"] > 0
    assert runs["recompute"]["sim_time_s"] < runs["reset"]["sim_time_s"]
    with pytest.raises(ValueError, match="eviction must be one of recompute, reset"):
        make_engine(GreedyController(), eviction="lifo")


# ------------------------------------------------------------------ controllers that fail
GARBAGE = [None, "7", float("nan"), float("inf"), -float("inf"), -5, 10**30, 2.5, True, object(), 0]


@st.composite
def answers(draw):
    kind = draw(st.sampled_from(["raise", "not a decision", "garbage", "fine"]))
    if kind == "raise":
        return ZeroDivisionError("bug")
    if kind == "not a decision":
        return draw(st.sampled_from([None, 3, "decide", {}, Rejection("no", 1.0)]))
    if kind == "fine":
        return Decision(draw(st.integers(0, 5)), draw(st.integers(1, 64)), draw(st.integers(1, 64)))
    field = st.sampled_from(GARBAGE)
    return Decision(draw(field), draw(field), draw(field),
                    draw(st.sampled_from([None, 0.5, float("nan"), float("inf"), -1.0, "x", 10**40])),
                    draw(st.sampled_from([None, {0: 2}, {0: 2.5}, {0: "x"}, {0: float("nan")}, [1, 2], {1: 10**30}])))


class Chaotic(Controller):
    """Answers each step from a drawn script: a Decision, garbage, or an exception."""

    def __init__(self, script, admits) -> None:
        super().__init__(queue_timeout_s=50.0)  # a script that never activates drains by expiry
        self.script, self.admits = script, admits
        self.calls = 0

    def decide(self, obs):
        self.calls += 1
        a = self.script[self.calls % len(self.script)]
        if isinstance(a, Exception):
            raise a
        return a

    def admit(self, obs, prompt_tokens, max_tokens):
        a = self.admits[self.calls % len(self.admits)]
        if isinstance(a, Exception):
            raise a
        return a


@given(workloads, st.lists(answers(), min_size=1, max_size=6),
       st.lists(st.sampled_from([None, Rejection("busy", 2.0), Rejection("busy", float("nan")), 3, "no",
                                 KeyError("x")]), min_size=1, max_size=4),
       st.sampled_from(["recompute", "reset"]))
def test_no_controller_answer_leaves_the_engine(workload, script, admits, eviction):
    core = make_engine(Chaotic(script, admits), 256, 4, eviction=eviction)
    requests = _drive(core, workload, max_steps=50_000)
    assert all(r.state.is_terminal for r in requests)
    for r in requests:
        if r.state is RequestState.REJECTED:
            assert isinstance(r.finish_reason, str) and 0 <= r.retry_after_s < float("inf")
    assert core.pool.num_free_blocks == core.pool.num_blocks
    if any(isinstance(a, Exception) for a in script) and core.controller.calls >= len(script):
        assert any("decide raised" in cause for cause in core.controller_errors)


def test_a_raising_controller_gets_the_conservative_decision_and_one_log_line(caplog):
    class Broken(Controller):
        def decide(self, obs):
            raise RuntimeError("policy file corrupt")

        def admit(self, obs, prompt_tokens, max_tokens):
            raise RuntimeError("policy file corrupt")

    core = make_engine(Broken(max_waiting=3), capacity=256)
    with caplog.at_level(logging.WARNING, logger="tidegate.engine.core.engine_core"):
        results = [core.add_request(req(i, 4, 5)) for i in range(5)]
        running = []
        while core.has_unfinished:
            core.step()
            running.append(len(core.running))
    assert results[:3] == [None] * 3 and all(isinstance(x, Rejection) for x in results[3:])
    assert "queue is full" in results[3].reason  # the base max_waiting check still refuses
    assert max(running) == 1, "only the queue head is activated, and only when nothing runs"
    assert core.controller_errors["controller.admit raised RuntimeError"] == 5
    assert core.controller_errors["controller.decide raised RuntimeError"] == len(running)
    assert len([m for m in caplog.messages if "decide raised" in m]) == 1


def test_numbers_of_any_kind_in_a_decision_are_bounded():
    class Odd(Controller):
        def decide(self, obs):
            return Decision(activation_budget=float("inf"), token_budget=10**30, running_cap=2.9,
                            kv_reserve_ratio=10**40)

    core = make_engine(Odd(), capacity=256)
    rs = [req(i, 4, 3) for i in range(4)]
    for r in rs:
        core.add_request(r)
    core.step()
    assert len(core.running) == 2  # running_cap 2.9 is 2; a ratio above 1 reserves all of max_tokens
    assert core._token_budget == UNLIMITED
    run_until_idle(core)
    assert all(r.state is RequestState.FINISHED for r in rs)
    assert core.controller_errors == {}  # out-of-range numbers are bounded, not errors


# ------------------------------------------------------------------ KV blocks, step by step
class Scripted(Controller):
    """Greedy activation with a token budget and a late-after time that change every step, so
    decodes get cut and prefill chunks reordered."""

    def __init__(self, budgets: list[int], lates: list[float | None]) -> None:
        super().__init__()
        self.budgets, self.lates = budgets, lates

    def decide(self, obs):
        i = obs.step_index
        return Decision(token_budget=self.budgets[i % len(self.budgets)], late_after_s=self.lates[i % len(self.lates)])


@given(crowded, st.lists(st.integers(1, 24), min_size=1, max_size=6),
       st.lists(st.sampled_from([None, 0.0, 2.0]), min_size=1, max_size=3), st.integers(48, 200),
       st.sampled_from([1, 4, 16]), st.sampled_from(["recompute", "reset"]), st.booleans(), st.integers(0, 2**16))
def test_blocks_grow_exactly_in_activation_order_off_the_front_of_the_free_list(
        workload, budgets, lates, capacity, block_size, eviction, with_tokens, seed):
    """When a step's batch is built, each running request holds exactly the blocks of its sequence
    and ``running`` is in activation order; the blocks a step adds are the free list's first ones
    (after those the evicted requests returned, in eviction order), handed out in activation order."""
    profile = step_profile(kv_capacity_tokens=capacity, block_size=block_size)
    kwargs = {"on_token": lambda r, tok: None} if with_tokens else {}
    core = make_engine(Scripted(budgets, lates), capacity, block_size, eviction=eviction, **kwargs)
    if with_tokens:
        core.executor = RandomTokens(profile, seed)
    pool, make_room, build_batch = core.pool, core.scheduler.make_room, core.scheduler.build_batch

    def checked_make_room():
        before = list(core.running)
        held = {id(r): list(r.block_ids) for r in before}
        free = list(pool._free)
        make_room()
        kept = {id(r) for r in core.running}
        for r in reversed(before):  # evicted from the newest down
            if id(r) not in kept:
                free.extend(held[id(r)])
        added = [b for r in core.running for b in r.block_ids[len(held[id(r)]):]]
        assert all(r.block_ids[:len(held[id(r)])] == held[id(r)] for r in core.running)
        assert added == free[:len(added)] and list(pool._free) == free[len(added):]

    def checked_build_batch(token_budget, late_after_s=None):
        core.sync()  # steady decodes' counts lag within a step
        seqs = [r.activation_seq for r in core.running]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        for r in core.running:
            assert len(r.block_ids) == pool.blocks_for(r.num_tokens), "a running request holds a block too many or few"
        held = [b for r in core.running for b in r.block_ids]
        assert len(held) == len(set(held)) and len(held) + pool.num_free_blocks == pool.num_blocks
        return build_batch(token_budget, late_after_s)

    core.scheduler.make_room, core.scheduler.build_batch = checked_make_room, checked_build_batch
    requests = _drive(core, workload)
    event(f"evicted: {core.metrics.evictions > 0}")
    assert all(r.state in (RequestState.FINISHED, RequestState.REJECTED) for r in requests)
    assert pool.num_free_blocks == pool.num_blocks
