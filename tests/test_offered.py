"""The offered requests' sizes: completed requests reweighted so that admission does not bias them."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.ctrl.base import Controller, Rejection
from tidegate.engine.core.offered import OfferedSizes
from tests.helpers import make_engine, req, run_until_idle


def work(p: int, d: int) -> float:
    return p * d + d * (d + 1) / 2


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 20_000), st.integers(1, 2000)), min_size=1, max_size=200),
       alpha=st.sampled_from([0.01, 0.1, 0.5]))
def test_without_refusals_the_estimates_are_the_completed_requests_weighted_means(sizes, alpha):
    est = OfferedSizes(alpha)
    weights = np.array([(1 - alpha) ** k for k in range(len(sizes))][::-1])
    for p, _ in sizes:
        est.arrived(p, admitted=True)
    for p, d in sizes:
        assert est.weight(p) == 1.0
        est.completed(p, d)
    outs = np.array([d for _, d in sizes], dtype=float)
    works = np.array([work(p, d) for p, d in sizes])
    assert est.output_tokens == pytest.approx(np.average(outs, weights=weights))
    assert est.kv_workload == pytest.approx(np.average(works, weights=weights))
    assert est.kv_workload_se >= 0.0 and (len(sizes) > 1 or est.kv_workload_se == 0.0)


def test_the_standard_error_of_equal_weights_is_the_textbook_one():
    rng = np.random.default_rng(0)
    p, d = rng.integers(1, 5000, 400), rng.integers(1, 500, 400)
    est = OfferedSizes(1e-12)  # no forgetting: every completion weighs the same
    for a, b in zip(p, d):
        est.arrived(int(a), True)
        est.completed(int(a), int(b))
    works = p * d + d * (d + 1) / 2
    assert est.kv_workload_se == pytest.approx(works.std(ddof=1) / math.sqrt(len(works)), rel=1e-6)
    assert est.prompt_se == pytest.approx(p.std(ddof=1) / math.sqrt(len(p)), rel=1e-6)


def test_refusing_the_largest_prompts_does_not_make_the_traffic_look_smaller():
    """Half the long-prompt arrivals are refused: the completed requests' mean W is far below the
    offered one; the reweighted estimate is the offered one."""
    est = OfferedSizes(0.001)
    small, large = (100, 10), (6000, 100)
    completed = []
    for i in range(3000):
        p, d = small if i % 2 else large
        admitted = p == small[0] or i % 4 == 0
        est.arrived(p, admitted)
        if admitted:
            est.completed(p, d)
            completed.append(work(p, d))
    offered = (work(*small) + work(*large)) / 2
    assert np.mean(completed) < 0.7 * offered
    assert est.kv_workload == pytest.approx(offered, rel=0.05)
    assert est.output_tokens == pytest.approx((small[1] + large[1]) / 2, rel=0.05)


def test_a_bin_with_no_admission_counts_at_most_its_recent_arrivals():
    est = OfferedSizes(0.01)
    for _ in range(10):
        est.arrived(5000, admitted=False)
    assert 1.0 < est.weight(5000) <= 10.0
    assert est.weight(100) == 1.0  # a bin nobody arrived in


class RefuseLong(Controller):
    """Admits every short prompt and every other long one."""
    name = "refuse-long"

    def __init__(self):
        super().__init__()
        self.long_seen = 0

    def admit(self, obs, prompt_tokens, max_tokens):
        if prompt_tokens < 1000:
            return None
        self.long_seen += 1
        return None if self.long_seen % 2 else Rejection("long", 1.0)


def test_the_engine_reports_the_offered_sizes_beside_the_completed_ones():
    core = make_engine(RefuseLong(), capacity=1 << 16, block_size=16)
    for i in range(200):
        core.add_request(req(i, 2000 if i % 2 else 100, 20 if i % 2 else 5))
        core.step()
    run_until_idle(core)
    obs = core.observe()
    assert obs.rejections_total == 50
    # the completed requests are two short for every long one; the offered, one for one
    assert obs.lifetime_kv_workload < 0.8 * obs.offered_kv_workload
    assert obs.offered_kv_workload == pytest.approx((work(2000, 20) + work(100, 5)) / 2, rel=0.1)
    assert obs.offered_output_tokens == pytest.approx(12.5, rel=0.1)
    assert obs.offered_kv_workload_se > 0 and obs.offered_prompt_se > 0


def test_kv_token_steps_per_completion_are_the_lifetime_workload_of_requests_run_alone():
    """One request at a time: the KV held over its steps is its own W (block-rounded), so Little's
    law on the KV agrees with the completed requests' W; while a long request still runs, only
    the occupancy counts it."""
    from tidegate.ctrl.greedy import GreedyController

    core = make_engine(GreedyController(), capacity=1 << 14, block_size=1)
    for i, (p, d) in enumerate([(10, 5), (20, 8), (5, 3)]):
        core.add_request(req(i, p, d))
        run_until_idle(core)
    core.add_request(req(9, 10, 500))  # a long one, still running
    for _ in range(200):
        core.step()
    obs = core.observe()
    assert obs.completed_total == 3
    assert obs.occupied_kv_workload > 2 * obs.lifetime_kv_workload  # the long request's 200 steps count
    run_until_idle(core)
    obs = core.observe()
    assert obs.occupied_kv_workload == pytest.approx(obs.lifetime_kv_workload, rel=0.05)


def test_decode_reads_per_completion_are_the_lifetime_workload_and_count_the_long_requests_still_running():
    """Run one at a time, each request's decodes and completion count its own W, not rounded to
    blocks; a long output still running counts from its first decode on; a long prompt's prefill
    over many steps, which the KV held counts, does not."""
    from tidegate.ctrl.greedy import GreedyController

    core = make_engine(GreedyController(max_num_batched_tokens=16), capacity=1 << 14, block_size=16)
    for i, (p, d) in enumerate([(10, 5), (20, 8), (5, 3), (300, 4)]):
        core.add_request(req(i, p, d))
        run_until_idle(core)
    obs = core.observe()
    # the same weights (1 - alpha) per completion, applied to a request's decodes once more: within alpha
    assert obs.decode_kv_workload == pytest.approx(obs.lifetime_kv_workload, rel=0.011)
    assert obs.occupied_kv_workload > 1.5 * obs.decode_kv_workload  # 19 steps of prefill held 300+ tokens
    core.add_request(req(9, 10, 500))  # a long one, still running
    for _ in range(200):
        core.step()
    obs = core.observe()
    assert obs.completed_total == 4
    assert obs.decode_kv_workload > 2 * obs.lifetime_kv_workload


def test_the_capacity_bound_takes_the_larger_of_the_offered_and_the_decoded_workload():
    from tidegate.ctrl.base import Observation
    from tidegate.ctrl.theory import shrunk_lambda_max_interval
    from tidegate.engine.core.profile import load_profile

    prof = load_profile("a100-llama2-7b")
    obs = Observation(prof.kv_capacity_tokens)
    obs.completed_total = 500
    obs.offered_prompt_tokens = 100.0
    obs.offered_output_tokens = 400.0
    obs.offered_kv_workload = work(100, 400)
    base, _ = shrunk_lambda_max_interval(obs, prof)
    obs.decode_kv_workload = 0.5 * work(100, 400)  # lower: the offered W stands
    assert shrunk_lambda_max_interval(obs, prof)[0] == base
    obs.decode_kv_workload = 2 * work(100, 400)  # long outputs still running: the bound is lower
    assert shrunk_lambda_max_interval(obs, prof)[0] < 0.7 * base


def test_a_burst_into_free_memory_leaves_room_for_the_running_requests_to_grow():
    """Requests of the mean size fit at their peak after the running ones have grown to the mean
    output, what they hold already counted."""
    from tidegate.ctrl.base import Observation
    from tidegate.ctrl.theory import headroom_activations

    obs = Observation(100_000)
    obs.completed_total, obs.mean_prompt_tokens, obs.mean_output_tokens = 100, 100.0, 400.0
    obs.kv_used_tokens = 10_000
    assert headroom_activations(obs, 0.9, 128) == 80_000 // 500  # nothing runs: all free memory
    obs.num_running, obs.running_prompt_tokens = 20, 2_000  # 8,000 output tokens held, 20 x 400 due
    assert headroom_activations(obs, 0.9, 128) == 80_000 // 500  # grown already: nothing to keep
    obs.kv_used_tokens = 4_000  # 2,000 output tokens held: 6,000 still to come
    assert headroom_activations(obs, 0.9, 128) == (90_000 - 4_000 - 6_000) // 500
    obs.num_running = 220  # 86,000 still to come: no room
    assert headroom_activations(obs, 0.9, 128) == 0
    obs.completed_total, obs.num_running, obs.running_prompt_tokens = 0, 0, 0  # before any completion:
    obs.head_prompt_tokens, obs.kv_used_tokens = 372, 0  # the queue head with the prior output
    assert headroom_activations(obs, 0.9, 128) == 90_000 // 500


@settings(max_examples=50, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 2000)), min_size=1, max_size=60))
def test_an_arrivals_output_is_expected_from_the_completions_of_its_prompts_size(pairs):
    """The mean output of the recent completions in the arrival's prompt bin (power of two); a bin with none
    takes the offered mean; nothing before the first completion. Refusals do not enter a bin's mean: within a
    bin admission does not depend on the output."""
    est = OfferedSizes(0.01)
    assert est.output_for(100) == 0.0
    for p, d in pairs:
        est.arrived(p, admitted=True)
        est.arrived(p, admitted=False)
        est.completed(p, d)
    for p, _ in pairs:
        mine = [(i, d) for i, (q, d) in enumerate(pairs) if q.bit_length() == p.bit_length()]
        weights = [0.99 ** (len(mine) - 1 - j) for j in range(len(mine))]
        want = sum(w * d for w, (_, d) in zip(weights, mine)) / sum(weights)
        assert est.output_for(p) == pytest.approx(want, rel=1e-9)
    empty = next(b for b in range(1, 24) if all(q.bit_length() != b + 1 for q, _ in pairs))
    assert est.output_for(2 ** empty) == pytest.approx(est.output_tokens)

