"""Property tests of the flow-control shield (docs/SAFETY.md): whatever the inner controller
proposes, strict mode never evicts, KV never exceeds capacity, and every request ends exactly
once; soft mode keeps evictions within its stated bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidegate.ctrl.base import (
    RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, UNLIMITED, Controller, Decision, Observation, Rejection,
)
from tidegate.ctrl.flow import FlowController
from tidegate.ctrl.greedy import GreedyController
from tidegate.ctrl.shield import EVICTION_REFILL_MAX, ShieldedController
from tidegate.ctrl.theory import BURST_USAGE, lifetime_kv_workload
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.request import RequestState
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import Arrival
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
    seqs_max = shield.limits(core.obs)[0]
    for _ in range(max_steps):
        now = core.clock.now()
        while pending and pending[0].arrival_time_s <= now:
            core.add_request(pending.pop(0))
        if not (core.waiting or core.running or core.scheduler.to_cancel):
            if not pending:
                break
            core.clock.advance_to(pending[0].arrival_time_s)
            continue
        core.step()
        assert core.pool.used_tokens <= core.pool.capacity_tokens
        if shield.mode == "strict":
            assert core.metrics.evictions == 0
            # the stronger invariant behind it: the running set's full reservation fits
            assert sum(core.scheduler.reservation(r, 1.0) for r in core.running) <= core.pool.capacity_tokens
        else:  # docs/SAFETY.md: evictions <= B + r*T + N_max after any T steps (r*T: the refills so far)
            bound = shield.eviction_burst + shield.refilled + seqs_max
            assert core.metrics.evictions <= bound + 1e-9
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
    n_max = shield.limits(core.obs)[0]  # most running requests: min(max_num_seqs, M / block_size)
    # docs/SAFETY.md, soft mode: evictions <= B + r*T + N_max over T steps (also checked after every step)
    assert core.metrics.evictions <= burst + rate * steps + n_max


@settings(max_examples=150, **SETTINGS)
@given(arrivals=ARRIVALS, proposals=st.lists(DECISIONS, min_size=1, max_size=8),
       per_token=st.sampled_from([0.0, 1e-5, 1e-3]), per_recompute=st.sampled_from([0.0, 1e-3]),
       share=st.floats(0.001, 1.0), burst=st.floats(1.0, 5.0))
def test_soft_bounds_evictions_by_their_cost(arrivals, proposals, per_token, per_recompute, share, burst):
    """With ``eviction_cost`` the refill follows an eviction's recomputation: the bound holds with the refills
    made (at most EVICTION_REFILL_MAX a step), and a prefill that takes no time refills the most."""
    shield = ShieldedController(Adversary(proposals), mode="soft", queue_timeout_s=50.0, eviction_burst=burst,
                                eviction_cost=(per_token, per_recompute), eviction_time_share=share)
    core = run_episode(shield, arrivals)
    n_max = shield.limits(core.obs)[0]
    assert shield.refilled <= EVICTION_REFILL_MAX * core.metrics.steps
    assert core.metrics.evictions <= burst + shield.refilled + n_max


def test_the_eviction_refill_is_what_a_share_of_a_step_buys_in_recomputation():
    shield = ShieldedController(GreedyController(), mode="soft", eviction_cost=(1e-4, 2e-3), eviction_time_share=0.03)
    obs = Observation(kv_capacity_tokens=4096)
    assert shield.eviction_refill(obs) == 0.0  # no step timed yet: nothing refills
    obs.mean_step_time_s, obs.kv_used_tokens, obs.num_running = 0.02, 4000, 4
    # an eviction recomputes the mean request's 1,000 tokens: 0.1 + 0.002 s; 3% of a 20 ms step buys 0.0059 of one
    assert shield.eviction_refill(obs) == pytest.approx(0.03 * 0.02 / 0.102)
    obs.num_running = 400  # short requests: cheap evictions, up to the cap
    assert shield.eviction_refill(obs) == pytest.approx(min(EVICTION_REFILL_MAX, 0.03 * 0.02 / 0.003))
    free = ShieldedController(GreedyController(), mode="soft", eviction_cost=(0.0, 0.0))
    assert free.eviction_refill(obs) == EVICTION_REFILL_MAX  # prefill takes no time (the slot model)
    assert ShieldedController(GreedyController(), mode="soft").eviction_refill(obs) == 0.01  # the fixed rate
    for bad in ((-1.0, 0.0), (0.0,)):
        with pytest.raises(ValueError, match="eviction_cost"):
            ShieldedController(GreedyController(), mode="soft", eviction_cost=bad)


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
        core.add_request(req(i, 4, 4, max_tokens=64))
    obs = core._observe(0.0)
    safe = shield.safe_budget(obs)
    # w = 4*16 + (16 + 256)/2 = 200: b_safe = 0.9 * 128 / 200
    assert math.isclose(safe, 0.9 * 128 / 200)
    d = shield.decide(obs)
    # a burst into free memory: requests of peak 4 + 16 tokens that fit below 0.9 x 128
    assert d.activation_budget == int(BURST_USAGE * 0.9 * 128 / 20) == 5
    assert shield.last_intervention.safe_activation_budget == safe
    obs.kv_used_tokens, obs.num_running = 112, 5  # memory above rho M: only the safe rate (with credit) is left
    assert shield.decide(obs).activation_budget == int(0.0 + safe) == 0


def test_before_the_first_completion_the_shield_paces_by_the_longest_output_an_arrival_may_run():
    """No output runs past its max_tokens: with every arrival asking for 20 tokens, the prior's 128 would pace Dong
    & Cao's slot model six times slower than 0.7 x its bound until the first completion, and the queue built up then
    started at once into the memory the running requests were about to take (11 evictions, TTFT p99 12 slots)."""
    shield = ShieldedController(GreedyController(), mode="soft", prior_output_tokens=128)
    core = make_engine(shield, capacity=2000, block_size=1)
    for i in range(4):
        core.add_request(req(i, 20, 20, max_tokens=20))
    assert math.isclose(shield.safe_budget(core._observe(0.0)), 0.9 * 2000 / lifetime_kv_workload(20, 20))
    core.add_request(req(4, 20, 20, max_tokens=500))  # one that may run past the prior: the prior again
    assert math.isclose(shield.safe_budget(core._observe(0.0)), 0.9 * 2000 / lifetime_kv_workload(20, 128))

    slot = load_profile("slot")
    per_slot = 0.7 * slot.kv_capacity_tokens / lifetime_kv_workload(20, 20)
    arrivals = [Arrival(i / per_slot, 20, 20, 20, 0) for i in range(int(300 * per_slot))]
    summary = simulate(arrivals, slot, ShieldedController(GreedyController(), mode="soft")).summary
    assert summary["evictions"] == 0 and summary["rejected"] == 0
    assert summary["ttft_p99_s"] <= 2.5


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
    class Broken(Controller):
        name = "broken"

        def decide(self, obs):
            raise ZeroDivisionError("boom")

        def admit(self, obs, prompt_tokens, max_tokens):
            raise KeyError("nope")

    shield = ShieldedController(Broken(), max_num_seqs=8, max_num_batched_tokens=64)
    obs = Observation(kv_capacity_tokens=1024, block_size=16)
    obs.num_waiting = 3
    with caplog.at_level("WARNING", logger="tidegate.ctrl.shield"):
        for _ in range(5):
            d = shield.decide(obs)
            assert shield.admit(obs, 10, 10) is None
    assert d.activation_budget == 1  # liveness: nothing runs, something waits
    assert shield.inner_errors == {"inner controller's decide() raised ZeroDivisionError": 5,
                                   "inner controller's admit() raised KeyError": 5}
    assert len(caplog.records) == 2  # once per cause, not once per call
    shield.reset()
    assert shield.inner_errors == {}


# ---------------------------------------------------------------------- hostile inner controllers
class RaisingFloat:
    """A number-like object whose conversions raise."""

    def __float__(self):
        raise ArithmeticError("no float")

    def __index__(self):
        raise ArithmeticError("no index")

    def __int__(self):
        raise ArithmeticError("no int")


class RaisingDecision(Decision):
    """A Decision whose activation budget is a property that raises."""

    __slots__ = ()

    @property
    def activation_budget(self):
        raise RuntimeError("property")

    @activation_budget.setter
    def activation_budget(self, value):
        pass


class Exploding:
    """Any attribute read raises something other than AttributeError."""

    def __getattr__(self, name):
        raise LookupError(name)


class BadValues:
    def values(self):
        raise ValueError("no values")


class Hostile(Controller):
    """Answers whatever it is given: a Decision built from ``fields``, or ``decision`` as is, and
    ``answer`` to every arrival; ``raises`` names the methods that raise."""

    name = "hostile"

    def __init__(self, fields=None, decision=None, answer=None, raises=(), state=None) -> None:
        super().__init__()
        self.fields, self.decision, self.answer, self.raises, self.state = fields, decision, answer, raises, state

    def _maybe_raise(self, call):
        if call in self.raises:
            raise OSError(call)

    def decide(self, obs):
        self._maybe_raise("decide")
        if self.fields is None:
            return self.decision
        d = Decision()
        for k, v in self.fields.items():
            setattr(d, k, v)
        return d

    def admit(self, obs, prompt_tokens, max_tokens):
        self._maybe_raise("admit")
        return self.answer

    def reset(self):
        self._maybe_raise("reset")

    def use_wall_clock(self):
        self._maybe_raise("use_wall_clock")

    def admission_state(self):
        self._maybe_raise("admission_state")
        return self.state

    def set_admission_state(self, state):
        self._maybe_raise("set_admission_state")
        self.state = state


def busy_obs(**fields) -> Observation:
    obs = Observation(kv_capacity_tokens=1024, block_size=16)
    obs.num_waiting, obs.num_running, obs.kv_used_tokens = 4, 0, 0
    for k, v in fields.items():
        setattr(obs, k, v)
    return obs


def assert_safe(d: Decision, seqs_max: int = 64, tokens_max: int = 1024) -> None:
    assert type(d.activation_budget) is int and 0 <= d.activation_budget <= UNLIMITED
    assert type(d.running_cap) is int and 1 <= d.running_cap <= seqs_max
    assert type(d.token_budget) is int and 1 <= d.token_budget <= tokens_max
    assert d.kv_reserve_ratio is None or type(d.kv_reserve_ratio) is float and 0.0 <= d.kv_reserve_ratio <= 1.0
    assert d.class_budgets is None
    assert d.late_after_s is None or type(d.late_after_s) is float and d.late_after_s >= 0.0


def test_observation_copy_copies_every_slot_into_the_object_given():
    src = Observation()
    for i, name in enumerate(Observation.FIELDS):
        setattr(src, name, i + 0.5)
    scratch = Observation()
    assert src.copy(scratch) is scratch and scratch.as_dict() == src.as_dict()
    fresh = src.copy()
    assert fresh is not src and type(fresh) is Observation and fresh.as_dict() == src.as_dict()


HOSTILE_FIELDS = [
    {"activation_budget": 10 ** 400, "token_budget": -10 ** 400, "running_cap": 10 ** 400},
    {"activation_budget": np.array([1, 2]), "token_budget": np.array([3.0, 4.0]), "kv_reserve_ratio": np.array([])},
    {"activation_budget": RaisingFloat(), "running_cap": RaisingFloat(), "kv_reserve_ratio": RaisingFloat()},
    {"activation_budget": np.float64("nan"), "token_budget": np.int64(5), "kv_reserve_ratio": float("-inf")},
    {"activation_budget": "lots", "token_budget": object(), "running_cap": [1], "kv_reserve_ratio": "half"},
    {"class_budgets": {0: 10 ** 400, 1: float("inf"), 2: RaisingFloat()}},
    {"class_budgets": BadValues()},
    {"class_budgets": {i: 1 for i in range(100_000)}},
    {"class_budgets": [3, 4]},
    {"late_after_s": float("nan")}, {"late_after_s": -1.0}, {"late_after_s": "soon"}, {"late_after_s": RaisingFloat()},
    {"late_after_s": np.array([1.0, 2.0])}, {"late_after_s": True},
]


@pytest.mark.parametrize("mode", ["strict", "soft"])
@pytest.mark.parametrize("fields", HOSTILE_FIELDS)
def test_nothing_a_proposal_holds_escapes_the_shield(fields, mode):
    shield = ShieldedController(Hostile(fields), mode=mode, max_num_seqs=64)
    obs = busy_obs()
    for _ in range(3):
        assert_safe(shield.decide(obs))
    assert shield.decide(obs).activation_budget >= 1  # liveness: something waits, nothing runs
    assert shield.decisions == 4 and shield.last_intervention.changed


@pytest.mark.parametrize("make", [lambda: None, lambda: 7, lambda: "decision", Exploding])
def test_unreadable_decisions_count_and_fall_back(make):
    decision = make()
    shield = ShieldedController(Hostile(decision=decision), mode="soft", max_num_seqs=64)
    d = shield.decide(busy_obs())
    assert_safe(d)
    assert d.activation_budget == 1 and d.kv_reserve_ratio == 1.0  # no proposal: only the liveness floor
    assert sum(shield.inner_errors.values()) >= 1


def test_conversion_failures_are_counted_by_cause():
    shield = ShieldedController(Hostile({"activation_budget": RaisingFloat(), "class_budgets": None}))
    for _ in range(3):
        shield.decide(busy_obs())
    assert shield.inner_errors == {"inner controller's decide().activation_budget raised ArithmeticError": 3}
    shield = ShieldedController(Hostile(decision=RaisingDecision(5, 64, 8, 0.5)), mode="soft", max_num_seqs=64)
    d = shield.decide(busy_obs())
    assert (d.activation_budget, d.token_budget, d.running_cap, d.kv_reserve_ratio) == (1, 64, 8, 0.5)
    assert shield.inner_errors == {"inner controller's decide().activation_budget raised RuntimeError": 1}
    shield = ShieldedController(Hostile(decision=Exploding()))
    shield.decide(busy_obs())
    assert shield.inner_errors == {"inner controller's decide() returned Exploding": 1}
    shield = ShieldedController(Hostile(decision=None))
    shield.decide(busy_obs())
    assert shield.inner_errors == {"inner controller's decide() returned NoneType": 1}


@pytest.mark.parametrize("answer", [True, False, 0, "no", {"reason": "busy"}, [Rejection("x", 2.0)], 3.5])
def test_an_admission_answer_that_is_not_a_rejection_accepts_and_counts(answer):
    shield = ShieldedController(Hostile(answer=answer))
    assert shield.admit(busy_obs(), 10, 10) is None
    assert shield.inner_errors == {f"inner controller's admit() returned {type(answer).__name__}": 1}
    assert shield.rejections == 0


class ReasonOnly:
    reason = "busy"


class RaisingWait(Rejection):
    __slots__ = ()

    @property
    def retry_after_s(self):
        raise ZeroDivisionError("wait")

    @retry_after_s.setter
    def retry_after_s(self, value):
        pass


@pytest.mark.parametrize("answer", [
    Rejection("busy", float("nan")), Rejection("busy", float("inf")), Rejection("busy", -3.0),
    Rejection("busy", "soon"), Rejection("busy", 10 ** 400), Rejection("busy", np.array([1.0, 2.0])),
    Rejection(None, 5.0), Rejection(12, RaisingFloat()), Rejection("x" * 10_000, 0.0), ReasonOnly(),
    RaisingWait("busy", 5.0)])
def test_a_refusal_is_always_a_clean_rejection(answer):
    obs = busy_obs(completion_rate_rps=2.0)
    got = ShieldedController(Hostile(answer=answer)).admit(obs, 10, 10)
    assert type(got) is Rejection and got is not answer
    assert type(got.reason) is str and 0 < len(got.reason) <= 200
    assert type(got.retry_after_s) is float and RETRY_AFTER_MIN_S <= got.retry_after_s <= RETRY_AFTER_MAX_S


def test_a_good_refusal_keeps_its_reason_and_retry_after():
    got = ShieldedController(Hostile(answer=Rejection("slow down", 7.5))).admit(busy_obs(), 10, 10)
    assert (got.reason, got.retry_after_s) == ("slow down", 7.5)


def test_every_inner_call_is_absorbed():
    calls = ("decide", "admit", "reset", "use_wall_clock", "admission_state", "set_admission_state")
    shield = ShieldedController(Hostile({"activation_budget": 2}, raises=calls))
    shield.use_wall_clock()
    assert_safe(shield.decide(busy_obs()))
    assert shield.admit(busy_obs(), 10, 10) is None
    assert shield.admission_state() is None
    shield.set_admission_state({"x": 1})
    assert set(shield.inner_errors) == {f"inner controller's {c}() raised OSError" for c in calls}
    shield.reset()
    assert shield.inner_errors == {"inner controller's reset() raised OSError": 1}


def test_admission_state_passes_through_to_the_inner_controller():
    engine_side = ShieldedController(Hostile({"activation_budget": 2}, state=(3, 0.25)))
    server_side = ShieldedController(Hostile({"activation_budget": 2}))
    assert Controller().admission_state() is None
    server_side.set_admission_state(engine_side.admission_state())
    assert server_side.inner.state == (3, 0.25) and server_side.inner_errors == {}


class Tamperer(Controller):
    """Rewrites the Observation it is given to talk the shield out of its safety rules."""

    name = "tamperer"

    def decide(self, obs):
        obs.evictions_total = 0
        obs.num_running = 1
        obs.num_waiting = 0
        obs.kv_used_tokens = 0
        obs.kv_capacity_tokens = 10 ** 9
        obs.__class__ = TamperedObservation
        return Decision(0, 10 ** 6, 10 ** 6, 0.0)

    def admit(self, obs, prompt_tokens, max_tokens):
        obs.num_waiting = 0
        obs.evictions_total = 0
        return None


class TamperedObservation(Observation):
    __slots__ = ()

    @property
    def now_s(self):
        raise RuntimeError("tampered")

    @now_s.setter
    def now_s(self, value):
        raise RuntimeError("tampered")


def test_the_inner_controller_cannot_rewrite_what_the_shield_reads():
    shield = ShieldedController(Tamperer(), mode="soft", max_num_seqs=64, eviction_burst=2.0, max_waiting=10)
    obs = busy_obs(evictions_total=5)  # the engine has seen 5 evictions: the bucket of 2 is empty
    before = obs.as_dict()
    for _ in range(3):
        d = shield.decide(obs)
        assert d.activation_budget == 1  # liveness floor from the engine's num_running = 0
        assert d.kv_reserve_ratio == 1.0  # strict while the bucket refills
        assert d.running_cap == 64 and d.token_budget == 1024  # limits from the engine's capacity
    obs.num_waiting = 10
    assert isinstance(shield.admit(obs, 10, 10), Rejection)  # the engine's queue is full
    obs.num_waiting = 4
    assert shield.admit(obs, 10, 10) is None
    assert obs.as_dict() == before  # the engine's Observation is untouched
    assert shield.inner_errors == {}


def test_soft_mode_is_strict_exactly_while_the_eviction_bucket_is_spent():
    shield = ShieldedController(GreedyController(), mode="soft", max_num_seqs=8, eviction_burst=2.0,
                                eviction_budget_per_step=0.5)
    obs = Observation(kv_capacity_tokens=4096)
    ratios = []
    for evictions in (0, 3, 3, 3, 3, 3, 3):  # three evictions at once, then none
        obs.evictions_total = evictions
        ratios.append(shield.decide(obs).kv_reserve_ratio)
    # bucket: 2, -1, -0.5, 0, 0.5, 1, 1.5: strict (ratio 1) while at or below 0, then greedy's own ratio again
    assert ratios[1:4] == [1.0, 1.0, 1.0]
    assert ratios[0] == ratios[4] == ratios[5] == ratios[6] != 1.0


@pytest.mark.parametrize("late, passed", [(2.0, 2.0), (0.0, 0.0), (3, 3.0), (np.float32(1.5), 1.5),
                                          (float("inf"), float("inf")), (None, None), (float("nan"), None),
                                          (-1.0, None), (True, None), ("soon", None)])
def test_the_prefill_order_passes_the_shield_as_proposed_or_not_at_all(late, passed):
    """``late_after_s`` only orders prefill chunks within the token budget: no bound depends on it,
    so a usable value passes unchanged, anything else is no order."""
    shield = ShieldedController(Hostile({"late_after_s": late}), mode="soft", max_num_seqs=64)
    assert shield.decide(busy_obs()).late_after_s == passed
