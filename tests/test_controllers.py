import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.ctrl import CONTROLLERS, ControllerSpecError, build_controller, parse_spec
from tidegate.ctrl.base import Observation, retry_after_s
from tidegate.ctrl.class_budgets import ClassBudgetsController
from tidegate.ctrl.flow import FlowController
from tidegate.ctrl.no_evict import NoEvictController
from tidegate.ctrl.sglang import SGLangController
from tidegate.ctrl.theory import capacity, class_budgets_feasible, lifetime_kv_workload, necessary_rate_bound
from tidegate.ctrl.watermark import WatermarkController
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import Arrival, load_workload
from tests.helpers import step_profile, make_engine, record_evictions, req, run_until_idle


def obs_with(**fields) -> Observation:
    o = Observation(kv_capacity_tokens=1000, block_size=16)
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def test_every_controller_has_a_docstring_naming_its_source():
    for name, cls in CONTROLLERS.items():
        doc = (cls.__module__ and __import__(cls.__module__, fromlist=["x"]).__doc__) or ""
        assert len(doc) > 40, name


def test_watermark_rejects_above_its_threshold_and_admits_below():
    w = WatermarkController(watermark=0.9, queue_limit=100)
    assert w.admit(obs_with(kv_used_tokens=500), 10, 10) is None
    assert w.admit(obs_with(kv_used_tokens=900), 10, 10) is None  # at the watermark, not above
    rej = w.admit(obs_with(kv_used_tokens=950, completion_rate_rps=2.0, num_running=3), 10, 10)
    assert rej is not None and "watermark" in rej.reason and rej.retry_after_s == pytest.approx(1.5)
    rej = w.admit(obs_with(kv_used_tokens=10, num_waiting=100, completion_rate_rps=10.0), 10, 10)
    assert rej is not None and "queue is full" in rej.reason


def test_watermark_token_budget_is_aimd_on_step_time():
    w = WatermarkController(tpot_slo_s=0.1, max_num_batched_tokens=2048, min_token_budget=256,
                            additive_tokens=64)
    d = w.decide(obs_with(last_step_tokens=100, last_step_time_s=0.5))
    assert d.token_budget == 1024
    d = w.decide(obs_with(last_step_tokens=100, last_step_time_s=0.05))
    assert d.token_budget == 1088
    for _ in range(10):
        d = w.decide(obs_with(last_step_tokens=100, last_step_time_s=1.0))
    assert d.token_budget == 256


def test_watermark_sheds_load_under_overload():
    profile = load_profile("a100-llama2-7b")
    arrivals = [Arrival(i * 0.02, 900, 300, 512) for i in range(2000)]  # far above capacity
    res = simulate(arrivals, profile, build_controller("watermark", profile))
    s = res.summary
    greedy = simulate(arrivals, profile, build_controller("greedy", profile)).summary
    assert s["rejected"] > 0 and s["completed"] + s["rejected"] == s["requests"]
    assert all(r.retry_after_s > 0 for r in res.core.metrics.terminal if r.state.value == "rejected")
    assert s["ttft_p99_s"] < greedy["ttft_p99_s"] / 5
    assert s["mean_waiting"] <= 100


workloads = st.lists(st.tuples(st.integers(1, 80), st.integers(1, 60), st.integers(0, 30)), min_size=1,
                     max_size=40)


@given(workloads, st.integers(128, 600))
def test_no_evict_never_evicts(workload, capacity):
    core = make_engine(NoEvictController(max_num_seqs=64, max_num_batched_tokens=64), capacity, 4)
    for i, (p, o, extra) in enumerate(workload):
        core.add_request(req(i, p, o, max_tokens=o + extra))
    run_until_idle(core)
    assert core.metrics.evictions == 0


def test_sglang_ratio_jumps_after_retraction_and_decays():
    s = SGLangController(init_new_token_ratio=0.7, min_new_token_ratio=0.1, decay_steps=6)
    s.decide(obs_with())
    assert s.ratio == pytest.approx(0.6)
    d = s.decide(obs_with(evicted_last_step=1))
    assert s.ratio == 1.0 and d.kv_reserve_ratio == 1.0
    for _ in range(100):
        s.decide(obs_with())
    assert s.ratio == pytest.approx(0.1)


def test_class_budgets_meet_the_memory_inequality_and_never_overflow():
    profile = load_profile("slot")
    arrivals = load_workload("paper_sec41", seed=3)
    ctrl = build_controller("class-budgets", profile, arrivals)
    w = [lifetime_kv_workload(20, 20), lifetime_kv_workload(60, 100)]
    assert class_budgets_feasible(ctrl.budgets, w, profile.kv_capacity_tokens)
    assert ctrl.budgets[0] > 0.8 and ctrl.budgets[1] > 0.1  # b_k > lambda_k: queues stable
    s = simulate(arrivals, profile, ctrl).summary
    assert s["evictions"] == 0
    assert s["kv_peak_tokens"] <= profile.kv_capacity_tokens
    assert s["completed"] == s["requests"]


def test_class_budgets_pay_out_fractional_budgets_without_bursts():
    c = ClassBudgetsController([0.25, 2.0])
    got = [c.decide(obs_with()).class_budgets for _ in range(8)]
    assert sum(g.get(0, 0) for g in got) == 2
    assert all(g.get(1) == 2 for g in got)


def test_flow_budget_distributions_have_the_right_mean():
    for dist in FlowController.DISTS:
        f = FlowController(budget=0.3, dist=dist, seed=1)
        n = sum(f.decide(obs_with()).activation_budget for _ in range(5000))
        assert n / 5000 == pytest.approx(0.3, abs=0.03), dist


def test_flow_evicts_lifo_and_progress_resets_in_the_papers_model():
    core = make_engine(FlowController(budget=100, max_num_batched_tokens=100), capacity=48, block_size=4,
                       eviction="reset")
    rs = [req(i, 8, 30) for i in range(4)]
    for r in rs:
        core.add_request(r)
    evicted = record_evictions(core)
    run_until_idle(core)
    assert evicted and all(seq == newest for _, seq, newest, _, _ in evicted)
    assert all(before > 0 for *_, before, _ in evicted)  # there was progress to discard
    assert all(after == 0 for *_, after in evicted)  # and it was discarded


def test_flow_adaptive_budget_is_capped_by_memory():
    f = FlowController(adaptive=True, target_usage=1.0)
    o = obs_with(arrival_rate_rps=1000.0, mean_step_time_s=1.0, completed_total=10,
                 lifetime_kv_workload=100.0, kv_capacity_tokens=1000)
    assert f.adaptive_budget(o) == pytest.approx(10.0)
    o.arrival_rate_rps = 1.0
    assert f.adaptive_budget(o) == pytest.approx(1.2)


def test_flow_with_huge_budget_is_greedy():
    profile = load_profile("a100-llama2-7b")
    arrivals = [Arrival(i * 0.05, 500 + 37 * (i % 11), 100 + 13 * (i % 7), 512) for i in range(400)]
    a = simulate(arrivals, profile, build_controller("greedy:max_num_seqs=100000", profile)).summary
    b = simulate(arrivals, profile, build_controller("flow:budget=1e12", profile)).summary
    for k in ("completed", "evictions", "ttft_p99_s", "steps"):
        assert a[k] == b[k], k


def test_theory_helpers():
    assert lifetime_kv_workload(10, 4) == 10 * 4 + (4 + 16) / 2
    assert necessary_rate_bound(100.0, 1000) == 10.0
    slot = load_profile("slot")
    cap = capacity([20, 20], [20, 20], slot)
    assert cap.lambda_max_rps == pytest.approx(slot.kv_capacity_tokens / lifetime_kv_workload(20, 20))
    p = step_profile(base_s=0.01, per_token_s=1e-4, per_kv_token_s=1e-6, kv_capacity_tokens=1000)
    cap = capacity([100], [10], p)
    w = 100 * 10 + 55
    assert cap.lambda_max_rps == pytest.approx(1 / (0.01 * w / 1000 + 1e-6 * w + 1e-4 * 110))


def test_retry_after_uses_the_drain_rate():
    assert retry_after_s(obs_with(num_waiting=9, completion_rate_rps=2.0)) == pytest.approx(5.0)
    assert retry_after_s(obs_with(num_waiting=9, completion_rate_rps=0.0)) >= 1.0


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown controller 'nope'; choose one of"),
    ("flow:bogus=1", "has no option 'bogus'"),
    ("flow:budget=abc", "budget='abc' is not valid: expected float"),
    ("flow:dist=zipf", "dist must be one of fixed, poisson, bernoulli"),
    ("flow:budget", "needs the form key=value"),
    ("watermark:watermark=2", "watermark must be in (0, 1]"),
    ("class-budgets", "needs budgets="),
])
def test_bad_specs_get_one_clear_sentence(spec, message):
    with pytest.raises(ControllerSpecError) as err:
        build_controller(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_parse_spec_and_profile_defaults():
    assert parse_spec("flow:budget=2, dist=poisson") == ("flow", {"budget": "2", "dist": "poisson"})
    profile = load_profile("a100-llama2-7b")
    g = build_controller("greedy", profile)
    assert g.decide(Observation()).token_budget == profile.max_num_batched_tokens
    assert build_controller("greedy:max_num_batched_tokens=77", profile).decide(Observation()).token_budget == 77
    assert build_controller("flow:adaptive=yes").adaptive is True


def test_learned_features_follow_the_served_traffic_and_are_sound_on_a_cold_or_idle_server():
    from tidegate.ctrl.learned import make_learned_controller
    from tidegate.ctrl.theory import lambda_max_estimate

    profile = load_profile("tiny-cpu")
    small = obs_with(kv_capacity_tokens=profile.kv_capacity_tokens, completed_total=50, mean_prompt_tokens=33.0,
                     mean_output_tokens=32.0, lifetime_kv_workload=33 * 32 + (32 + 32 * 32) / 2)
    big = obs_with(kv_capacity_tokens=profile.kv_capacity_tokens, completed_total=50, mean_prompt_tokens=1000.0,
                   mean_output_tokens=200.0, lifetime_kv_workload=1000 * 200 + (200 + 200 * 200) / 2)
    assert lambda_max_estimate(small, profile) == pytest.approx(
        capacity([33], [32], profile).lambda_max_rps, rel=1e-6)
    assert lambda_max_estimate(small, profile) > 20 * lambda_max_estimate(big, profile)
    ctrl = make_learned_controller(profile=profile)
    ctrl.decide(small)
    assert ctrl.inner.features.lambda_max_rps == pytest.approx(lambda_max_estimate(small, profile))
    # a cold, idle server (nothing seen, nothing waiting): a finite bound of budget-sized requests
    idle = obs_with(kv_capacity_tokens=profile.kv_capacity_tokens)
    lam = lambda_max_estimate(idle, profile)
    assert math.isfinite(lam) and lam > 0
    assert lam == pytest.approx(capacity([profile.max_num_batched_tokens], [128], profile).lambda_max_rps)
    x = make_learned_controller(profile=profile).inner.features.update(idle)
    assert np.all(np.isfinite(x)) and np.all(np.abs(x) <= 10)
