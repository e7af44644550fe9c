from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import Controller, Decision, Rejection
from tidegate.ctrl.greedy import GreedyController
from tidegate.engine.core.request import RequestState
from tests.helpers import step_profile, make_engine, record_evictions, req, run_until_idle

CONTROLLER_SPECS = ["greedy", "no-evict", "sglang", "watermark:queue_limit=5", "flow:budget=2",
                    "flow:adaptive=true", "flow:budget=0.5,dist=poisson", "greedy:queue_timeout_s=30",
                    "greedy:max_waiting=4", "class-budgets:budgets=1/0.5", "slo-flow:ttft_slo_s=0.05"]

workloads = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 60), st.integers(1, 40), st.integers(0, 8),
              st.integers(0, 1)),
    min_size=1, max_size=30)


def _check_step(core):
    assert core.pool.used_tokens <= core.pool.capacity_tokens
    held = sum(len(r.block_ids) for r in core.running)
    assert held + core.pool.num_free_blocks == core.pool.num_blocks
    assert all(not r.block_ids for r in core.waiting)
    assert core.observe().running_prompt_tokens == sum(r.prompt_len for r in core.running)


@given(workloads, st.sampled_from(CONTROLLER_SPECS), st.integers(64, 400), st.sampled_from([1, 4, 16]),
       st.lists(st.integers(0, 29), max_size=4))
def test_every_request_ends_in_exactly_one_terminal_state(workload, spec, capacity, block_size, cancels):
    profile = step_profile(kv_capacity_tokens=capacity, block_size=block_size)
    core = make_engine(build_controller(spec, profile), capacity, block_size)
    core.controller.reset()
    ended = []
    core.on_finish = ended.append
    pending = sorted(enumerate(workload), key=lambda x: x[1][0])
    requests = []
    step = 0
    while pending or core.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, out, extra, cls) = pending.pop(0)
            r = req(i, prompt, out, max_tokens=out + extra, arrival=core.clock.now(), class_id=cls)
            requests.append(r)
            core.add_request(r)
            if i in cancels:
                core.cancel(r)
        core.step()
        _check_step(core)
        step += 1
        assert step < 50_000
    counts = Counter(id(r) for r in ended)
    assert all(c == 1 for c in counts.values()), "a request ended twice"
    assert set(counts) == {id(r) for r in requests}, "a request never ended"
    assert all(r.state.is_terminal for r in requests)
    m = core.metrics
    assert len(m.terminal) == len(requests) == m.arrived
    assert core.pool.num_free_blocks == core.pool.num_blocks
    for r in requests:
        if r.state is RequestState.FINISHED:
            assert r.num_output_tokens == min(r.target_output_len, r.max_tokens)
            assert r.first_token_time_s <= r.finish_time_s
    summary = m.summary(core.pool.capacity_tokens, 10.0, 1.0)
    assert (summary["completed"] + summary["rejected"] + summary["expired"] + summary["cancelled"]
            + summary["failed"]) == summary["requests"]
    assert summary["wasted_tokens"] == sum(r.wasted_tokens for r in requests)
    assert summary["evictions"] == sum(r.num_evictions for r in requests)


def test_lifo_eviction_takes_the_most_recently_activated():
    # 3 requests of 8 prompt tokens fill 6 of 8 blocks (block 4); growth forces evictions.
    core = make_engine(GreedyController(max_num_seqs=10, max_num_batched_tokens=100), capacity=32, block_size=4)
    rs = [req(i, 8, 20) for i in range(3)]
    for r in rs:
        core.add_request(r)
    evicted = record_evictions(core)
    run_until_idle(core)
    assert evicted, "the scenario must force an eviction"
    for _, seq, newest, *_ in evicted:
        assert seq == newest
    assert rs[0].num_evictions == 0, "the oldest request is never evicted"
    assert all(r.state is RequestState.FINISHED for r in rs)


def test_token_budget_limits_prefill_chunks():
    class Fixed(Controller):
        def decide(self, obs):
            return Decision(token_budget=16)

    core = make_engine(Fixed(), capacity=1024, block_size=4)
    for i in range(4):
        core.add_request(req(i, 50, 5))
    sizes = []
    orig = core.executor.execute

    def spy(batch):
        sizes.append(batch.num_tokens)
        return orig(batch)
    core.executor.execute = spy
    run_until_idle(core)
    assert max(sizes) <= 16
    assert sum(sizes) == 4 * 50 + 4 * 4  # prompts once, then 4 decodes each (first token comes with prefill)


def _first_token_order(late_after_s, arrivals=(0.0, 0.0, 9.5), prompt=40, budget=16):
    """Three requests activated together, prefilling 16 tokens a step; the first two arrived long
    before the third. Returns the order in which they got their first token."""
    class Fixed(Controller):
        def decide(self, obs):
            return Decision(token_budget=budget, late_after_s=late_after_s)

    core = make_engine(Fixed(), capacity=1024, block_size=4)
    core.clock.advance(10.0)
    reqs = [req(i, prompt, 3, arrival=t) for i, t in enumerate(arrivals)]
    for r in reqs:
        core.add_request(r)
    run_until_idle(core)
    return [r.request_id for r in sorted(reqs, key=lambda r: r.first_token_time_s)]


def test_late_requests_prefill_after_those_that_can_still_meet_their_slo():
    assert _first_token_order(None) == ["0", "1", "2"]  # activation order
    assert _first_token_order(6.0) == ["2", "0", "1"]  # 0 and 1 waited 10 s: late; 2 waited 0.5 s
    assert _first_token_order(30.0) == ["0", "1", "2"]  # nobody late
    assert _first_token_order(0.0, arrivals=(0.0, 5.0, 9.0)) == ["0", "1", "2"]  # all late: activation order


@pytest.mark.parametrize("late, errors", [(float("nan"), True), ("soon", True), (-3.0, False), (2, False),
                                         (float("inf"), False)])
def test_an_unusable_late_after_s_falls_back_to_the_conservative_decision(late, errors):
    class Odd(Controller):
        def decide(self, obs):
            return Decision(token_budget=16, late_after_s=late)

    core = make_engine(Odd(), capacity=1024, block_size=4)
    for i in range(3):
        core.add_request(req(i, 20, 3))
    run_until_idle(core)
    assert bool(core.controller_errors) == errors
    assert all(r.state is RequestState.FINISHED for r in core.metrics.terminal)


def test_queue_timeout_expires_only_requests_that_never_started():
    core = make_engine(GreedyController(max_num_seqs=1, queue_timeout_s=5), capacity=256)
    rs = [req(i, 4, 10) for i in range(3)]
    for r in rs:
        core.add_request(r)
    run_until_idle(core)
    assert rs[0].state is RequestState.FINISHED
    assert [r.state for r in rs[1:]] == [RequestState.EXPIRED] * 2
    assert rs[1].finish_reason.startswith("queue timeout of ")


def test_max_waiting_rejects_with_retry_after():
    core = make_engine(GreedyController(max_waiting=2), capacity=256)
    out = [core.add_request(req(i, 4, 4)) for i in range(4)]
    assert out[:2] == [None, None]
    assert out[2].retry_after_s > 0 and "queue is full" in out[2].reason
    assert core.metrics.terminal[0].state is RequestState.REJECTED


def test_request_larger_than_the_pool_is_rejected_at_arrival():
    core = make_engine(GreedyController(), capacity=64)
    rejection = core.add_request(req(0, 60, 10))
    assert rejection is not None and "exceeds the KV capacity" in rejection.reason


def test_cancel_frees_blocks_at_the_next_step():
    core = make_engine(GreedyController(), capacity=256)
    r = req(0, 10, 100)
    core.add_request(r)
    core.step()
    assert r.block_ids
    core.cancel(r)
    core.step()
    assert r.state is RequestState.CANCELLED and not r.block_ids
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_executor_exception_fails_the_step_and_engine_goes_on():
    core = make_engine(GreedyController(), capacity=256)
    orig = core.executor.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return orig(batch)
    core.executor.execute = flaky
    a = req("a", 4, 5)
    core.add_request(a)
    core.step()
    core.step()
    assert a.state is RequestState.FAILED and "device lost" in a.finish_reason
    b = req("b", 4, 3)
    core.add_request(b)
    run_until_idle(core)
    assert b.state is RequestState.FINISHED
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_time_advances_by_the_profile():
    profile = step_profile(base_s=0.01, per_token_s=0.001, per_kv_token_s=0.0001)
    from tidegate.engine.sim.executor import SimExecutor
    ex = SimExecutor(profile)
    from tidegate.engine.core.executor import Batch
    b = Batch()
    b.requests, b.num_tokens, b.kv_tokens_read = [object()], 10, 100
    assert ex.execute(b).duration_s == pytest.approx(0.01 + 0.01 + 0.01)


def test_request_size_estimates_weigh_every_completion_alike_at_first_and_see_refused_prompts():
    """The workload means are exponentially weighted but corrected for their start: after two
    completions they are (almost) the plain mean, where an average seeded with the first value
    kept 99% of it. The offered prompt mean counts every arrival, refused ones included."""
    class Refuse(Controller):
        def __init__(self):
            super().__init__()
            self.refuse = False

        def decide(self, obs):
            return Decision()

        def admit(self, obs, prompt_tokens, max_tokens):
            return Rejection("full", 1.0) if self.refuse else None

    core = make_engine(Refuse(), capacity=4096, block_size=4)
    core.add_request(req(0, 100, 10))
    core.add_request(req(1, 300, 30))
    core.controller.refuse = True
    refused = req(2, 2000, 5)
    assert core.add_request(refused) is not None
    run_until_idle(core)
    obs = core.observe()
    assert obs.completed_total == 2
    assert obs.mean_prompt_tokens == pytest.approx(200, rel=0.01)
    assert obs.mean_output_tokens == pytest.approx(20, rel=0.01)
    assert obs.lifetime_kv_workload == pytest.approx((100 * 10 + 55 + 300 * 30 + 465) / 2, rel=0.01)
    assert obs.offered_prompt_tokens == pytest.approx((100 + 300 + 2000) / 3, rel=0.01)
    assert obs.offered_rate_rps > 0 and obs.served_rate_rps > 0


def test_ttft_errors_count_a_late_request_up_to_its_activation_or_the_slo_under_late_last():
    """Under late-last prefill, a running request's wait past the SLO is the order's doing: its
    prediction error counts up to the SLO. A request that waited in the queue past the SLO counts
    up to its activation: the queue wait is the prediction's to foresee."""

    class LateLast(Controller):
        name = "late-last"

        def decide(self, obs):
            start = 1 if obs.step_index in (0, 4) else 0  # the second request waits 4 steps in the queue
            return Decision(activation_budget=start, token_budget=4, late_after_s=3.0)

    core = make_engine(LateLast(), capacity=256, block_size=4)
    first, second = req(0, 20, 2), req(1, 20, 2)
    core.add_request(first)
    core.add_request(second)
    errors = []
    while core.has_unfinished:
        seen = first.first_token_time_s, second.first_token_time_s
        core.step()
        if (first.first_token_time_s, second.first_token_time_s) != seen:
            errors.append(core.observe().ttft_error_p95_s)
    assert first.predicted_ttft_s == second.predicted_ttft_s == 0.0  # nothing timed at arrival
    assert first.first_token_time_s > 3.0 and second.start_time_s >= 4.0
    assert second.first_token_time_s > second.start_time_s + 3.0
    # the first: activated at once, its first token at 5 s, counted as 3 s (the SLO) late
    assert errors[0] == pytest.approx(3.0)
    # the second: 4 s in the queue, counted as 4 s late (p90 of the two), not its whole TTFT
    assert errors[1] == pytest.approx(second.start_time_s)
