"""The learned controller on its prior: action 0 is slo-flow, admission is calibrated, Retry-After
is bounded, and a simulation never depends on the machine's speed."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctrl import build_controller
from ctrl.base import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Observation, Rejection, retry_after_s
from ctrl.learned import ACTION_DIM, DEFAULT_POLICY, OBS_DIM, action_to_residual, make_learned_controller
from ctrl.shield import ShieldedController
from ctrl.slo_flow import SloFlowController, predicted_ttft_s
from engine.core.profile import load_profile
from engine.sim.simulate import simulate
from engine.workloads.families import load_family
from training.evaluate import cell_arrivals

PROFILE = load_profile("a100-llama2-7b")


class Const:
    """A policy that always answers the same action (optionally slowly)."""

    def __init__(self, action, delay_s: float = 0.0) -> None:
        self.action = np.asarray(action, dtype=np.float32)
        self.delay_s = delay_s

    def __call__(self, obs):
        assert obs.shape == (OBS_DIM,) and np.all(np.isfinite(obs))
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.action


def learned_with(policy, **kw) -> ShieldedController:
    c = make_learned_controller("/nonexistent/policy.onnx", profile=PROFILE, **kw)
    c.inner.policy = policy
    c.reset()
    return c


def shielded_prior() -> ShieldedController:
    from ctrl.learned import make_prior

    return ShieldedController(make_prior(PROFILE), mode="soft", max_num_seqs=PROFILE.max_num_seqs,
                              max_num_batched_tokens=PROFILE.max_num_batched_tokens)


def arrivals(family: str, load: float, n: int = 600, seed: int = 0):
    return cell_arrivals(load_family(family), load, seed, n, PROFILE)[0]


def summary(controller, arr) -> dict:
    return simulate(arr, PROFILE, controller, record_steps=False).summary


def without_wall_time(s: dict) -> dict:
    return {k: v for k, v in s.items() if k != "wall_time_s"}


@pytest.mark.parametrize("family, load", [("chat", 0.8), ("multi-class", 2.5), ("bursty", 1.5)])
def test_action_zero_is_exactly_the_slo_flow_heuristic(family, load):
    arr = arrivals(family, load)
    assert without_wall_time(summary(learned_with(Const([0.0, 0.0, 0.0])), arr)) == \
        without_wall_time(summary(shielded_prior(), arr))
    # and so is a policy that cannot answer (the fallback is the same heuristic)
    broken = make_learned_controller("/nonexistent/policy.onnx", profile=PROFILE)
    assert broken.inner.policy is None
    assert without_wall_time(summary(broken, arr)) == without_wall_time(summary(shielded_prior(), arr))


def test_residuals_scale_the_heuristic_knobs():
    assert action_to_residual((0.0, 0.0, 0.0)) == (1.0, 1.0, 1.0)
    lo, hi = action_to_residual((-1, -1, -1)), action_to_residual((1, 1, 1))
    assert all(x == pytest.approx(0.25) for x in lo) and all(x == pytest.approx(4.0) for x in hi)
    assert action_to_residual((float("nan"), 5.0, "x")) == (1.0, 4.0, 1.0)
    obs = Observation(kv_capacity_tokens=100_000)
    obs.num_waiting, obs.num_running, obs.mean_step_time_s, obs.completion_rate_rps = 3, 50, 0.05, 5.0
    obs.waiting_prompt_tokens, obs.head_prompt_tokens, obs.arrival_rate_rps = 6000, 2000, 10.0  # 2x overload
    obs.now_s, obs.completed_total = 100.0, 100  # ... with requests waiting since the start
    strict = learned_with(Const([0.0, 0.0, -1.0]))
    strict.decide(obs)
    loose = learned_with(Const([0.0, 0.0, 1.0]))
    loose.decide(obs)
    assert strict.inner.prior.reject_delay_s(obs) == pytest.approx(loose.inner.prior.reject_delay_s(obs) / 16)
    assert isinstance(strict.admit(obs, 2000, 100), Rejection)
    assert loose.admit(obs, 2000, 100) is None
    obs.arrival_rate_rps = 5.0  # arrivals no faster than completions: nothing is refused
    assert strict.admit(obs, 2000, 100) is None


@settings(max_examples=300, deadline=None)
@given(waiting=st.integers(0, 10_000), running=st.integers(0, 1024), step=st.floats(0, 10),
       done=st.floats(0, 1e4), arriving=st.floats(0, 1e4), prompt=st.integers(1, 100_000),
       queued=st.integers(0, 10**8), used=st.integers(0, 200_000), residual=st.floats(-1, 1))
def test_never_refused_with_an_empty_queue_and_retry_after_within_bounds(waiting, running, step, done, arriving,
                                                                        prompt, queued, used, residual):
    obs = Observation(kv_capacity_tokens=200_000)
    obs.num_waiting, obs.num_running, obs.mean_step_time_s = waiting, running, step
    obs.completion_rate_rps, obs.arrival_rate_rps, obs.waiting_prompt_tokens = done, arriving, queued
    obs.kv_used_tokens, obs.mean_output_tokens, obs.now_s = used, 300.0, 1e3
    c = learned_with(Const([0.0, 0.0, residual]))
    c.decide(obs)
    got = c.admit(obs, prompt, 256)
    if waiting == 0:
        assert got is None
    if got is not None:
        assert RETRY_AFTER_MIN_S <= got.retry_after_s <= RETRY_AFTER_MAX_S
    assert RETRY_AFTER_MIN_S <= retry_after_s(obs) <= RETRY_AFTER_MAX_S
    assert predicted_ttft_s(obs, prompt, 2048) >= 0


def test_shield_bounds_a_retry_after_that_is_not_a_number_in_range():
    class Odd(SloFlowController):
        def admit(self, obs, prompt_tokens, max_tokens):
            return Rejection("odd", float("nan"))

    obs = Observation(kv_capacity_tokens=1000)
    obs.num_waiting, obs.completion_rate_rps = 5, 2.0
    got = ShieldedController(Odd()).admit(obs, 10, 10)
    assert got.retry_after_s == pytest.approx(3.0) and got.reason == "odd"


def test_prediction_counts_the_running_requests_prefill_and_decodes():
    obs = Observation(kv_capacity_tokens=100_000)
    obs.mean_step_time_s, obs.num_waiting = 0.1, 1
    base = predicted_ttft_s(obs, 1000, 1000)
    obs.running_prefill_tokens = 4000
    assert predicted_ttft_s(obs, 1000, 1000) > base
    obs.running_prefill_tokens, obs.num_running = 0, 500
    assert predicted_ttft_s(obs, 1000, 1000) > base  # decodes take half the budget


def test_simulations_are_pure_functions_of_their_inputs_whatever_the_policy_speed():
    arr = arrivals("chat", 1.5, 400)
    fast = without_wall_time(summary(learned_with(Const([0.3, -0.2, -0.5])), arr))
    slow = learned_with(Const([0.3, -0.2, -0.5], delay_s=0.002))  # twice the wall-clock budget
    assert without_wall_time(summary(slow, arr)) == fast
    assert slow.inner.fallback_total == 0
    # on a wall clock (a real engine, the server) the budget applies
    slow.reset()
    slow.use_wall_clock()
    slow.decide(Observation(kv_capacity_tokens=1000))
    assert slow.inner.fallbacks and "slower than" in next(iter(slow.inner.fallbacks))


def test_simulate_command_output_is_identical_on_an_idle_and_a_busy_machine():
    import json
    import multiprocessing

    from click.testing import CliRunner

    from engine.cli import main

    args = ["simulate", "--trace", "splitwise_conv", "--first", "300", "--load", "1.5", "--controller", "learned",
            "--json", "--no-progress"]
    idle = json.loads(CliRunner().invoke(main, args).stdout)
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_spin, args=(3.0,)) for _ in range(3)]
    for h in hogs:
        h.start()
    try:
        busy = json.loads(CliRunner().invoke(main, args).stdout)
    finally:
        for h in hogs:
            h.join()
    assert without_wall_time(idle) == without_wall_time(busy)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def test_engine_records_its_ttft_prediction_and_reports_calibration():
    s = summary(shielded_prior(), arrivals("chat", 1.2))
    assert math.isfinite(s["ttft_pred_mae_s"]) and 0 <= s["ttft_pred_wrong_side"] <= 1


@pytest.mark.parametrize("family, loads", [("chat", (0.3, 0.7)), ("short", (0.3, 0.7)), ("long-context", (0.3,)),
                                           ("multi-class", (0.3,))])
def test_poisson_traffic_at_light_load_is_almost_never_refused(family, loads):
    for load in loads:
        arr = arrivals(family, load, 800, seed=3)
        assert summary(build_controller("slo-flow", PROFILE), arr)["rejected"] == 0, (family, load)
        # the policy may tighten the threshold, never the overload test: at most the noise of the rates
        assert summary(build_controller("learned", PROFILE), arr)["rejected"] <= 2, (family, load)


def test_shipped_policy_loads_with_the_current_features():
    c = make_learned_controller(profile=PROFILE)
    assert c.inner.policy is not None, c.inner.policy_status
    assert np.asarray(c.inner.policy(np.zeros(OBS_DIM, dtype=np.float32))).shape == (ACTION_DIM,)
    assert DEFAULT_POLICY.is_file()


@settings(max_examples=200, deadline=None)
@given(waiting=st.integers(1, 10_000), done=st.floats(0.01, 1e3), ratio=st.floats(0, 1.2),
       queued=st.integers(0, 10**8))
def test_without_overload_nothing_is_refused_however_long_the_queue(waiting, done, ratio, queued):
    obs = Observation(kv_capacity_tokens=100_000)
    obs.num_waiting, obs.num_running, obs.mean_step_time_s, obs.waiting_prompt_tokens = waiting, 10, 0.05, queued
    obs.completion_rate_rps, obs.arrival_rate_rps = done, done * ratio
    assert build_controller("slo-flow", PROFILE).admit(obs, 1000, 100) is None


def test_rates_over_few_events_span_enough_of_them():
    from engine.core.engine_core import RateEstimator

    slow = RateEstimator(10.0, min_events=8)
    for t in range(0, 80, 10):  # one event every 10 s: a 10 s window would hold one
        slow.add(float(t))
    assert slow.rate(70.0) == pytest.approx(8 / 70.0)
    fast = RateEstimator(10.0, min_events=8)
    for i in range(1200):  # 20 per second: the window holds plenty, the EWMA applies
        fast.add(i / 20)
    assert fast.rate(60.0) == pytest.approx(20.0, rel=0.05)
    assert RateEstimator(10.0).rate(5.0) == 0.0
