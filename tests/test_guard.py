"""The runtime twin guard: a policy that loses to its heuristic in the twin's replays of live
windows hands control to the heuristic; action 0 never does; small windows are not judged; only
the windows not judged yet are kept; the server exports the guard's state."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tidegate.ctrl import build_controller
from tidegate.ctrl.learned import LearnedController, ObservationFeatures, make_prior
from tidegate.ctrl.shield import ShieldedController
from tidegate.ctrl.slo_flow import SloFlowController
from tidegate.engine.core.driver import replay
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.serve.engine_proc import EngineLoop
from tidegate.engine.serve.launch import ServeConfig
from tidegate.engine.serve.messages import Tick
from tidegate.engine.serve.metrics import ServerMetrics
from tidegate.engine.serve.service import EngineService, _Engine
from tidegate.engine.sim.simulate import make_request, make_sim_engine, simulate
from tidegate.engine.twin.guard import GuardWindow, TwinGuard
from tidegate.engine.workloads.families import load_family
from tidegate.training.evaluate import cell_arrivals

PROFILE = load_profile("a100-llama2-7b")
WINDOW_S = 30.0


class Policy:
    """A policy that always answers ``action`` (which a test may change)."""

    def __init__(self, action) -> None:
        self.action = np.asarray(action, dtype=np.float32)

    def __call__(self, obs):
        return self.action


BAD = (-1.0, -1.0, 1.0)  # half the activation rate and token budget, twice the admission threshold (LooseAdmission)
HEURISTIC = (0.0, 0.0, 0.0)


class LooseAdmission(SloFlowController):
    """The prior, whose admission threshold a policy's residual doubles: ``action_to_residual`` only tightens
    admission, and in overload no action it allows loses to the heuristic by much (halving every knob wins there),
    so the losing policy the guard must catch gets round it here."""

    def set_residual(self, activation_scale: float = 1.0, token_scale: float = 1.0, reject_scale: float = 1.0) -> None:
        acted = (activation_scale, token_scale, reject_scale) != (1.0, 1.0, 1.0)
        super().set_residual(activation_scale, token_scale, 2.0 if acted else reject_scale)


def learned(action) -> ShieldedController:
    """The shielded learned controller of ``make_learned_controller`` around a constant policy (with BAD, over
    LooseAdmission)."""
    prior = make_prior(PROFILE)
    if action == BAD:
        prior.__class__ = LooseAdmission  # make_prior's settings, the doubled threshold
    inner = LearnedController(Policy(action), ObservationFeatures(PROFILE), prior)
    return ShieldedController(inner, mode="soft", max_num_seqs=PROFILE.max_num_seqs,
                              max_num_batched_tokens=PROFILE.max_num_batched_tokens)


def run_guarded(arrivals, live: ShieldedController, guard: TwinGuard, on_check=None) -> dict:
    """Simulate ``arrivals`` with ``live``, feeding ``guard`` and checking it every step."""
    live.reset()
    core = make_sim_engine(PROFILE, live, record_steps=False)
    core.on_finish = guard.on_finish

    def on_step(_added: int) -> None:
        check = guard.maybe_check(core.clock.now())
        if check is not None and on_check is not None:
            on_check(check)

    replay(core, [a.arrival_time_s for a in arrivals], lambda i: make_request(i, arrivals[i]), on_step)
    return core.metrics.summary(core.pool.capacity_tokens, PROFILE.ttft_slo_s, PROFILE.tpot_slo_s)


@pytest.fixture(scope="module")
def arrivals():
    """2000 chat requests at 2 x the fluid bound (about 200 s): overloaded from the first window on."""
    return cell_arrivals(load_family("chat"), 2.0, 0, 2000, PROFILE)[0]


@pytest.fixture(scope="module")
def alone(arrivals) -> dict[str, float]:
    """Goodput of the bad policy and of the heuristic, each alone, over the whole workload."""
    return {name: simulate(arrivals, PROFILE, learned(action), record_steps=False).summary["goodput_rps"]
            for name, action in (("bad", BAD), ("heuristic", HEURISTIC))}


def ended(i: int, arrival_s: float, state=RequestState.FINISHED, output: int = 50, prompt: int = 200,
          max_tokens: int = 256) -> Request:
    r = Request(str(i), arrival_s, prompt, max_tokens)
    r.state = state
    r.num_output_tokens = output
    return r


def test_the_guard_hands_a_losing_policy_to_the_heuristic(arrivals, alone):
    assert alone["bad"] < 0.9 * alone["heuristic"]  # the bad policy really loses in the twin
    live = learned(BAD)
    guard = TwinGuard(PROFILE, live, window_s=WINDOW_S)
    checks = []
    summary = run_guarded(arrivals, live, guard, checks.append)
    first = checks[0]
    assert first.window_index == 0 and first.requests >= guard.min_requests
    assert first.learned_goodput_rps < (1 - guard.tolerance) * first.heuristic_goodput_rps
    assert guard.switches >= 1 and live.inner.guard_switches == guard.switches
    assert guard.status()["checks"] == len(checks) >= 5
    guarded = summary["goodput_rps"]
    assert abs(guarded - alone["heuristic"]) < abs(guarded - alone["bad"])


def test_action_zero_is_never_guarded(arrivals, alone):
    live = learned(HEURISTIC)
    guard = TwinGuard(PROFILE, live, window_s=WINDOW_S)
    checks = []
    summary = run_guarded(arrivals, live, guard, checks.append)
    assert len(checks) >= 5
    assert all(c.learned_goodput_rps == c.heuristic_goodput_rps for c in checks)
    assert guard.switches == 0 and not guard.guarded and live.inner.guard_switches == 0
    assert summary["goodput_rps"] == pytest.approx(alone["heuristic"])


def test_control_returns_to_the_policy_after_the_hold_once_it_stops_losing(arrivals):
    live = learned(BAD)
    guard = TwinGuard(PROFILE, live, window_s=WINDOW_S, hold_windows=2)
    states = []

    def on_check(check) -> None:
        states.append((check.window_index, guard.guarded))
        live.inner.policy.action[:] = 0.0  # the replays share the live policy: from now on it is the heuristic

    run_guarded(arrivals, live, guard, on_check)
    assert states[:2] == [(0, True), (2, False)]  # window 1 is held
    assert guard.held_windows == 1 and guard.switches == 1 and guard.releases == 1


def test_windows_with_too_few_requests_are_not_judged():
    live = learned(BAD)
    guard = TwinGuard(PROFILE, live, window_s=10.0, settle_s=5.0, min_requests=40)
    for i in range(39):
        guard.on_finish(ended(i, 0.2 * i))
    assert guard.maybe_check(14.9) is None and guard.windows_held == 1  # not settled yet
    assert guard.maybe_check(15.0) is None
    assert guard.skipped_windows == 1 and guard.checks == 0 and guard.windows_held == 0
    for i in range(40):
        guard.on_finish(ended(i, 10.0 + 0.2 * i))
    check = guard.maybe_check(25.0)
    assert check is not None and check.requests == 40 and guard.checks == 1


def test_memory_holds_only_the_windows_not_judged_yet():
    guard = TwinGuard(PROFILE, learned(BAD), window_s=10.0, min_requests=10_000)
    most = 0
    for i in range(2000):  # 1000 s of arrivals, each request ends 5 s after it arrived
        arrival = 0.5 * i
        guard.on_finish(ended(i, arrival))
        guard.maybe_check(arrival + 5.0)
        most = max(most, guard.windows_held)
    assert most <= 3  # 2 + settle_s / window_s
    assert guard.skipped_windows >= 95 and guard.checks == 0
    guard.on_finish(ended(-1, 100.0))  # its window was dropped long ago
    assert guard.late_requests == 1 and guard.windows_held <= 3


def test_requests_that_did_not_finish_are_replayed_with_the_mean_output():
    window = GuardWindow(3, 30.0)
    for i, out in enumerate((10, 20, 30)):
        window.add(ended(i, 31.0 + i, output=out))
    window.add(ended(3, 30.5, RequestState.REJECTED, output=0, max_tokens=15))
    window.add(ended(4, 35.0, RequestState.EXPIRED, output=0, max_tokens=100))
    window.add(ended(5, 36.0, RequestState.CANCELLED, output=25, max_tokens=100))
    arrivals = window.arrivals(prior_output_tokens=128)
    assert [a.arrival_time_s for a in arrivals] == pytest.approx([0.5, 1.0, 2.0, 3.0, 5.0, 6.0])
    assert [a.output_tokens for a in arrivals] == [15, 10, 20, 30, 20, 25]
    assert [a.output_tokens for a in GuardWindow(0, 0.0).arrivals(128)] == []
    nothing_finished = GuardWindow(0, 0.0)
    nothing_finished.add(ended(0, 1.0, RequestState.REJECTED, output=0))
    assert nothing_finished.arrivals(prior_output_tokens=128)[0].output_tokens == 128


def test_a_background_check_applies_at_the_next_call(arrivals):
    live = learned(BAD)
    guard = TwinGuard(PROFILE, live, window_s=WINDOW_S)
    run = simulate([a for a in arrivals if a.arrival_time_s < WINDOW_S], PROFILE, learned(BAD), record_steps=False)
    for r in run.core.metrics.terminal:
        guard.on_finish(r)
    assert guard.maybe_check(2 * WINDOW_S, background=True) is None
    guard.wait(30)
    assert not guard.guarded  # applied on the caller's thread, at its next call
    check = guard.maybe_check(2 * WINDOW_S + 1)
    assert check is not None and guard.guarded and guard.switches == 1


def test_the_guard_needs_the_learned_controller():
    with pytest.raises(TypeError, match="shielded learned controller"):
        TwinGuard(PROFILE, build_controller("slo-flow", PROFILE))
    with pytest.raises(ValueError, match="window_s"):
        TwinGuard(PROFILE, learned(BAD), window_s=0)


class FakeLLM:
    """What the engine loop reads of an LLM, on the simulator."""

    def __init__(self, controller) -> None:
        self.profile = PROFILE
        self.core = make_sim_engine(PROFILE, controller, record_steps=False)
        self.max_model_len = None
        self.executor = SimpleNamespace(vocab_size=259)


def metric(metrics: ServerMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(f"tidegate:{name}", {"model_name": "m"})


def test_the_engine_guards_the_learned_controller_and_the_server_exports_its_state(arrivals):
    from multiprocessing import Pipe

    here, there = Pipe()
    config = ServeConfig()
    assert EngineLoop(config, there, llm=FakeLLM(build_controller("greedy", PROFILE))).guard is None
    assert isinstance(EngineLoop(config, there, llm=FakeLLM(learned(BAD))).guard, TwinGuard)

    live = learned(BAD)
    llm = FakeLLM(live)
    loop = EngineLoop(config, there, llm=llm, guard=TwinGuard(PROFILE, live, window_s=WINDOW_S))
    run = simulate([a for a in arrivals if a.arrival_time_s < WINDOW_S], PROFILE, learned(BAD), record_steps=False)
    for r in run.core.metrics.terminal:
        loop.core.on_finish(r)  # the engine's hook feeds the guard
    assert loop.guard.windows_held == 1
    llm.core.clock.advance_to(2 * WINDOW_S)
    loop._tick_guard()  # starts the replays in the guard's thread
    loop.guard.wait(30)
    loop._tick_guard()  # applies the result on the engine's thread
    assert loop.guard.guarded
    loop._send_tick()
    tick = here.recv()
    assert isinstance(tick, Tick) and tick.snapshot.guarded and tick.snapshot.guard_switches == 1

    metrics = ServerMetrics("m")
    assert metric(metrics, "controller_guard_switches_total") == 0
    assert metric(metrics, "controller_guarded") == 0
    EngineService(config, metrics)._export(_Engine(None), tick.snapshot)
    assert metric(metrics, "controller_guard_switches_total") == 1
    assert metric(metrics, "controller_guarded") == 1


def test_simulate_guarded_is_the_plain_run_when_the_policy_never_loses_and_rescues_a_bad_one(arrivals):
    from tidegate.engine.twin.guard import simulate_guarded

    plain = simulate(arrivals, PROFILE, learned(HEURISTIC), record_steps=False).summary
    guarded, guard = simulate_guarded(arrivals, PROFILE, learned(HEURISTIC))
    assert guard.switches == 0 and guard.checks > 0
    assert {k: v for k, v in guarded.items() if k != "wall_time_s"} == \
        {k: v for k, v in plain.items() if k != "wall_time_s"}
    bad = simulate(arrivals, PROFILE, learned(BAD), record_steps=False).summary  # refuses too late: the queue runs away
    rescued, guard = simulate_guarded(arrivals, PROFILE, learned(BAD))
    assert guard.switches >= 1 and rescued["goodput_rps"] > bad["goodput_rps"]
