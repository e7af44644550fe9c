"""Stretches of steady steps run in one call give exactly what stepping one by one gives.

``tidegate.engine.sim.steady.run_steady`` runs, without asking the controller, the steps in which only steady
decodes can happen, for a controller that promises its decision (``steady_decision``). The same
replay with and without it must agree on everything: each step's record (time, duration, KV,
queue and batch), every request's counts, times and ending (and the order ``on_finish`` saw
them in), the summary, the errors counted, and the observation after every stretch. Workloads
draw arrivals, lengths, tight KV (evictions), queue timeouts, running caps, small token budgets,
failing steps, noisy step times and after-prefill costs, in both eviction and both record modes.
"""

from __future__ import annotations

import math

from hypothesis import event, example, given
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import UNLIMITED, Controller, Decision
from tidegate.engine.core.clock import VirtualClock
from tidegate.engine.core.driver import replay
from tidegate.engine.sim.steady import run_steady
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.sim.executor import SimExecutor
from tests.helpers import req, step_profile
from tests.test_steady import Failing

# (gap to the previous arrival in steps, prompt tokens, output tokens, max_tokens - output tokens)
workloads = st.lists(st.tuples(st.floats(0.0, 30.0), st.integers(1, 40), st.integers(1, 80), st.integers(0, 4)),
                     min_size=1, max_size=25)


class Fixed(Controller):
    """One decision for every observation, promised for steady steps too."""

    name = "fixed"

    def __init__(self, token_budget: int, running_cap: int, activation_budget: int,
                 queue_timeout_s: float | None) -> None:
        super().__init__(queue_timeout_s=queue_timeout_s)
        self.decision = Decision(activation_budget, token_budget, running_cap)
        self.asked = 0

    def decide(self, obs):  # never asked: the engine takes the promise instead
        self.asked += 1
        return self.decision

    def steady_decision(self):
        self.asked += 1
        return self.decision


class Unpromised(Fixed):
    """The same decisions, without the promise: asked at every step."""

    def steady_decision(self):
        return None


def _run(controller_args, workload, capacity, eviction, record, fail_at, seed, steady_runs, promise=True):
    profile = step_profile(kv_capacity_tokens=capacity, noise_sigma=0.3, noise_corr=0.8, per_token_s=0.05,
                           per_kv_token_s=0.01, per_prefill_s=0.2, per_first_decode_s=0.5,
                           per_after_prefill_s=0.3, after_prefill_decay=0.5, per_after_prefill_token_s=0.01,
                           per_prefill_alone_s=0.25)
    controller = ((Fixed if promise else Unpromised)(*controller_args) if isinstance(controller_args, tuple)
                  else build_controller(controller_args or "greedy", profile))
    finished: list = []
    executor = Failing(profile, fail_at)
    executor.noise = SimExecutor(profile, seed).noise
    core = EngineCore(controller, executor, VirtualClock(), capacity, profile.block_size,
                      eviction=eviction, record_steps=record,
                      on_finish=lambda r: finished.append((r.request_id, r.state, r.finish_time_s)))
    times, t = [], 0.0
    for gap, *_ in workload:
        t += gap
        times.append(t)
    requests = []

    def make(i):
        _, prompt, out, slack = workload[i]
        r = req(i, prompt, out, out + slack, arrival=times[i])
        requests.append(r)
        return r

    steady = [0]

    def counted(core, until_s, max_steps=None):
        ended = run_steady(core, until_s, max_steps)
        steady[0] += core.steady_steps
        return ended
    seen = {}  # the observation after each step (stepping) or stretch, by the steps run so far

    def on_step(_):
        seen[core.step_index] = repr(sorted(core.obs.as_dict().items()))

    replay(core, times, make, on_step=on_step, fast_forward=counted if steady_runs else None)
    metrics = core.metrics
    final = [(r.state, r.finish_reason, r.num_output_tokens, r.num_computed_tokens, r.num_evictions,
              r.wasted_tokens, r.first_token_time_s, r.finish_time_s, r.start_time_s, r.predicted_ttft_s,
              r.activation_seq, list(r.block_ids)) for r in requests]
    records = [list(getattr(metrics, k)) for k in ("step_time_s", "step_duration_s", "step_kv_tokens",
                                                   "step_waiting", "step_running", "step_tokens")]
    summary = sorted((k, repr(v)) for k, v in metrics.summary(capacity, 20.0, 2.0).items())
    errors = (dict(core.step_errors), dict(core.controller_errors), dict(core.callback_errors))
    return final, records, summary, errors, finished, repr(sorted(core.obs.as_dict().items())), seen, core, steady[0]


@given(workload=workloads, controller=st.one_of(
           st.sampled_from(["greedy", "no-evict"]),
           st.tuples(st.sampled_from([2, 5, 16, 64]), st.sampled_from([1, 3, 8, UNLIMITED]),
                     st.sampled_from([1, 2, UNLIMITED]), st.sampled_from([None, 3.0, 40.0]))),
       capacity=st.sampled_from([24, 32, 64, 256]), eviction=st.sampled_from(["recompute", "reset"]),
       record=st.booleans(), fail_at=st.frozensets(st.integers(1, 200), max_size=2), seed=st.integers(0, 3))
@example(workload=[(0.0, 4, 80, 0), (0.5, 4, 10, 0), (20.0, 4, 10, 0)], controller=(64, 1, UNLIMITED, 3.0),
         capacity=256, eviction="recompute", record=True, fail_at=frozenset(), seed=0)
# (one request running at a cap of one, the next waiting for it: it expires in the middle of a stretch)
def test_steady_runs_give_exactly_what_stepping_gives(workload, controller, capacity, eviction, record, fail_at,
                                                      seed):
    *fast, seen, core, steady = _run(controller, workload, capacity, eviction, record, fail_at, seed, True)
    *slow, seen_stepping, _, none = _run(controller, workload, capacity, eviction, record, fail_at, seed, False)
    event(f"steady steps: {'some' if steady else 'none'}")
    event(f"evictions: {core.metrics.evictions > 0}")
    assert none == 0
    assert fast == slow
    # after each stretch, the observation stepping one by one leaves after the same step
    for step, observation in seen.items():
        assert observation == seen_stepping[step], step
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_steady_runs_skip_the_controller_and_keep_every_step():
    """Long outputs, few arrivals: most steps run in stretches, each still one record, and the
    controller is asked far less."""
    workload = [(0.0, 8, 200, 0), (5.0, 12, 150, 0), (40.0, 4, 300, 0), (2.0, 20, 90, 0)]
    args = (64, UNLIMITED, UNLIMITED, None)
    fast = _run(args, workload, 256, "recompute", True, frozenset(), 0, True)
    slow = _run(args, workload, 256, "recompute", True, frozenset(), 0, False)
    assert fast[:6] == slow[:6]
    steps = fast[7].metrics.steps
    assert fast[8] > 0.8 * steps
    assert fast[7].controller.asked < 0.2 * slow[7].controller.asked
    assert len(fast[1][0]) == steps  # a record for every step


@given(workload=workloads, args=st.tuples(st.sampled_from([2, 5, 64]), st.sampled_from([1, 3, UNLIMITED]),
                                          st.sampled_from([1, 2, UNLIMITED]), st.sampled_from([None, 3.0])),
       capacity=st.sampled_from([24, 64, 256]), fail_at=st.frozensets(st.integers(1, 100), max_size=2))
def test_a_promise_taken_at_every_step_changes_nothing(workload, args, capacity, fail_at):
    """A step takes a promising controller's decision without making an Observation or asking
    ``decide``: the run is the one the same decisions give when asked for at every step."""
    promised = _run(args, workload, capacity, "recompute", True, fail_at, 0, False)
    asked = _run(args, workload, capacity, "recompute", True, fail_at, 0, False, promise=False)
    assert promised[:6] == asked[:6] and promised[6] == asked[6]
    assert promised[7].controller.asked == promised[7].metrics.steps  # steady_decision, once a step
    assert asked[7].controller.asked == asked[7].metrics.steps  # decide, once a step


def test_a_controller_without_the_promise_is_asked_at_every_step():
    profile = step_profile()
    core = EngineCore(build_controller("slo-flow", profile), SimExecutor(profile), VirtualClock(), 256, 4)
    core.add_request(req(0, 8, 40))
    core.step()
    core.step()  # decoding in aggregate now
    assert core.scheduler.steady.count == 1
    assert run_steady(core, math.inf) == [] and core.steady_steps == 0
