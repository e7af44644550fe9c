"""Property tests of the flow-control shield (docs/SAFETY.md): whatever the inner controller
proposes, strict mode never evicts, KV never exceeds capacity, and every request ends exactly
once; soft mode keeps evictions within its stated bound."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctrl.base import UNLIMITED, Controller, Decision
from ctrl.flow import FlowController
from ctrl.greedy import GreedyController
from ctrl.shield import ShieldedController
from engine.core.request import RequestState
from tests.helpers import make_engine, req

NUMBERS = st.one_of(
    st.integers(-10, 10), st.integers(-UNLIMITED, UNLIMITED), st.just(UNLIMITED), st.just(0),
    st.floats(allow_nan=True, allow_infinity=True), st.just(float("nan")), st.just(float("inf")),
    st.just(-float("inf")), st.none(), st.just("many"))
RATIOS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.just(0.0), st.just(-1.0))
CLASSES = st.one_of(st.none(), st.dictionaries(st.integers(0, 2), NUMBERS, max_size=3))
DECISIONS = st.builds(lambda a, t, c, r, k: (a, t, c, r, k), NUMBERS, NUMBERS, NUMBERS, RATIOS, CLASSES)
ARRIVALS = st.lists(st.tuples(st.floats(0, 30), st.integers(1, 40), st.integers(1, 40), st.integers(0, 30)),
                    min_size=1, max_size=25)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Adversary(Controller):
    """Replays a list of raw proposals (anything: huge, negative, NaN, not numbers), and may raise."""

    name = "adversary"

    def __init__(self, proposals, raise_every: int = 0) -> None:
        super().__init__()
        self.proposals = proposals
        self.raise_every = raise_every
        self.i = 0

    def reset(self) -> None:
        self.i = 0

    def decide(self, obs):
        self.i += 1
        if self.raise_every and self.i % self.raise_every == 0:
            raise RuntimeError("policy failed")
        a, t, c, r, k = self.proposals[self.i % len(self.proposals)]
        d = Decision.__new__(Decision)
        d.activation_budget, d.token_budget, d.running_cap, d.kv_reserve_ratio, d.class_budgets = a, t, c, r, k
        return d


def run_episode(shield: ShieldedController, arrivals, capacity: int = 128, block_size: int = 4,
                max_steps: int = 5_000):
    """Replay ``arrivals`` ((time, prompt, output, extra max_tokens) tuples) and check the invariants
    after every step; returns the engine."""
    core = make_engine(shield, capacity=capacity, block_size=block_size)
    shield.reset()
    reqs = []
    for i, (t, prompt, out, extra) in enumerate(sorted(arrivals)):
        max_tokens = out + extra
        reqs.append(req(i, prompt, out, max_tokens=max_tokens, arrival=t))
    pending = list(reqs)
    for _ in range(max_steps):
        now = core.clock.now()
        while pending and pending[0].arrival_time_s <= now:
            core.add_request(pending.pop(0))
        if not (core.waiting or core.running or core._cancel):
            if not pending:
                break
            core.clock.advance_to(pending[0].arrival_time_s)
            continue
        core.step()
        assert core.pool.used_tokens <= core.pool.capacity_tokens
        if shield.mode == "strict":
            assert core.metrics.evictions == 0
            # the stronger invariant behind it: the running set's full reservation fits
            assert sum(core._reservation(r, 1.0) for r in core.running) <= core.pool.capacity_tokens
    else:
        raise AssertionError("the engine did not drain under the shield")
    # every request reaches exactly one terminal state, exactly once
    ids = [r.request_id for r in core.metrics.terminal]
    assert len(ids) == len(set(ids)) == len(reqs)
    assert all(r.state.is_terminal for r in reqs)
    return core


@settings(max_examples=500, **SETTINGS)
@given(arrivals=ARRIVALS, proposals=st.lists(DECISIONS, min_size=1, max_size=8),
       raise_every=st.integers(0, 5))
def test_strict_never_evicts_under_adversarial_proposals(arrivals, proposals, raise_every):
    shield = ShieldedController(Adversary(proposals, raise_every), mode="strict", queue_timeout_s=50.0,
                                max_waiting=20)
    run_episode(shield, arrivals)
    assert 0.0 <= shield.intervention_rate <= 1.0


@settings(max_examples=300, **SETTINGS)
@given(arrivals=ARRIVALS, budget=st.one_of(st.floats(0, 1e6), st.just(float(UNLIMITED))),
       token_budget=st.integers(1, 10_000), seqs=st.integers(1, 10_000), block_size=st.sampled_from([1, 4, 16]))
def test_strict_wraps_heuristics_without_evictions(arrivals, budget, token_budget, seqs, block_size):
    inner = FlowController(budget=min(budget, 1e6), max_num_batched_tokens=token_budget, max_num_seqs=seqs)
    shield = ShieldedController(inner, mode="strict", queue_timeout_s=40.0)
    run_episode(shield, arrivals, capacity=128, block_size=block_size)


@settings(max_examples=250, **SETTINGS)
@given(arrivals=ARRIVALS, proposals=st.lists(DECISIONS, min_size=1, max_size=8),
       rate=st.floats(0.0, 0.2), burst=st.floats(1.0, 5.0))
def test_soft_bounds_evictions(arrivals, proposals, rate, burst):
    shield = ShieldedController(Adversary(proposals), mode="soft", queue_timeout_s=50.0,
                                eviction_budget_per_step=rate, eviction_burst=burst)
    core = run_episode(shield, arrivals)
    steps = core.metrics.steps
    seqs = max(1, core.pool.num_blocks)  # running cap bound: one block per request
    # docs/SAFETY.md: evictions <= B + r*T + (entries into strict) * N_max, entries <= 1 + r*T/B
    bound = burst + rate * steps + (1 + rate * steps / burst) * seqs + seqs
    assert core.metrics.evictions <= bound


@settings(max_examples=50, **SETTINGS)
@given(arrivals=ARRIVALS)
def test_greedy_inside_soft_shield_is_live(arrivals):
    """Greedy proposes unlimited everything: the shield clamps and everything still ends."""
    shield = ShieldedController(GreedyController(), mode="soft", queue_timeout_s=50.0)
    run_episode(shield, arrivals)


def test_decision_is_clamped_and_reported():
    shield = ShieldedController(Adversary([(float("nan"), -5, float("inf"), float("nan"), None)]),
                                mode="strict", max_num_seqs=8, max_num_batched_tokens=64)
    core = make_engine(shield, capacity=128, block_size=4)
    obs = core._observe(0.0)
    d = shield.decide(obs)
    assert d.activation_budget == 0 and d.token_budget == 1 and d.running_cap == 8
    assert d.kv_reserve_ratio == 1.0 and d.class_budgets is None
    iv = shield.last_intervention
    assert iv.changed and set(iv.fields) == {"activation_budget", "token_budget", "running_cap",
                                             "kv_reserve_ratio"}
    assert iv.magnitude > 0 and shield.intervention_rate == 1.0


def test_safe_budget_caps_activations():
    shield = ShieldedController(Adversary([(10 ** 9, 64, 64, 1.0, None)]), mode="strict",
                                prior_output_tokens=16)
    core = make_engine(shield, capacity=128, block_size=4)
    for i in range(30):
        core.add_request(req(i, 4, 4, max_tokens=4))
    obs = core._observe(0.0)
    safe = shield.safe_budget(obs)
    # w = 4*16 + (16 + 256)/2 = 200: b_safe = 0.9 * 128 / 200
    assert math.isclose(safe, 0.9 * 128 / 200)
    d = shield.decide(obs)
    # a burst into free memory: requests of peak 4 + 16 tokens that fit below half of 0.9 x 128
    assert d.activation_budget == int(0.5 * 0.9 * 128 / 20) == 2
    assert shield.last_intervention.safe_activation_budget == safe
    obs.kv_used_tokens, obs.num_running = 112, 5  # memory above rho M: only the safe rate (with credit) is left
    assert shield.decide(obs).activation_budget == int(0.0 + safe) == 0


def test_overload_policy_always_on():
    shield = ShieldedController(GreedyController(), max_waiting=3, queue_timeout_s=5.0)
    assert shield.queue_timeout_s == 5.0
    core = make_engine(shield, capacity=128, block_size=4)
    out = [core.add_request(req(i, 4, 4)) for i in range(5)]
    assert out[:3] == [None] * 3
    assert all(r is not None and r.retry_after_s > 0 for r in out[3:])
    assert shield.rejections == 2
    inner = GreedyController(max_waiting=2, queue_timeout_s=1.0)
    assert ShieldedController(inner).max_waiting == 2
    assert ShieldedController(inner).queue_timeout_s == 1.0


def test_bad_options_raise_one_sentence():
    import pytest

    with pytest.raises(ValueError, match="shield mode must be one of"):
        ShieldedController(GreedyController(), mode="loose")
    with pytest.raises(ValueError, match="always on"):
        ShieldedController(GreedyController(), queue_timeout_s=None)


def test_expired_and_finished_are_terminal_states():
    shield = ShieldedController(Adversary([(0, 1, 1, None, None)]), mode="strict", queue_timeout_s=3.0)
    core = run_episode(shield, [(0.0, 8, 8, 0), (0.0, 8, 8, 0), (0.0, 8, 8, 0)])
    states = {r.state for r in core.metrics.terminal}
    assert states <= {RequestState.FINISHED, RequestState.EXPIRED}


def test_shield_counts_and_logs_once_every_exception_it_absorbs(caplog):
    from ctrl.base import Controller, Observation
    from ctrl.shield import ShieldedController

    class Broken(Controller):
        name = "broken"

        def decide(self, obs):
            raise ZeroDivisionError("boom")

        def admit(self, obs, prompt_tokens, max_tokens):
            raise KeyError("nope")

    shield = ShieldedController(Broken(), max_num_seqs=8, max_num_batched_tokens=64)
    obs = Observation(kv_capacity_tokens=1024, block_size=16)
    obs.num_waiting = 3
    with caplog.at_level("WARNING", logger="ctrl.shield"):
        for _ in range(5):
            d = shield.decide(obs)
            assert shield.admit(obs, 10, 10) is None
    assert d.activation_budget == 1  # liveness: nothing runs, something waits
    assert shield.inner_errors == {"inner controller's decide() raised ZeroDivisionError": 5,
                                   "inner controller's admit() raised KeyError": 5}
    assert len(caplog.records) == 2  # once per cause, not once per call
    shield.reset()
    assert shield.inner_errors == {}
