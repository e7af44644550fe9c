"""Each meaning has one definition: these tests pin it, and check that its users call it."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.ctrl.theory import capacity, fluid_lambda_max
from tidegate.engine.core.builder import build_engine, rate_window_s
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.clock import VirtualClock
from tidegate.engine.core.driver import replay
from tidegate.engine.core.request import Request, RequestState, unservable_reason
from tidegate.engine.core.slo import met_slo, time_per_output_token_s, time_to_first_token_s
from tidegate.engine.sim.executor import SimExecutor
from tidegate.engine.sim.simulate import make_request, simulate
from tests.helpers import req, step_profile


def finished(arrival: float, first: float, finish: float, outputs: int) -> Request:
    r = Request("r", arrival, 4, outputs)
    r.state = RequestState.FINISHED
    r.first_token_time_s, r.finish_time_s, r.num_output_tokens = first, finish, outputs
    return r


def test_ttft_tpot_and_the_slo():
    r = finished(arrival=1.0, first=3.0, finish=7.0, outputs=5)
    assert time_to_first_token_s(r) == 2.0
    assert time_per_output_token_s(r) == 1.0
    assert met_slo(r, ttft_slo_s=2.0, tpot_slo_s=1.0)
    assert not met_slo(r, ttft_slo_s=1.99, tpot_slo_s=1.0)
    assert not met_slo(r, ttft_slo_s=2.0, tpot_slo_s=0.99)
    single = finished(arrival=0.0, first=1.0, finish=1.0, outputs=1)
    assert time_per_output_token_s(single) is None  # no TPOT with one token...
    assert met_slo(single, ttft_slo_s=1.0, tpot_slo_s=0.0)  # ...so only TTFT counts
    waiting = Request("w", 0.0, 4, 4)
    assert math.isnan(time_to_first_token_s(waiting)) and not met_slo(waiting, 1e9, 1e9)


@given(st.lists(st.tuples(st.floats(0, 50), st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=25),
       st.floats(0.5, 40), st.floats(0.05, 3))
def test_goodput_counts_exactly_the_requests_that_met_the_slo(workload, ttft_slo, tpot_slo):
    profile = step_profile(kv_capacity_tokens=512, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo)
    arrivals = sorted(workload)
    core = build_engine(profile, build_controller("greedy", profile), SimExecutor(profile), VirtualClock())
    replay(core, [a for a, _, _ in arrivals], lambda i: req(i, arrivals[i][1], arrivals[i][2], arrival=arrivals[i][0]))
    summary = core.metrics.summary(512, ttft_slo, tpot_slo)
    good = sum(met_slo(r, ttft_slo, tpot_slo) for r in core.metrics.terminal)
    assert summary["goodput_rps"] * summary["sim_time_s"] == pytest.approx(good)


def test_env_reward_and_metrics_goodput_share_the_slo_function():
    import tidegate.env.serving_env as serving_env
    import tidegate.engine.core.metrics as metrics

    assert serving_env.met_slo is met_slo and metrics.met_slo is met_slo


def test_unservable_reason_is_what_the_engine_rejects_with():
    assert unservable_reason(0, 5, 100) == "the prompt is empty; a request needs at least one prompt token."
    assert "max_tokens must be at least 1" in unservable_reason(5, 0, 100)
    assert "exceeds the KV capacity of 100 tokens" in unservable_reason(60, 41, 100)
    assert unservable_reason(60, 40, 100) is None
    assert "model context of 50 tokens" in unservable_reason(30, 21, 100, max_model_len=50)
    assert "more than the model context" in unservable_reason(51, 1, 100, max_model_len=50)
    profile = step_profile(kv_capacity_tokens=100)
    core = build_engine(profile, build_controller("greedy", profile), SimExecutor(profile), VirtualClock())
    rejection = core.add_request(req(0, 60, 41))
    assert rejection is not None and rejection.reason == unservable_reason(60, 41, 100)


def test_build_engine_takes_kv_size_block_size_and_rate_window_from_the_profile():
    profile = step_profile(kv_capacity_tokens=96, block_size=8, base_s=0.2)
    core = build_engine(profile, build_controller("greedy", profile), SimExecutor(profile), VirtualClock())
    assert core.pool.capacity_tokens == 96 and core.pool.block_size == 8
    assert rate_window_s(profile) == 200 * 0.2 == core.stats.arrivals.window_s
    assert rate_window_s(step_profile(base_s=0.001)) == 10.0


def test_step_time_has_one_formula():
    profile = step_profile(base_s=0.5, per_token_s=0.25, per_kv_token_s=0.125, idle_s=0.75)
    executor = SimExecutor(profile)
    from tidegate.engine.core.executor import Batch

    batch = Batch()
    assert executor.execute(batch).duration_s == profile.step_time_s(0, 0) == 0.75
    batch.num_tokens, batch.kv_tokens_read = 4, 8
    assert executor.execute(batch).duration_s == profile.step_time_s(4, 8) == 0.5 + 1.0 + 1.0


def test_fluid_bound_is_one_formula():
    profile = step_profile(base_s=0.01, per_token_s=1e-4, per_kv_token_s=1e-6, kv_capacity_tokens=4096)
    cap = capacity([100, 300], [20, 60], profile)
    assert cap.lambda_max_rps == fluid_lambda_max(cap.mean_tokens_per_request, cap.lifetime_kv_workload, profile)
    s, w = cap.mean_tokens_per_request, cap.lifetime_kv_workload
    assert cap.lambda_max_rps == pytest.approx(1 / (0.01 * w / 4096 + 1e-6 * w + 1e-4 * s))


def test_the_fluid_bound_counts_the_running_slots():
    """Memory for thousands of requests, 8 slots: the replica serves what its slots allow, and the
    bound with the slots says so where the memory's alone runs far above it."""
    from tidegate.engine.workloads import Arrival

    profile = step_profile(base_s=0.01, per_token_s=1e-5, per_kv_token_s=1e-8, kv_capacity_tokens=1 << 20,
                           max_num_seqs=8, max_num_batched_tokens=512, block_size=16)
    prompt, output = 64, 32
    s, w = float(prompt + output), prompt * output + output * (output + 1) / 2
    slots = fluid_lambda_max(s, w, profile, None, output, 8)
    memory = fluid_lambda_max(s, w, profile, None, output)
    assert slots == pytest.approx(1 / (0.01 * output / 8 + 1e-8 * w + 1e-5 * s))
    assert memory > 5 * slots
    assert fluid_lambda_max(s, w, profile, None, output, 1 << 20) == memory  # slots that never bind change nothing
    arrivals = [Arrival(i / (3 * slots), prompt, output, output, 0) for i in range(600)]  # 3x the slots' bound
    result = simulate(arrivals, profile, build_controller("greedy", profile)).summary
    served = result["completed"] / result["sim_time_s"]
    assert 0.8 * slots < served <= 1.02 * slots
    # slo-flow's capacity witness judges against the slots' bound: twice it is no light load
    from tidegate.ctrl.base import Observation

    obs = Observation()
    for key, value in (("completed_total", 300), ("offered_prompt_tokens", float(prompt)),
                       ("offered_output_tokens", float(output)), ("offered_kv_workload", w),
                       ("offered_rate_rps", 2 * slots), ("served_rate_rps", 2 * slots), ("num_running", 8)):
        setattr(obs, key, value)
    assert not build_controller("slo-flow", profile).under_capacity(obs)
    assert build_controller("slo-flow", dataclasses.replace(profile, max_num_seqs=1 << 20)).under_capacity(obs)


#: a replica where a decode costs about what a prompt token does (vLLM's CPU build, fitted on its steps)
CPU_LIKE = dict(base_s=0.0117, per_token_s=7.3e-4, per_decode_token_s=8.6e-4, per_kv_token_s=1.85e-6,
                per_prefill_s=8.4e-4, kv_capacity_tokens=65408, block_size=16, max_num_seqs=128,
                max_num_batched_tokens=2048, ttft_slo_s=2.0, tpot_slo_s=0.2)


def _offered(prompt: int, output: int, completed: int = 300):
    from tidegate.ctrl.base import Observation

    obs = Observation(65408, 16)
    w = prompt * output + output * (output + 1) / 2
    for key, value in (("completed_total", completed), ("offered_prompt_tokens", float(prompt)),
                       ("offered_output_tokens", float(output)), ("offered_kv_workload", w)):
        setattr(obs, key, value)
    return obs


@pytest.mark.parametrize("prompt, output, slo", [(256, 128, 0.2), (256, 128, 0.1), (2000, 100, 0.2),
                                                  (50, 1000, 0.05)])
def test_the_tpot_cap_is_the_most_running_requests_whose_mean_step_meets_the_slo(prompt, output, slo):
    """T(n) = f a + (R n + z sqrt(n) R_p) / D, with R the fluid bound's time per request without its
    base cost and R_p a prompt's prefill: the cap is the largest n with T(n) <= the TPOT SLO."""
    from tidegate.ctrl.theory import TPOT_Z, tpot_running_cap

    profile = step_profile(**CPU_LIKE)
    obs = _offered(prompt, output)
    w = prompt * output + output * (output + 1) / 2
    per_request = 1 / fluid_lambda_max(prompt + output, w, profile, math.inf, output)
    assert per_request == pytest.approx(7.3e-4 * prompt + 8.6e-4 * output + 1.85e-6 * w + 8.4e-4)

    def mean_step(n):
        return 0.0117 + (per_request * n + TPOT_Z * math.sqrt(n) * 7.3e-4 * prompt) / output

    cap = tpot_running_cap(obs, profile, slo)
    assert cap >= 1 and cap == int(cap)
    assert mean_step(cap) <= slo < mean_step(cap + 1)


def test_the_tpot_cap_is_off_where_no_count_of_running_requests_is_too_many_or_few_enough():
    from tidegate.ctrl.theory import tpot_running_cap

    obs = _offered(256, 128)
    assert tpot_running_cap(obs, step_profile(), 2.0) == math.inf  # the slot model: no per-token cost
    assert tpot_running_cap(obs, step_profile(**CPU_LIKE), 0.01) == math.inf  # one step alone is over the SLO
    assert tpot_running_cap(_offered(256, 128, completed=0), step_profile(**CPU_LIKE), 0.2) == \
        tpot_running_cap(obs, step_profile(**CPU_LIKE), 0.2)  # before a completion: the prior's output (128)


def test_in_overload_slo_flow_caps_the_running_requests_at_the_tpot_cap_and_serves_more_within_the_slos():
    """3x overload on a CPU-like replica: without the cap, vLLM's 128 slots fill and steps run near the
    TPOT SLO; with it, the running requests stay at the cap, TPOT within the SLO, and more meet both
    SLOs. At half the load nothing is capped, and nothing is refused."""
    import numpy as np

    from tidegate.ctrl.theory import tpot_running_cap
    from tidegate.engine.workloads import Arrival

    profile = step_profile(**CPU_LIKE)
    cap = tpot_running_cap(_offered(256, 128), profile, 0.2)
    assert 8 < cap < 128
    capped_rps = cap / (128 * 0.2)
    rng = np.random.default_rng(0)

    def poisson(rate, n):
        return [Arrival(float(t), 256, 128, 128, 0) for t in np.cumsum(rng.exponential(1 / rate, n))]

    heavy = poisson(3 * capped_rps, 1200)
    runs = {on: simulate(heavy, profile, build_controller(f"slo-flow:tpot_cap={on}", profile))
            for on in (True, False)}
    with_cap, without = runs[True].summary, runs[False].summary
    assert with_cap["goodput_rps"] > 1.3 * without["goodput_rps"]
    assert with_cap["tpot_p50_s"] <= 0.2 < without["tpot_p99_s"]
    running = runs[True].core.metrics.step_running
    assert max(running[len(running) // 2:]) <= cap  # once the overload is witnessed
    assert max(runs[False].core.metrics.step_running) > cap
    light = simulate(poisson(0.5 * capped_rps, 300), profile, build_controller("slo-flow", profile)).summary
    assert light["rejected"] == 0 and light["tpot_p99_s"] <= 0.2


def test_a_twin_deciding_arrivals_elsewhere_sees_the_running_cap_and_refuses_what_would_wait_behind_it():
    """The vLLM plugin and tidegate serve decide arrivals in another process, on a twin of the engine's
    controller that never runs ``decide``: the admission state carries the running cap, so the twin predicts
    the wait for the cap's slots as the engine's controller does, and refuses the same arrivals."""
    from tidegate.ctrl.slo_flow import SloFlowController

    profile = step_profile(**CPU_LIKE)
    obs = _offered(256, 128)
    obs.mean_step_time_s, obs.lifetime_kv_workload, obs.mean_output_tokens = 0.1, 41_000.0, 128.0
    obs.num_running, obs.num_waiting, obs.kv_used_tokens = 45, 40, 17_000
    obs.arrival_rate_rps = obs.offered_rate_rps = 6.0  # 3 x the completions: overload, whatever the bound
    obs.completion_rate_rps = obs.served_rate_rps = 2.0

    def controller():
        return SloFlowController(ttft_slo_s=2.0, tpot_slo_s=0.2, profile=profile, max_num_seqs=128,
                                 max_num_batched_tokens=2048)

    engine_side, twin, blind = controller(), controller(), controller()
    cap = engine_side.decide(obs).running_cap
    assert cap < 128  # in overload the TPOT cap binds
    twin.set_admission_state(engine_side.admission_state())
    assert twin.predict_ttft_s(obs, 256) == engine_side.predict_ttft_s(obs, 256)
    assert engine_side.admit(obs, 256, 128) is not None and twin.admit(obs, 256, 128) is not None
    # without the cap the twin takes the memory's rate for the queue's, and admits what waits 20 s
    assert blind.predict_ttft_s(obs, 256) < 2.0 < twin.predict_ttft_s(obs, 256)
    assert blind.admit(obs, 256, 128) is None


def test_in_overload_slo_flow_counts_the_prefill_ahead_at_the_profiles_cost_not_at_the_mean_step():
    """Decode steps set the mean step time; a queue of long prompts prefills in steps many times as long.
    A count of steps at the mean step predicts 0.5 s for 15 s of prefill; the profile's compute bound
    (``ctrl.theory.prefill_time_s``) refuses the arrival, and without it the arrival is admitted."""
    from tidegate.ctrl.slo_flow import SloFlowController, predicted_ttft_s
    from tidegate.ctrl.theory import decode_token_s, prefill_time_s

    profile = step_profile(**CPU_LIKE)
    obs = _offered(2000, 100)
    obs.mean_step_time_s, obs.lifetime_kv_workload, obs.mean_output_tokens = 0.03, 250_000.0, 100.0
    obs.num_running, obs.num_waiting, obs.kv_used_tokens, obs.waiting_prompt_tokens = 8, 9, 20_000, 18_000
    obs.arrival_rate_rps = obs.offered_rate_rps = 6.0  # 3 x the completions: overload, whatever the bound
    obs.completion_rate_rps = obs.served_rate_rps = 2.0

    def controller(**options):
        return SloFlowController(ttft_slo_s=2.0, tpot_slo_s=0.2, profile=profile, max_num_seqs=128,
                                 max_num_batched_tokens=2048, tpot_cap=False, **options)

    tokens, running = 18_000 + 2000, 8
    steps = tokens / (2048 - running)
    overhead = profile.base_s + decode_token_s(profile) * running + profile.per_kv_token_s * 20_000
    assert prefill_time_s(obs, 2000, 2048, profile) == pytest.approx(profile.per_token_s * tokens + steps * overhead)
    unbounded = predicted_ttft_s(obs, 2000, 2048)
    assert unbounded < 2.0 < prefill_time_s(obs, 2000, 2048, profile) == controller().predict_ttft_s(obs, 2000)
    assert predicted_ttft_s(obs, 2000, 2048, profile=profile) == prefill_time_s(obs, 2000, 2048, profile)
    assert controller(prefill_bound=False).predict_ttft_s(obs, 2000) == unbounded
    assert controller().admit(obs, 2000, 100) is not None
    assert controller(prefill_bound=False).admit(obs, 2000, 100) is None
    # nothing ahead: admitted, however long its own prefill
    obs.num_waiting = obs.waiting_prompt_tokens = 0
    assert controller().admit(obs, 2000, 100) is None


def test_in_overload_slo_flow_corrects_a_queues_predicted_wait_in_proportion_to_it():
    """Recent predictions of a queue's wait ran twice as long as predicted (``ttft_rel_error_p95`` = 1), while the
    error in seconds, mostly of requests with nothing ahead, reads 0.1 s: an arrival predicted at 1.0 s against
    a 2 s SLO is refused (2.1 s), and admitted when the correction is only in seconds (1.1 s)."""
    from tidegate.ctrl.slo_flow import SloFlowController

    obs = _offered(256, 128)
    obs.mean_step_time_s, obs.lifetime_kv_workload, obs.mean_output_tokens = 0.03, 41_000.0, 128.0
    # every slot taken: one request ahead, and the arrival waits for two completions at 2 a second
    obs.num_running, obs.num_waiting, obs.kv_used_tokens = 40, 1, 30_000
    obs.arrival_rate_rps = obs.offered_rate_rps = 6.0  # 3 x the completions: overload
    obs.completion_rate_rps = obs.served_rate_rps = obs.slot_completion_rate_rps = 2.0
    obs.ttft_error_p95_s, obs.ttft_rel_error_p95 = 0.1, 1.0

    def controller(**options):
        return SloFlowController(ttft_slo_s=2.0, tpot_slo_s=0.2, max_num_batched_tokens=2048, max_num_seqs=40,
                                 tpot_cap=False, **options)

    predicted = controller().predict_ttft_s(obs, 256)
    assert predicted + 0.1 < 2.0 < 2 * predicted
    assert controller().admit(obs, 256, 128) is not None
    assert controller(relative_error=False).admit(obs, 256, 128) is None
    obs.ttft_rel_error_p95 = -0.5  # predictions ran early: no correction below the prediction itself
    assert controller().admit(obs, 256, 128) is None


def test_a_queue_predicted_past_the_slo_witnesses_overload_that_the_rates_do_not_yet_show():
    """A step in load after an idle spell: the rates still read the quiet minute (arrivals under the
    completions, far under the fluid bound, the KV nearly empty), while twelve prompts of 256 tokens wait,
    over 2 s of prefill on this CPU-like replica. The queue witness refuses the arrival on the predicted start
    of the queue ahead alone; without it nothing witnesses overload and the arrival is admitted. The witness
    reads neither the arrival's own prompt (a long one behind a short queue is admitted, as on an idle
    replica), nor the error margin, nor the policy's residual (a tightened threshold cannot make it refuse).
    It is an option, off by default: without it, nothing is refused here."""
    from tidegate.ctrl.slo_flow import SloFlowController

    profile = step_profile(**CPU_LIKE)
    obs = _offered(256, 128)
    obs.mean_step_time_s, obs.lifetime_kv_workload, obs.mean_output_tokens = 0.1, 41_000.0, 128.0
    obs.num_running, obs.kv_used_tokens = 4, 1_500
    obs.num_waiting, obs.waiting_prompt_tokens = 12, 12 * 256
    obs.arrival_rate_rps = obs.offered_rate_rps = 1.0  # a rate that still spans the idle spell
    obs.completion_rate_rps = obs.served_rate_rps = 1.5
    obs.ttft_error_p95_s = obs.ttft_rel_error_p95 = 0.0

    def controller(queue_witness=True, **options):
        return SloFlowController(ttft_slo_s=2.0, tpot_slo_s=0.2, profile=profile, max_num_seqs=128,
                                 max_num_batched_tokens=2048, tpot_cap=False, queue_witness=queue_witness, **options)

    assert controller().reject_delay_s(obs) == math.inf  # no rate or memory witness
    assert controller().predict_ttft_s(obs, 0) > 2.0
    rejection = controller().admit(obs, 256, 128)
    assert rejection is not None and "queue ahead" in rejection.reason
    assert controller(queue_witness=False).admit(obs, 256, 128) is None
    # a queue the prediction starts within the SLO: admitted, whatever the residual asks ...
    obs.num_waiting, obs.waiting_prompt_tokens = 2, 2 * 256
    tight = controller()
    tight.set_residual(reject_scale=0.25)
    assert 0.5 < tight.predict_ttft_s(obs, 256) < 2.0
    assert tight.admit(obs, 256, 128) is None
    # ... and however long the arrival's own prompt
    assert controller().predict_ttft_s(obs, 4000) > 2.0
    assert controller().admit(obs, 4000, 128) is None


def test_the_busy_period_and_queue_witnesses_refuse_a_step_in_load_after_an_idle_spell_before_the_rates_catch_up():
    """1.5 x the bound for two minutes, 35 s idle, then 3 x: the 64-event rates still span the idle spell
    for seconds while the queue grows by four requests a second. Without the busy period's witness (on by
    default), 30 of the requests that arrived in the step's first 15 s miss their TTFT SLO on this draw; with
    the queue witness alone at most three quarters as many (20; over five draws 87 against 173); with the busy
    period's witness none, and goodput rises each time."""
    from tidegate.engine.workloads.synthetic import load_synthetic

    profile = step_profile(**CPU_LIKE)
    arrivals = []
    for seed, (rate, start, seconds) in enumerate(((3.3, 0.0, 120.0), (6.5, 155.0, 40.0))):
        workload = {"arrival": {"process": "poisson"}, "duration_s": seconds, "max_tokens": 128,
                    "classes": [{"rate_rps": rate, "prompt_tokens": 256, "output_tokens": 128}]}
        arrivals += [dataclasses.replace(a, arrival_time_s=start + a.arrival_time_s)
                     for a in load_synthetic(workload, seed=seed)]

    def run(spec):
        result = simulate(arrivals, profile, build_controller(spec, profile), record_steps=False)
        late = [r for r in result.core.metrics.terminal if r.first_token_time_s is not None
                and 155.0 <= r.arrival_time_s < 170.0 and r.first_token_time_s - r.arrival_time_s > 2.0]
        return len(late), result.summary["goodput_rps"]

    late_without, goodput_without = run("slo-flow:busy_witness=false")
    late, goodput = run("slo-flow:busy_witness=false,queue_witness=true")
    assert late < 0.75 * late_without
    assert goodput > goodput_without
    late, goodput = run("slo-flow")
    assert late < 0.25 * late_without
    assert goodput > goodput_without


def test_the_prefill_bound_serves_more_of_a_long_prompt_trace_in_overload():
    """The A100 preset, the code trace's prompts (median 1,500 tokens, p90 4,750) at 2 x its bound: counted at
    the mean step, a burst's prefill was predicted at a tenth of what it took, and the admitted requests missed
    their TTFT (goodput +28% on this draw; over six draws of 1,000 requests, +7% to +15% on the A100 preset and
    +12% to +29% on tiny-cpu at 1.2-3 x)."""
    from tidegate.engine.workloads.families import load_family
    from tidegate.training.evaluate import cell_arrivals

    profile = load_profile("a100-llama2-7b")
    arrivals = cell_arrivals(load_family("code-trace"), 2.0, 0, 600, profile)[0]
    with_bound = simulate(arrivals, profile, build_controller("slo-flow", profile), record_steps=False).summary
    without = simulate(arrivals, profile, build_controller("slo-flow:prefill_bound=false", profile),
                       record_steps=False).summary
    assert with_bound["goodput_rps"] > 1.1 * without["goodput_rps"]
    assert with_bound["slo_attainment"] > without["slo_attainment"]


def test_replay_waits_for_arrivals_and_drains():
    profile = step_profile()
    core = build_engine(profile, build_controller("greedy", profile), SimExecutor(profile), VirtualClock())
    times = [0.0, 0.0, 10.0, 50.0]
    seen = []
    replay(core, times, lambda i: req(i, 4, 3, arrival=times[i]), on_step=seen.append)
    assert not core.has_unfinished and len(core.metrics.terminal) == 4
    assert seen == sorted(seen) and seen[-1] == 4
    assert min(r.start_time_s - r.arrival_time_s for r in core.metrics.terminal) == 0.0


def test_simulate_is_the_replay_of_make_request():
    from tidegate.engine.workloads import Arrival

    arrivals = [Arrival(0.1 * i, 8, 5, 16, 0) for i in range(30)]
    profile = step_profile(kv_capacity_tokens=64)
    a = simulate(arrivals, profile, build_controller("greedy", profile)).summary
    core = build_engine(profile, build_controller("greedy", profile), SimExecutor(profile), VirtualClock())
    replay(core, [x.arrival_time_s for x in arrivals], lambda i: make_request(i, arrivals[i]))
    b = core.metrics.summary(64, profile.ttft_slo_s, profile.tpot_slo_s)
    assert {k: v for k, v in a.items() if k != "wall_time_s"} == b


def test_one_memory_safe_rate_one_aimd_budget_one_ttft_prediction():
    from tidegate.ctrl.base import AimdTokenBudget, Observation
    from tidegate.ctrl.flow import FlowController
    from tidegate.ctrl.shield import ShieldedController
    from tidegate.ctrl.slo_flow import SloFlowController, predicted_ttft_s
    from tidegate.ctrl.theory import safe_activation_rate
    from tidegate.ctrl.watermark import WatermarkController

    obs = Observation(kv_capacity_tokens=50_000)
    obs.completed_total, obs.lifetime_kv_workload, obs.mean_step_time_s = 10, 12_345.0, 0.02
    obs.num_waiting, obs.num_running, obs.waiting_prompt_tokens = 5, 7, 3000
    rate = safe_activation_rate(obs, 0.9, 128)
    assert ShieldedController(SloFlowController()).safe_budget(obs) == rate
    assert FlowController(target_usage=0.9).safe_budget(obs) == rate
    assert isinstance(WatermarkController().aimd, AimdTokenBudget)
    assert isinstance(SloFlowController().aimd, AimdTokenBudget)
    assert SloFlowController().predict_ttft_s(obs, 100) == predicted_ttft_s(obs, 100, 8192)


def test_the_stable_rate_is_algorithm_1s_budget_exactly_where_the_safe_rate_is_slower_than_a_stable_load():
    """b_safe = rho M / w below rho M of demand and beyond M (overload); M / w where the arrivals ask
    between rho M and M, so activations keep up with any load Algorithm 1 serves. The band is widened by
    DEMAND_Z standard errors of the demand's rate (a rate over 256 arrivals: 1/16), past M only while the steady
    completions keep up with the arrivals."""
    from tidegate.ctrl.base import Observation
    from tidegate.ctrl.theory import DEMAND_Z, safe_activation_rate, stable_activation_rate

    obs = Observation(kv_capacity_tokens=2000, block_size=1)
    obs.completed_total, obs.lifetime_kv_workload, obs.mean_step_time_s = 300, 1000.0, 1.0
    b_safe = safe_activation_rate(obs, 0.9, 128)
    assert b_safe == pytest.approx(1.8)
    margin = DEMAND_Z / 16
    low, high = 1.8 / (1 + margin), 2.0 / (1 - margin)  # the band, in arrivals per step
    for per_step, expected in ((0.5, b_safe), (0.99 * low, b_safe), (1.01 * low, 2.0), (1.9, 2.0), (2.0, 2.0),
                               (0.99 * high, 2.0), (1.01 * high, b_safe), (9.0, b_safe)):
        obs.offered_rate_rps = obs.served_rate_rps = per_step  # a step of 1 s: arrivals per step, all served
        assert stable_activation_rate(obs, 0.9, 128) == pytest.approx(expected), per_step
    # past M only while the completions keep up: a replica falling behind is in overload
    obs.offered_rate_rps, obs.served_rate_rps = 0.99 * high, 0.99 * high / 1.3
    assert stable_activation_rate(obs, 0.9, 128) == pytest.approx(b_safe)
    obs.offered_rate_rps = 1.9  # within M, whatever the completions
    assert stable_activation_rate(obs, 0.9, 128) == pytest.approx(2.0)
    # the offered W's error is left out (on heavy tails it spans tens of percent)
    obs.offered_rate_rps = 1.01 * high
    obs.offered_kv_workload, obs.offered_kv_workload_se = 1000.0, 300.0
    assert stable_activation_rate(obs, 0.9, 128) == pytest.approx(b_safe)
    obs.offered_rate_rps, obs.mean_step_time_s = 1.9, 0.0  # no step timed yet
    assert stable_activation_rate(obs, 0.9, 128) == b_safe
    obs.mean_step_time_s = 0.5  # the same arrivals per second are half as many per step
    obs.offered_rate_rps = 3.8
    assert stable_activation_rate(obs, 0.9, 128) == pytest.approx(2.0)
    obs.completed_total = 200  # the steady rate spans fewer arrivals than it needs
    assert stable_activation_rate(obs, 0.9, 128) == b_safe


def test_slo_flow_keeps_up_with_three_classes_near_the_memorys_bound():
    """Three Poisson classes at 0.96 of the slot model's memory bound: the demand's estimate reads a few percent
    past M now and then, which is no overload (the completions keep up), so the rate stays Algorithm 1's and
    slo-flow serves as greedy does. Read exactly, the rate fell to rho M / w each time and the queue grew to
    hundreds with the KV at 84% (0.81 x greedy)."""
    from tidegate.engine.workloads.synthetic import load_synthetic
    from tidegate.engine.core.profile import load_profile

    slot = load_profile("slot")
    spec = {"name": "three", "arrival": {"process": "poisson"}, "duration_s": 1500, "seed": 0, "max_tokens": 64,
            "classes": [{"name": "a", "rate_rps": 5.35, "prompt_tokens": 10, "output_tokens": 10},
                        {"name": "b", "rate_rps": 1.07, "prompt_tokens": 20, "output_tokens": 20},
                        {"name": "c", "rate_rps": 0.321, "prompt_tokens": 30, "output_tokens": 30}]}
    arrivals = load_synthetic(spec)
    greedy, slo_flow = (simulate(arrivals, slot, build_controller(name, slot)).summary["goodput_rps"]
                        for name in ("greedy", "slo-flow"))
    assert slo_flow >= 0.97 * greedy


def test_before_any_completion_the_output_prior_is_no_longer_than_any_arrival_may_run():
    """The slot model at 0.7 and 0.9 of the memory's bound, outputs of 20 tokens: before the first completion the
    bound and the pacing take the prior output (128 tokens), which read the load as over capacity and refused
    arrivals of the start. No output runs past its ``max_tokens``: where every arrival asks for at most 20, the
    prior is 20, and nothing is refused. Where they may run to 128 or more, the prior stays 128."""
    from tidegate.ctrl.theory import lifetime_kv_workload
    from tidegate.engine.workloads import Arrival

    slot = load_profile("slot")
    w = lifetime_kv_workload(20, 20)
    for load in (0.7, 0.9):
        per_slot = load * slot.kv_capacity_tokens / w
        runs = {}
        for max_tokens in (20, 128, 1000):
            arrivals = [Arrival(i / per_slot, 20, 20, max_tokens, 0) for i in range(int(200 * per_slot))]
            runs[max_tokens] = simulate(arrivals, slot, build_controller("slo-flow", slot)).summary
        greedy = simulate(arrivals, slot, build_controller("greedy", slot)).summary
        assert runs[20]["rejected"] == 0 and runs[20]["goodput_rps"] == pytest.approx(greedy["goodput_rps"]), load
        assert runs[128]["rejected"] > 10, load
        assert (runs[1000]["rejected"], runs[1000]["goodput_rps"]) == (runs[128]["rejected"], runs[128]["goodput_rps"])


def test_slo_flow_keeps_up_with_a_load_the_memory_serves_where_the_safe_rate_alone_queues_without_end():
    """Dong & Cao's slot model (a step is one time unit, prefill costs memory, not time), one class at 0.95 and
    0.99 of the memory's stability bound M / w: rho M / w (rho 0.9) is slower than the arrivals, and the queue
    grows for as long as they last; Algorithm 1's M / w keeps up, as greedy does. In overload both rates are the
    same. (The safe rate's run has the queue witness off: at 0.95 of the bound the load does not read as under
    capacity, and the witness's refusals would keep the queue it grows short.)"""
    from tidegate.ctrl.theory import lifetime_kv_workload
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.workloads import Arrival

    slot = load_profile("slot")
    w = lifetime_kv_workload(20, 20)
    for load in (0.95, 0.99):
        per_slot = load * slot.kv_capacity_tokens / w
        arrivals = [Arrival(i / per_slot, 20, 20, 20, 0) for i in range(int(2000 * per_slot))]
        runs = {spec: simulate(arrivals, slot, build_controller(spec, slot))
                for spec in ("greedy", "slo-flow", "slo-flow:stable_rate=False,loaded_queue_witness=False")}
        greedy, stable, safe = (runs[s].summary["goodput_rps"] for s in runs)
        assert stable >= 0.97 * greedy, load
        assert safe < 0.5 * greedy, load  # the failure the stable rate removes
        waiting = runs["slo-flow:stable_rate=False,loaded_queue_witness=False"].core.metrics.step_waiting
        half = len(waiting) // 2
        assert sum(waiting[half:]) / (len(waiting) - half) > 1.5 * sum(waiting[:half]) / half  # it kept growing
    overload = [Arrival(i / 5.0, 20, 20, 20, 0) for i in range(5000)]  # 1.5 x M / w
    a, b = (simulate(overload, slot, build_controller(spec, slot)).summary
            for spec in ("slo-flow", "slo-flow:stable_rate=False"))
    assert a["goodput_rps"] == pytest.approx(b["goodput_rps"], rel=0.02)
    assert a["rejected"] == pytest.approx(b["rejected"], rel=0.02)
