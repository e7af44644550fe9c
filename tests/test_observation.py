"""The Observation: its rates are computed when first read, and read as if computed at once; a
controller gets fresh copies it cannot change the engine through.

``ObservationStats.observe`` hands the rate estimators to the Observation instead of computing the
four rates; the first read computes them at the observation's ``now_s``. Arrivals and completions
that come later must not change what a late read sees.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tidegate.ctrl.base import Controller, Decision, Observation
from tidegate.engine.core.request import RequestState
from tests.helpers import make_engine, req

RATES = ("arrival_rate_rps", "offered_rate_rps", "completion_rate_rps", "served_rate_rps", "slot_completion_rate_rps")


class Reference(Controller):
    """Computes the four rates from the engine's estimators at every observation (eagerly, as the
    engine once did), and reads the observation's own only when told to."""

    def __init__(self, reads: list[bool]) -> None:
        super().__init__()
        self.core = None
        self.reads = reads
        self.expected: tuple[float, ...] = (0.0,) * len(RATES)  # a new Observation's
        self.calls = 0

    def _snapshot(self, obs: Observation) -> None:
        c = self.core
        estimators = (c.stats.arrivals, c.stats.offered, c.stats.completions, c.stats.served, c.stats.slot_completions)
        self.expected = tuple(e.rate(obs.now_s) for e in estimators)
        self.calls += 1
        if self.reads[self.calls % len(self.reads)]:
            assert tuple(getattr(obs, n) for n in RATES) == self.expected

    def admit(self, obs, prompt_tokens, max_tokens):
        self._snapshot(obs)
        return None

    def decide(self, obs):
        self._snapshot(obs)
        return Decision(token_budget=32)


@given(arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20) | st.just(300), st.integers(1, 12)),
                         min_size=1, max_size=40),  # 300 prompt tokens never fit: refused on arrival
       reads=st.lists(st.booleans(), min_size=1, max_size=5), late=st.lists(st.booleans(), min_size=1, max_size=5),
       asked=st.lists(st.booleans(), min_size=1, max_size=5))
def test_rates_read_late_equal_the_rates_at_the_observation(arrivals, reads, late, asked):
    ctrl = Reference(reads)
    core = make_engine(ctrl, capacity=128)
    ctrl.core = core
    pending = sorted(arrivals)
    for step in range(400):
        while pending and pending[0][0] <= step:
            _, prompt, out = pending.pop(0)
            r = req(step * 100 + len(pending), prompt, out, arrival=core.clock.now())
            if asked[(step + len(pending)) % len(asked)]:
                core.add_request(r)
            else:  # decided already (a server's front end): no new observation
                core.add_request(r, admission=None)
            if late[(step + len(pending)) % len(late)]:  # read after the arrival counted
                assert tuple(getattr(core.obs, n) for n in RATES) == ctrl.expected
        if not core.has_unfinished and not pending:
            break
        core.step()
        if late[step % len(late)]:  # read after the step's completions counted
            assert tuple(getattr(core.obs, n) for n in RATES) == ctrl.expected
    ended = core.metrics.ended_by_state
    assert ended[RequestState.FINISHED] == sum(p < 300 for _, p, _ in arrivals)
    assert ended[RequestState.REJECTED] == sum(p == 300 for _, p, _ in arrivals)
    assert tuple(getattr(core.obs, n) for n in RATES) == ctrl.expected


def test_copy_and_write_settle_the_rates():
    """A copy carries the rates as of the observation, and a written rate stays written."""
    ctrl = Reference([False])
    core = make_engine(ctrl, capacity=128)
    ctrl.core = core
    for i in range(5):
        core.add_request(req(i, 4, 3, arrival=core.clock.now()))
        core.step()
    copy = core.obs.copy()
    expected = ctrl.expected
    assert expected[0] > 0
    core.add_request(req(9, 4, 3, arrival=core.clock.now()))  # counts after the copy
    assert tuple(getattr(copy, n) for n in RATES) == expected
    core.step()
    core.obs.served_rate_rps = 7.0
    assert core.obs.served_rate_rps == 7.0 and core.obs.arrival_rate_rps == ctrl.expected[0]
    fresh = Observation()
    assert [getattr(fresh, n) for n in RATES] == [0.0] * len(RATES)


class Vandal(Controller):
    """Greedy with a small token budget that writes nonsense into every Observation it is handed."""

    def __init__(self, vandal: bool) -> None:
        super().__init__()
        self.vandal = vandal
        self.seen: list[tuple] = []

    def _read(self, obs: Observation) -> None:
        self.seen.append(tuple(getattr(obs, name) for name in Observation.FIELDS))
        if self.vandal:
            for name in Observation.FIELDS:
                setattr(obs, name, -7)

    def admit(self, obs, prompt_tokens, max_tokens):
        self._read(obs)
        return None

    def decide(self, obs):
        self._read(obs)
        return Decision(token_budget=24)


def _drive(core, arrivals, max_steps: int):
    """Feed ``arrivals`` (step, prompt tokens, output tokens) into ``core`` and step it, at most ``max_steps``
    steps; yields before each step, and returns once every request has ended."""
    pending = sorted(arrivals)
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, prompt, out = pending.pop(0)
            core.add_request(req(step * 100 + len(pending), prompt, out, arrival=core.clock.now()))
        if not pending and not core.has_unfinished:
            return
        yield
        core.step()


@given(arrivals=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.integers(1, 16)), min_size=1,
                         max_size=30))
def test_a_controller_cannot_change_the_engine_through_its_observation(arrivals):
    """Each step and each arrival hands the controller a fresh copy: one that overwrites every field
    of every copy sees the same observations and gets the same schedule as one that only reads."""
    runs = []
    for vandal in (False, True):
        ctrl = Vandal(vandal)
        core = make_engine(ctrl, capacity=96)
        for _ in _drive(core, arrivals, 600):
            pass
        ends = sorted((r.request_id, r.state.name, r.num_output_tokens, r.finish_time_s) for r in core.metrics.terminal)
        runs.append((ctrl.seen, ends, core.obs.as_dict()))
    assert runs[0] == runs[1]


def test_the_last_completion_is_the_latest_completion_or_the_start_of_the_busy_period():
    """Unknown (-1) before anything arrived; an arrival into an empty engine starts the clock; a
    completion moves it; an arrival while requests run or wait leaves it."""
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(kv_capacity_tokens=1000)
    assert stats.current.last_completion_s == -1.0
    stats.arrived(5.0, 10, idle=True)
    assert stats.current.last_completion_s == 5.0
    stats.observe(6.0, 1, 20, 0, 1, 0, 10, 0, 0)  # it runs
    stats.arrived(7.0, 10, idle=False)
    assert stats.current.last_completion_s == 5.0
    stats.completed(9.0, 10, 4, 0.5, 0.1)
    assert stats.current.last_completion_s == 9.0 and stats.snapshot().last_completion_s == 9.0
    stats.completed(9.5, 10, 1, 0.5, None)  # a one-token answer held no slot over a step: no slot freed
    assert stats.current.last_completion_s == 9.0


def test_one_token_answers_count_as_completions_not_as_slots_freed():
    """A stream of one-token answers (a health probe) between long ones: each counts in the completion rate,
    none in the rate at which running requests free their slots."""
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(kv_capacity_tokens=100_000, rate_window_s=5.0)
    for i in range(200):
        t = 0.1 * i
        stats.completed(t, 100, 1 if i % 4 else 50, 0.2, None if i % 4 else 0.05)
    stats.observe(20.0, 400, 0, 0, 0, 0, 0, 0, 0)
    obs = stats.snapshot()
    assert obs.completion_rate_rps == pytest.approx(10.0, rel=0.15)
    assert obs.slot_completion_rate_rps == pytest.approx(2.5, rel=0.25)
    assert obs.last_completion_s == pytest.approx(19.6)


def test_the_busy_period_reports_the_mix_of_its_own_arrivals():
    """Each arrival's output is expected from the completions of its prompt's size: after a spell of one-token
    answers to two-token prompts, a busy period of 256-token prompts (whose completions had 128 tokens) reports
    their sizes, not the spell's; a mixed one their means, with the standard error of its W; an idle engine starts
    the sums again."""
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(kv_capacity_tokens=100_000)
    assert stats.current.busy_kv_workload == 0.0
    stats.arrived(0.0, 256, idle=True)  # nothing completed yet: no output can be expected
    assert stats.current.busy_kv_workload == 0.0
    stats.completed(1.0, 256, 128, 0.5, 0.1)
    for i in range(100):
        stats.arrived(2.0 + i, 2, idle=True)
        stats.completed(2.1 + i, 2, 1, 0.05, None)
    assert stats.current.offered_output_tokens < 60  # the long memory reads mostly the spell
    w_long, w_probe = 256 * 128 + 128 * 129 / 2, 2 * 1 + 1
    for i in range(4):
        stats.arrived(200.0 + i, 256, idle=i == 0)
    obs = stats.current
    assert (obs.busy_prompt_tokens, obs.busy_output_tokens, obs.busy_kv_workload) == (256, 128, w_long)
    assert obs.busy_kv_workload_se == 0.0
    stats.arrived(205.0, 2, idle=False)
    obs = stats.current
    assert obs.busy_kv_workload == pytest.approx((4 * w_long + w_probe) / 5)
    assert obs.busy_kv_workload_se == pytest.approx(np.std([w_long] * 4 + [w_probe]) / 2)
    stats.arrived(300.0, 2, idle=True)
    assert stats.current.busy_output_tokens == 1 and stats.snapshot().busy_kv_workload == w_probe


def test_arrivals_of_a_size_none_completed_of_are_counted_apart_from_the_busy_periods_mix():
    """After a spell of one-token answers to two-token prompts, the first 256-token prompts have no completion of
    their size: their output is not the offered requests' mean (another size's, one token), so they are counted
    apart (their share and mean prompt, for the controller's prior) and the mix holds the arrivals of known sizes."""
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(kv_capacity_tokens=100_000)
    for i in range(100):
        stats.arrived(float(i), 2, idle=True)
        stats.completed(i + 0.1, 2, 1, 0.05, None)
    for i in range(3):
        stats.arrived(200.0 + i, 256 + 64 * i, idle=i == 0)
    obs = stats.current
    assert (obs.busy_unsized_share, obs.busy_unsized_prompt_tokens) == (1.0, 320.0)
    assert obs.busy_kv_workload == 0.0 and obs.busy_output_tokens == 0.0
    stats.arrived(203.5, 2, idle=False)  # a probe: its size is known
    obs = stats.snapshot()
    assert obs.busy_unsized_share == 0.75 and (obs.busy_output_tokens, obs.busy_kv_workload) == (1.0, 3.0)
    stats.completed(204.0, 256, 128, 0.5, 0.1)
    stats.arrived(300.0, 256, idle=True)  # a new busy period, its size known now
    obs = stats.current
    assert obs.busy_unsized_share == 0.0 and obs.busy_output_tokens == 128.0


def test_the_busy_period_counts_its_arrivals_and_their_rate_from_its_start():
    """An arrival into an empty engine starts a busy period: ``busy_arrivals`` counts from it, and ``busy_rate_rps``
    is the gaps between the period's last 64 arrivals at most over the time from the first of them to now, so an
    idle spell before it never enters. The engine tells the statistics whether it was empty: the last observation
    may still count a request that has completed since, and does not count the arrivals since."""
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(kv_capacity_tokens=1000)
    obs = stats.observe(0.0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert (obs.busy_arrivals, obs.busy_rate_rps) == (0, 0.0)
    for i in range(5):
        stats.arrived(10.0 + i, 10, idle=i == 0)  # one busy period
    obs = stats.observe(14.0, 1, 50, 5, 0, 50, 0, 10, 0)
    assert obs.busy_arrivals == 5 and obs.busy_rate_rps == pytest.approx(4 / 4.0)
    assert stats.observe(18.0, 2, 50, 5, 0, 50, 0, 10, 0).busy_rate_rps == pytest.approx(4 / 8.0)  # a silence
    stats.observe(100.0, 3, 0, 0, 0, 0, 0, 0, 0)  # all done: idle
    for i in range(100):
        stats.arrived(200.0 + 0.1 * i, 10, idle=i == 0)
    obs = stats.observe(200.0 + 9.9, 4, 50, 100, 0, 50, 0, 10, 0)
    assert obs.busy_arrivals == 100 and obs.busy_rate_rps == pytest.approx(10.0)  # the last 64: 63 gaps in 6.3 s
    assert obs.arrival_rate_rps < 6.5  # the 64-event rate still reads the idle spell
    for i in range(100, 300):
        stats.arrived(200.0 + 0.1 * i, 10, idle=False)
    obs = stats.observe(230.0, 5, 50, 100, 0, 50, 0, 10, 0)
    assert obs.busy_arrivals == 300 and obs.busy_rate_rps == 0.0  # past 256 the steady rates span it alone
    stats.arrived(300.0, 10, idle=False)  # the engine says it holds requests
    stats.arrived(301.0, 10, idle=True)  # and that it was empty
    assert stats.current.busy_arrivals == 1 and stats.current.last_completion_s == 301.0

    core = make_engine(Controller(), capacity=4096)
    core.add_request(req(0, 8, 2, arrival=core.clock.now()))
    core.add_request(req(1, 8, 2, arrival=core.clock.now()))
    assert core.observe().busy_arrivals == 2
    while core.scheduler.running or core.scheduler.waiting:
        core.step()
    core.add_request(req(2, 8, 2, arrival=core.clock.now()))  # the last observation saw one running: the engine knows
    assert core.observe().busy_arrivals == 1


def test_the_short_outputs_are_the_tenth_percentile_of_recent_outputs_longer_than_any_running_request_has():
    """``short_output_tokens`` is the 10th percentile of the last 64 completions' outputs, however old (an output's
    length is the traffic's, not a moment's), among those longer than the least output of a running request: a
    request that has decoded 5 tokens will not end at 2, so two-token answers say nothing of when it frees its slot
    while none of them runs. One-token answers are not kept: they come with their prefill and never hold a slot
    over a step. ``most_output_tokens`` is the most any running request has, in the engine a steady decode's count
    included, and the least is that of those with a token (one still prefilling says nothing of its output)."""
    from tidegate.ctrl.greedy import GreedyController
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(kv_capacity_tokens=1000)
    assert stats.outputs.short_above(0) == 0
    for i in range(100):
        stats.completed(float(i), 10, 1000 + i, 0.5, 0.1)  # the first 36 (1000-1035) leave the window
    assert stats.outputs.short_above(3) == 1036 + 6  # the 7th of 1036-1099
    assert stats.observe(1e6, 1, 20, 0, 1, 0, 10, 0, 0, 17, 1042).most_output_tokens == 17
    assert stats.snapshot().short_output_tokens == 1042 and stats.snapshot().most_output_tokens == 17
    for _ in range(32):
        stats.completed(2e6, 10, 1, 0.5, 0.1)  # one-token answers came with their prefill: not kept
    assert stats.outputs.short_above(0) == 1036 + 6
    for _ in range(32):
        stats.completed(3e6, 10, 2, 0.5, 0.1)  # half the window: two-token answers
    assert stats.outputs.short_above(1) == 2  # one of them may be running
    assert stats.outputs.short_above(2) == 1068 + 3  # none is: the 4th of 1068-1099
    assert stats.outputs.short_above(5000) == 0  # longer than all seen

    core = make_engine(GreedyController(max_num_seqs=3), capacity=4096)
    for i, out in enumerate((50, 20, 20)):
        core.add_request(req(i, 8, out, arrival=core.clock.now()))
        core.step()
    for _ in range(10):
        core.step()
    # the cap is full, so an arrival would wait for a slot: the engine reads its running requests' outputs
    assert core.scheduler.running[0].request_id == "0" and core.observe().most_output_tokens == 13  # 13 steps ago
    # and the outputs of the most advanced, most first, as the running requests hold them
    core.scheduler.steady.sync(core.scheduler.running)
    assert core.observe().leading_outputs == (13,)  # the first slot to free is the one an arrival needs
    assert core.slot_outputs(core.scheduler.steady.tick)[2] == tuple(sorted(
        (r.num_output_tokens for r in core.scheduler.running), reverse=True))
    assert core.observe().short_output_tokens == 0  # nothing has completed yet
    while len(core.scheduler.running) > 1:
        core.step()
    assert core.observe().most_output_tokens == 0  # a slot is free: not read


def test_the_relative_ttft_error_counts_only_predictions_of_a_queues_wait():
    """``ttft_rel_error_p95`` is the 95th percentile of (realised - predicted) / predicted over predictions of at least
    ``QUEUE_STEPS`` mean steps; a prediction of a step or two is about one step's noise, and its relative error
    (doubled by one step more) says nothing about how a queue's wait is mispredicted."""
    from tidegate.ctrl.base import QUEUE_STEPS
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(1000, 16, 10.0)
    stats.current.mean_step_time_s = 0.1
    stats.first_token(1.0, 0.1, 0.1)  # one step predicted, two taken: +100%, not a queue's
    assert stats.current.ttft_rel_error_p95 == 0.0 and stats.current.ttft_error_p95_s == 0.1
    for i in range(10):
        stats.first_token(1.0 + i, 0.5 * (i + 1), QUEUE_STEPS * 0.1 * (i + 1))  # a queue's wait, 1.25 x late
    assert stats.current.ttft_rel_error_p95 == 0.5 / (QUEUE_STEPS * 0.1)
    assert stats.observe(11.0, 0, 0, 0, 0, 0, 0, 0, 0).ttft_rel_error_p95 == 0.5 / (QUEUE_STEPS * 0.1)
    assert stats.observe(100.0, 0, 0, 0, 0, 0, 0, 0, 0).ttft_rel_error_p95 == 0.0  # past the rate window: forgotten


@given(arrivals=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.integers(1, 60)), min_size=1,
                         max_size=30),
       cap=st.integers(1, 8), capacity=st.sampled_from([48, 96, 1024]))
def test_the_running_outputs_read_from_the_steady_lags_are_those_counted_one_by_one(arrivals, cap, capacity):
    """Where an arrival would wait for a slot, the engine reads the most and the least output of its running
    requests from the steady decodes' lags (``SteadyDecodes.outputs``) and the others one by one: the same as
    counting every running request's output, through activations, endings and evictions (tight KV)."""
    from tidegate.ctrl.greedy import GreedyController
    from tidegate.engine.core.steady_decodes import running_outputs

    core = make_engine(GreedyController(max_num_seqs=cap), capacity=capacity)
    for _ in _drive(core, arrivals, 800):
        sched = core.scheduler
        outs = [r.num_output_tokens if r.decode_lag is None else sched.steady.tick - r.decode_lag
                for r in sched.running]
        expected = (max(outs), min(outs)) if outs else (0, 0)
        assert running_outputs(sched.steady, sched.explicit, sched.steady.tick) == expected


# ---------------------------------------------------------------------------- arrivals an engine has not seen yet
def _idle_observation() -> Observation:
    from tidegate.engine.core.stats import ObservationStats

    stats = ObservationStats(65_408, 128, 5.0)
    stats.observe(0.0, 0, 0, 0, 0, 0, 0, 0, 0)
    return stats.snapshot()


def test_the_arrivals_a_front_judged_join_the_engines_busy_period_as_its_own_stats_would_count_them():
    from tidegate.engine.core.stats import FrontArrivals, ObservationStats

    front, stats = FrontArrivals(), ObservationStats(65_408, 128, 5.0)
    for i in range(10):  # ten arrivals 10 ms apart, the first into an empty engine
        front.judged(0.01 * i)
        stats.arrived(0.01 * i, 256, idle=i == 0)
    engine = stats.observe(0.1, 1, 0, 10, 0, 2560, 0, 256, 0)
    obs = _idle_observation()  # the engine's record before it saw any of them
    obs.busy_prompt_tokens, obs.busy_kv_workload = 4.0, 10.0  # the last busy period's mix (a probe's)
    front.count(obs, 10, 0.1)
    assert obs.busy_arrivals == engine.busy_arrivals == 10
    assert obs.busy_rate_rps == pytest.approx(engine.busy_rate_rps) == pytest.approx(9 / 0.1)
    assert obs.busy_kv_workload == 0.0 and obs.busy_prompt_tokens == 0.0  # the traffic's bound judges them
    # an engine at work: they join its busy period, and the rate spans its last 64 arrivals at most
    busy = _idle_observation()
    busy.num_running, busy.busy_arrivals, busy.busy_kv_workload = 3, 40, 10.0
    for i in range(100):
        front.judged(1.0 + 0.01 * i)
    front.count(busy, 5, 2.0)
    assert busy.busy_arrivals == 45 and busy.busy_kv_workload == 10.0
    assert busy.busy_rate_rps == pytest.approx(44 / (2.0 - 1.55))
    busy.busy_arrivals = 300
    front.count(busy, 1, 2.0)  # past STEADY_RATE_EVENTS nothing reads it
    assert busy.busy_rate_rps == 0.0
    nothing = _idle_observation()
    front.count(nothing, 0, 2.0)
    assert nothing.as_dict() == _idle_observation().as_dict()


def test_a_flood_between_two_engine_steps_is_refused_past_the_slo_by_the_http_side():
    """tidegate serve's HTTP side judges arrivals on the engine's latest snapshot: forty arrivals of 1,024
    tokens that land while the engine runs one step are refused once their predicted TTFT passes the SLO (the
    busy period's witness sees them land), and those admitted are the first ones."""
    from tidegate.ctrl import build_controller
    from tidegate.ctrl.slo_flow import EARLY_ARRIVALS
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.serve import messages as m
    from tidegate.engine.serve.config import ServeConfig
    from tidegate.engine.serve.metrics import ServerMetrics
    from tidegate.engine.serve.service import EngineService

    service = EngineService(ServeConfig(), ServerMetrics("front"))
    service.mirror = build_controller("slo-flow", load_profile("tiny-vllm-cpu"))
    obs = _idle_observation()
    service._snapshot = m.Snapshot(obs=tuple(getattr(obs, name) for name in Observation.FIELDS), taken_requests=0,
                                   taken_tokens=0, admission_state=service.mirror.admission_state())
    verdicts = []
    for _ in range(40):
        rejection = service.admission(1024, 128)
        verdicts.append(rejection is None)
        if rejection is None:
            service._submitted = (service._submitted[0] + 1, service._submitted[1] + 1024)
        else:
            assert "predicted TTFT" in rejection.reason and rejection.retry_after_s > 0
            service.record_rejection(1024, 128, rejection)
    admitted = sum(verdicts)
    # nothing is refused before the witness has EARLY_ARRIVALS arrivals to judge from
    assert EARLY_ARRIVALS - 1 <= admitted < 40 and verdicts == [True] * admitted + [False] * (40 - admitted), verdicts


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 60), st.integers(0, 3)), min_size=1, max_size=60),
       st.integers(1, 24))
@example([(1, 1, 0), (1, 1, 1)], 1)  # the running request ends with its prefill: the queue alone fills the cap
def test_the_leading_outputs_are_the_most_advanced_running_requests(requests, cap):
    """Wherever an arrival would wait for a slot, ``leading_outputs`` holds the outputs of the most advanced
    running requests up to the one whose slot it needs (``LEADING_OUTPUTS`` at most), most first, whatever
    started, ended or was counted in aggregate in between: the steady decodes' from their heap of lags, stale
    entries skipped."""
    from tidegate.ctrl.base import LEADING_OUTPUTS
    from tidegate.ctrl.greedy import GreedyController

    core = make_engine(GreedyController(max_num_seqs=cap), capacity=4096)
    for i, (prompt, out, steps) in enumerate(requests):
        core.add_request(req(i, prompt, out, arrival=core.clock.now()))
        for _ in range(steps):
            core.step()
            obs = core.observe()
            sched = core.scheduler
            held = len(sched.waiting) + len(sched.running)
            if held < core._running_cap:
                assert obs.leading_outputs == ()  # a slot is free: not read
                continue
            sched.steady.sync(sched.running)
            need = min(held + 1 - core._running_cap, LEADING_OUTPUTS)
            outs = sorted((r.num_output_tokens for r in sched.running), reverse=True)[:need]
            # the cap is full; where the queue alone fills it (the last running request ended with its prefill),
            # nothing runs and there is nothing to read: the next step starts the queue's head
            assert obs.leading_outputs == tuple(outs)
