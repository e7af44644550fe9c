"""The simulator's cost grows with the trace, not with the requests already served: a step does the
same work after thousands of finished requests as after hundreds, ended requests need not stay in
memory, and the summary kept as the run goes equals the one computed from every ended request."""

from __future__ import annotations

import gc
import math
import sys

import numpy as np
import pytest

from tidegate.ctrl import build_controller
from tidegate.engine.core.driver import replay
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import met_slo, time_per_output_token_s, time_to_first_token_s
from tidegate.engine.sim.simulate import make_request, make_sim_engine, simulate
from tidegate.engine.workloads import Arrival, read_trace, resolve_trace

PROFILE = load_profile("a100-llama2-7b")
STEADY = [Arrival(0.05 * i, 64, 16, 16) for i in range(3000)]  # ~4 running, ~15k steps


def _summary_from_requests(terminal, first_arrival_s, core, ttft_slo_s, tpot_slo_s) -> dict:
    """The latency and count figures of a summary, computed from the ended requests themselves."""
    finished = [r for r in terminal if r.state is RequestState.FINISHED]
    ttft = np.array([time_to_first_token_s(r) for r in finished], dtype=float)
    e2e = np.array([r.finish_time_s - r.arrival_time_s for r in finished], dtype=float)
    tpot = np.array([t for t in map(time_per_output_token_s, finished) if t is not None], dtype=float)
    good = sum(met_slo(r, ttft_slo_s, tpot_slo_s) for r in finished)
    pairs = np.array([(r.predicted_ttft_s, time_to_first_token_s(r)) for r in finished
                      if r.predicted_ttft_s is not None], dtype=float).reshape(-1, 2)
    err = pairs[:, 1] - pairs[:, 0]
    span = max(core.metrics.last_time_s - first_arrival_s, 1e-12)

    def pct(x, q):
        return float(np.percentile(x, q)) if x.size else math.nan

    def mean(x):
        return float(x.mean()) if x.size else math.nan

    figures = {"completed": len(finished), "throughput_rps": len(finished) / span, "goodput_rps": good / span,
               "output_tps": float(np.array([r.num_output_tokens for r in finished], dtype=float).sum()) / span,
               "slo_attainment": good / core.metrics.arrived,
               "ttft_pred_mae_s": mean(np.abs(err)), "ttft_pred_bias_s": mean(err),
               "ttft_pred_wrong_side": mean((pairs[:, 0] <= ttft_slo_s) != (pairs[:, 1] <= ttft_slo_s))}
    for state in ("rejected", "expired", "cancelled", "failed"):
        figures[state] = sum(r.state is RequestState(state) for r in terminal)
    for name, x in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        figures[f"{name}_p50_s"], figures[f"{name}_p99_s"] = pct(x, 50), pct(x, 99)
    return figures


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (NaN equals NaN)."""
    return [k for k in a if not (a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]))]


@pytest.mark.parametrize("controller", ["greedy", "slo-flow"])
def test_the_summary_equals_the_one_computed_from_every_ended_request(controller):
    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=1500, rate_scale=3.0)  # overloaded
    kept = simulate(arrivals, PROFILE, build_controller(controller, PROFILE), record_steps=False)
    lean = simulate(arrivals, PROFILE, build_controller(controller, PROFILE), record_steps=False,
                    keep_requests=False)
    terminal = kept.core.metrics.terminal
    assert len(terminal) == len(arrivals) and not lean.core.metrics.terminal
    expected = _summary_from_requests(terminal, arrivals[0].arrival_time_s, kept.core, PROFILE.ttft_slo_s,
                                      PROFILE.tpot_slo_s)
    assert not _same(expected, kept.summary)
    drop_wall = {k: v for k, v in kept.summary.items() if k != "wall_time_s"}
    assert not _same(drop_wall, lean.summary)
    if controller == "slo-flow":
        assert kept.summary["rejected"] > 0  # the refused requests are counted too


def _lines_per_step(controller: str, windows: list[range]) -> list[float]:
    """Python lines a step executes, on average, in each window of step indices (counted, not timed)."""
    core = make_sim_engine(PROFILE, build_controller(controller, PROFILE), record_steps=False,
                           keep_requests=False)
    step, lines = core.step, [0] * len(windows)

    def counted_step(*args):
        index = core.step_index
        which = next((i for i, w in enumerate(windows) if index in w), None)
        if which is None:
            return step(*args)

        def trace(frame, event, arg):
            if event == "line":
                lines[which] += 1
            return trace

        sys.settrace(trace)
        try:
            return step(*args)
        finally:
            sys.settrace(None)

    core.step = counted_step
    replay(core, [a.arrival_time_s for a in STEADY], lambda i: make_request(i, STEADY[i]))
    assert core.step_index > windows[-1].stop and core.metrics.ended_by_state[RequestState.FINISHED] == len(STEADY)
    return [n / len(w) for n, w in zip(lines, windows)]


@pytest.mark.parametrize("controller", ["greedy", "slo-flow"])
def test_a_step_does_the_same_work_after_ten_times_more_finished_requests(controller):
    # steady arrivals: about 250 requests have finished by step 1,000 and 2,500 by step 10,000
    early, late = _lines_per_step(controller, [range(1000, 1500), range(10_000, 10_500)])
    assert late <= 1.05 * early


def _live_requests() -> int:
    gc.collect()
    return sum(type(o) is Request for o in gc.get_objects())


@pytest.mark.parametrize("keep_requests", [False, True])
def test_ended_requests_stay_in_memory_only_with_keep_requests(keep_requests):
    arrivals = STEADY[:500]
    before = _live_requests()
    core = make_sim_engine(PROFILE, build_controller("greedy", PROFILE), record_steps=False,
                           keep_requests=keep_requests)
    replay(core, [a.arrival_time_s for a in arrivals], lambda i: make_request(i, arrivals[i]))
    assert _live_requests() - before == (len(arrivals) if keep_requests else 0)
    assert len(core.metrics.finished_at_s) == core.metrics.ended_by_state[RequestState.FINISHED] == len(arrivals)


def test_retain_bounds_what_a_long_running_engine_keeps():
    from tidegate.engine.core.metrics import EngineMetrics
    from tidegate.engine.core.request import Request, RequestState

    m = EngineMetrics(record_steps=False)
    for i in range(1000):
        r = Request(str(i), float(i), 4, 4)
        r.state, r.first_token_time_s, r.finish_time_s, r.num_output_tokens = RequestState.FINISHED, i + 0.5, i + 1.0, 4
        m.on_terminal(r)
        m.retain(100)
        assert len(m.terminal) <= 200 and len(m.finished_at_s) <= 200
    assert m.terminal[-1].request_id == "999" and m.finished_at_s[-1] == 1000.0
    assert m.ended_by_state[RequestState.FINISHED] == 1000
