"""Fuzz campaign for the flow-control shield (docs/SAFETY.md): hostile inner controllers x hostile
workloads x both shield modes, with the shield's and the engine's invariants checked at every step.

Inner controllers propose anything (small, huge, negative, NaN and infinite numbers, ints beyond the
float range, numpy arrays, objects whose conversions or attributes raise, garbage class budgets),
answer arrivals with anything (bad retry-afters, non-str reasons, True, strings, dicts), rewrite the
Observation they are given and raise from every call. Workloads use block sizes 1-32 and 1-200
blocks, prompts and max_tokens up to the capacity, bursts, heavy tails and cancellations, on an
executor that sometimes raises.

Every episode is a pure function of its seed and mode: ``Episode(random.Random(seed), mode).run()``
replays a failure, whose message names both.
"""

from __future__ import annotations

import itertools
import math
import random
from decimal import Decimal
from fractions import Fraction

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation, Rejection
from tidegate.ctrl.shield import ShieldedController
from tidegate.engine.core.builder import build_engine
from tidegate.engine.core.clock import VirtualClock
from tidegate.engine.core.request import Request
from tidegate.engine.sim.executor import SimExecutor
from tests.helpers import step_profile

MODES = ("strict", "soft")
EPISODES_PER_MODE = 1000
ERRORS = (RuntimeError, ValueError, ZeroDivisionError, KeyError, OverflowError, MemoryError, ArithmeticError)


# ---------------------------------------------------------------------- hostile values
class RaisingFloat:
    def __float__(self):
        raise ArithmeticError("__float__")

    def __int__(self):
        raise ArithmeticError("__int__")

    def __index__(self):
        raise ArithmeticError("__index__")


class RaisingIndex:
    """No __float__: float() falls back to __index__, which raises."""

    def __index__(self):
        raise LookupError("__index__")


class OverflowingThing:
    """Overflows on conversion and then refuses to be compared."""

    def __float__(self):
        raise OverflowError("too big")

    def __gt__(self, other):
        raise TypeError("no order")


class Exploding:
    def __getattr__(self, name):
        raise LookupError(name)


class RaisingDecision(Decision):
    __slots__ = ()

    @property
    def token_budget(self):
        raise RuntimeError("token_budget")

    @token_budget.setter
    def token_budget(self, value):
        pass


class EndlessValues:
    def values(self):
        return itertools.repeat(1)


class RaisingValues:
    def values(self):
        raise KeyError("values")


class ReasonOnly:
    reason = "busy"
    retry_after_s = float("nan")


class TamperedObservation(Observation):
    __slots__ = ()

    @property
    def kv_used_tokens(self):
        raise RuntimeError("tampered")

    @kv_used_tokens.setter
    def kv_used_tokens(self, value):
        raise RuntimeError("tampered")


NUMBERS = [
    lambda r: r.randint(-3, 60), lambda r: UNLIMITED, lambda r: 10 ** r.randint(19, 400),
    lambda r: -(10 ** r.randint(1, 400)), lambda r: math.nan, lambda r: math.inf, lambda r: -math.inf,
    lambda r: r.uniform(-1e6, 1e6), lambda r: 1e300, lambda r: np.int64(r.randint(-5, 100)),
    lambda r: np.float64(r.choice([math.nan, math.inf, 3.5])), lambda r: np.array([1, 2, 3]),
    lambda r: np.array(r.randint(0, 9)), lambda r: np.array([]), lambda r: RaisingFloat(),
    lambda r: RaisingIndex(), lambda r: OverflowingThing(), lambda r: Fraction(10 ** 400, 3),
    lambda r: Decimal("sNaN"), lambda r: str(r.randint(0, 50)), lambda r: "many", lambda r: None,
    lambda r: True, lambda r: complex(1, 2), lambda r: [1], lambda r: object(),
]
CLASS_BUDGETS = [
    lambda r: {k: r.choice(NUMBERS)(r) for k in range(r.randint(0, 3))}, lambda r: EndlessValues(),
    lambda r: RaisingValues(), lambda r: [1, 2], lambda r: {k: 1 for k in range(5000)},
]
ODD_DECISIONS = [lambda r: None, lambda r: 7, lambda r: "go", lambda r: Exploding(), lambda r: [Decision()],
                 lambda r: RaisingDecision(3, 64, 8, 0.5)]
ODD_ANSWERS = [
    lambda r: Rejection("busy", r.choice(NUMBERS)(r)), lambda r: Rejection(r.choice(NUMBERS)(r), 5.0),
    lambda r: Rejection("x" * 5000, 2.0), lambda r: True, lambda r: False, lambda r: "no",
    lambda r: {"reason": "full"}, lambda r: 0, lambda r: ReasonOnly(), lambda r: Exploding(),
    lambda r: Rejection("slow down", r.uniform(1.0, 60.0)),
]


def tamper(obs: Observation, r) -> None:
    """What an inner controller may do to the Observation it is given."""
    what = r.randrange(6)
    if what == 0:
        obs.evictions_total = 0  # would refill the soft-mode eviction bucket
    elif what == 1:
        obs.num_running, obs.num_waiting = 1, 0  # would switch the liveness floor off
    elif what == 2:
        obs.kv_capacity_tokens, obs.kv_used_tokens, obs.block_size = 10 ** 9, 0, 0
    elif what == 3:
        obs.lifetime_kv_workload, obs.completed_total, obs.mean_output_tokens = math.nan, 5, -1.0
    elif what == 4:
        obs.__class__ = TamperedObservation
    else:
        del obs.num_waiting


class HostileController(Controller):
    """Draws every answer from ``r``; ``p`` holds the episode's probabilities of each misbehaviour."""

    name = "hostile"

    def __init__(self, r, p: dict, max_waiting=None, queue_timeout_s=None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        self.r, self.p = r, p

    def _misbehave(self, call: str, obs=None) -> None:
        r, p = self.r, self.p
        if obs is not None and r.random() < p["tamper"]:
            tamper(obs, r)
        if r.random() < p["raise"]:
            raise r.choice(ERRORS)(call)

    def decide(self, obs):
        self._misbehave("decide", obs)
        r, p = self.r, self.p
        if r.random() < p["odd"]:
            return r.choice(ODD_DECISIONS)(r)
        if r.random() < p["greedy"]:  # everything at once, no reservation: what makes soft mode evict
            return Decision(UNLIMITED, UNLIMITED, UNLIMITED, r.choice([None, 0.0]))
        d = Decision(r.choice([r.randint(0, 50), UNLIMITED]), r.choice([r.randint(1, 300), UNLIMITED]),
                     r.choice([r.randint(1, 100), UNLIMITED]), r.choice([None, 0.0, 1.0, r.random()]))
        for name in Decision.__slots__[:4]:
            if r.random() < p["hostile"]:
                setattr(d, name, r.choice(NUMBERS)(r))
        if r.random() < p["classes"]:
            d.class_budgets = r.choice(CLASS_BUDGETS)(r)
        return d

    def admit(self, obs, prompt_tokens, max_tokens):
        self._misbehave("admit", obs)
        r = self.r
        return r.choice(ODD_ANSWERS)(r) if r.random() < self.p["refuse"] else None

    def reset(self):
        self._misbehave("reset")

    def use_wall_clock(self):
        self._misbehave("use_wall_clock")

    def admission_state(self):
        self._misbehave("admission_state")
        return self.r.choice([None, 3, {"x": 1}])

    def set_admission_state(self, state):
        self._misbehave("set_admission_state")


class RecordingShield(ShieldedController):
    """The shield, remembering the Decision it gave the engine this step."""

    applied = (0, 0, 0, None)

    def decide(self, obs):
        d = super().decide(obs)
        self.applied = (d.activation_budget, d.token_budget, d.running_cap, d.kv_reserve_ratio)
        return d


class FlakyExecutor(SimExecutor):
    """The simulator's executor, checking the step's invariants first and sometimes raising."""

    def __init__(self, profile, episode: Episode) -> None:
        super().__init__(profile)
        self.episode = episode

    def execute(self, batch):
        self.episode.check_batch(batch)
        if self.episode.r.random() < self.episode.p["executor"]:
            raise RuntimeError("device lost")
        return super().execute(batch)


# ---------------------------------------------------------------------- episodes
class Episode:
    """One engine run: a hostile workload under a shielded hostile controller (or, with
    ``shielded=False``, the hostile controller alone), checked at every step."""

    def __init__(self, r, mode: str = "strict", shielded: bool = True) -> None:
        self.r, self.mode, self.shielded = r, mode, shielded
        self.p = {"tamper": r.choice([0.0, 0.2]), "raise": r.choice([0.0, 0.02, 0.3]),
                  "odd": r.choice([0.0, 0.05, 0.3]), "hostile": r.choice([0.0, 0.1, 0.5]),
                  "classes": r.choice([0.0, 0.1]), "refuse": r.choice([0.0, 0.1, 0.5]),
                  "executor": r.choice([0.0, 0.0, 0.05]), "cancel": r.choice([0.0, 0.1]),
                  "greedy": r.choice([0.0, 0.5, 0.95])}
        if not shielded:  # alone, it reads the engine's own Observation: rewriting that is out of scope
            self.p["tamper"] = 0.0
        # a storm: many short prompts with long outputs under a greedy inner controller and a shield
        # that lets them in, the most evictions soft mode allows
        storm = r.random() < 0.25
        if storm:
            self.p.update(greedy=0.95, hostile=0.0, odd=0.0, refuse=0.0, executor=0.0)
            block_size, blocks = r.choice([1, 2, 4]), r.randint(2, 40)
        else:
            block_size = r.choice([1, 2, 3, 4, 7, 16, 32, r.randint(1, 32)])
            blocks = r.choice([1, 2, 5, r.randint(1, 40), r.randint(1, 200)])
        self.capacity = capacity = block_size * blocks
        self.requests = self._storm(capacity) if storm else self._workload(capacity)
        inner = HostileController(r, self.p, r.choice([None, r.randint(0, 30)]), r.choice([None, r.uniform(1, 300)]))
        if shielded:
            self.shield = RecordingShield(inner, mode=mode, **self._shield_options(storm, capacity))
            controller: Controller = self.shield
        else:
            controller = inner
        profile = step_profile(kv_capacity_tokens=capacity, block_size=block_size)
        self.finished: dict[str, int] = {}
        self.core = build_engine(profile, controller, FlakyExecutor(profile, self), VirtualClock(),
                                 on_finish=self._on_finish, record_steps=False)
        self.added: list[Request] = []
        self.terminal_state: dict[str, object] = {}
        self.outputs: dict[str, int] = {}
        self.newest_seq = -1
        self.min_excess = 0.0  # min over earlier steps t of evictions(t) - r*t (soft mode's window bound)

    def _shield_options(self, storm: bool, capacity: int) -> dict:
        r = self.r
        if storm:
            return dict(target_usage=1.0, prior_output_tokens=1, max_waiting=100, queue_timeout_s=1000.0,
                        eviction_budget_per_step=r.choice([0.0, 0.01, 0.1]), eviction_burst=r.choice([1.0, 2.0]))
        return dict(target_usage=r.choice([0.9, 1.0, r.uniform(0.05, 1.0)]),
                    prior_output_tokens=r.choice([128, 1, r.randint(1, 300)]),
                    max_num_seqs=r.choice([None, r.randint(1, 64)]),
                    max_num_batched_tokens=r.choice([None, r.randint(1, 2 * capacity)]),
                    max_waiting=r.randint(1, 40), queue_timeout_s=r.uniform(5.0, 200.0),
                    eviction_budget_per_step=r.choice([0.0, 0.01, r.uniform(0.0, 0.3)]),
                    eviction_burst=r.choice([1.0, 8.0, r.uniform(1.0, 10.0)]))

    def _storm(self, capacity: int) -> list[Request]:
        r, reqs = self.r, []
        for i in range(r.randint(5, 30)):
            prompt = r.randint(1, max(1, capacity // 8))
            max_tokens = r.randint(max(1, (capacity - prompt) // 2), max(1, capacity - prompt))
            reqs.append(Request(str(i), float(r.randint(0, 3)), prompt, max_tokens))
        reqs.sort(key=lambda q: q.arrival_time_s)
        return reqs

    def _workload(self, capacity: int) -> list[Request]:
        r = self.r
        burst = r.random() < 0.3
        reqs = []
        for i in range(r.randint(1, 12)):
            max_out = min(r.choice([8, 48, capacity]), capacity)
            shape = r.random()
            if shape < 0.15:  # at capacity: prompt + max_tokens = M
                max_tokens = r.randint(1, max_out)
                prompt = capacity - max_tokens
            elif shape < 0.3:  # heavy tail
                prompt = int(min(r.paretovariate(1.2), capacity))
                max_tokens = int(min(r.paretovariate(1.5), max_out))
            elif shape < 0.35:  # can never fit (or empty): refused at arrival
                prompt, max_tokens = r.choice([(capacity, 1), (0, 1), (1, capacity + 1)])
            elif shape < 0.6 and capacity <= 300:  # long outputs that together outgrow the KV
                prompt = r.randint(1, max(1, capacity // 4))
                max_tokens = max(1, r.randint((capacity - prompt) // 2, capacity - prompt))
            else:
                prompt = r.randint(1, max(1, min(64, capacity - 1)))
                max_tokens = r.randint(1, max(1, min(max_out, capacity - prompt)))
            target = r.choice([None, r.randint(1, max(1, max_tokens)), max_tokens + 5])
            arrival = 0.0 if burst else r.uniform(0.0, 30.0)
            reqs.append(Request(str(i), arrival, prompt, max_tokens, target_output_len=target))
        reqs.sort(key=lambda q: q.arrival_time_s)
        return reqs

    def _on_finish(self, request: Request) -> None:
        self.finished[request.request_id] = self.finished.get(request.request_id, 0) + 1

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        core, r, pending = self.core, self.r, list(self.requests)
        if self.shielded:
            self.shield.reset()
        # arrivals take at most 30 steps; every request then ends well within this many more
        limit = 100 + 4 * sum(q.prompt_len + q.max_tokens for q in self.requests)
        for _ in range(limit):
            now = core.clock.now()
            while pending and pending[0].arrival_time_s <= now:
                req = pending.pop(0)
                self.added.append(req)
                core.add_request(req)
                self.check_step()
            if self.added and r.random() < self.p["cancel"]:
                core.cancel(r.choice(self.added))
            if self.shielded and r.random() < 0.05:
                self.shield.set_admission_state(self.shield.admission_state())
                self.shield.use_wall_clock()
            if not core.has_unfinished:
                if not pending:
                    break
                core.clock.advance_to(pending[0].arrival_time_s)
                continue
            core.step()
            self.check_step()
        else:
            stuck = [q for q in self.added if not q.state.is_terminal]
            raise AssertionError(f"{len(stuck)} requests never ended after the arrivals stopped: {stuck}")
        assert not pending
        for q in self.requests:
            assert q.state.is_terminal, q
            assert self.finished.get(q.request_id) == 1, f"on_finish fired {self.finished.get(q.request_id)}x for {q}"

    # ------------------------------------------------------------------ invariants
    def check_batch(self, batch) -> None:
        """At execution: the step applied the shield's Decision, and an idle engine with a queue started one."""
        core = self.core
        if not self.shielded:
            return
        act, tok, cap, _ = self.shield.applied
        assert batch.num_tokens <= tok, f"a step ran {batch.num_tokens} tokens with a token budget of {tok}"
        started = sum(1 for q in core.running if q.activation_seq > self.newest_seq)
        assert started <= act, f"{started} activations with an activation budget of {act}"
        assert not started or len(core.running) <= cap
        obs = core.obs  # as the shield saw it at this step's decision
        if obs.num_waiting > 0 and obs.num_running == 0:
            assert act >= 1 and core.running, "liveness: nothing ran, something waited, nothing started"
        if self.mode == "strict":
            pool = core.pool
            reserved = sum(pool.blocks_for(q.prompt_len + q.max_tokens) for q in core.running) * pool.block_size
            assert reserved <= pool.capacity_tokens, "strict: the running set's reservation exceeds M"

    def check_step(self) -> None:
        """After every step and arrival: KV, blocks, evictions, and exactly one ending per request."""
        core, pool = self.core, self.core.pool
        assert pool.used_tokens <= pool.capacity_tokens
        held = [b for q in self.added for b in q.block_ids]
        assert len(held) == len(set(held)) and len(held) + pool.num_free_blocks == pool.num_blocks, \
            "blocks not conserved"
        metrics = core.metrics
        if self.shielded and self.mode == "strict":
            assert metrics.evictions == 0, "strict mode evicted"
        elif self.shielded:
            shield, steps = self.shield, metrics.steps
            n_max = shield.limits(core.obs)[0]
            excess = metrics.evictions - shield.eviction_budget_per_step * steps
            assert excess - self.min_excess <= shield.eviction_burst + n_max + 1e-9, \
                "soft mode: more than B + r*T + N_max evictions in T steps"
            self.min_excess = min(self.min_excess, excess)
        ended = 0
        for q in self.added:
            rid = q.request_id
            assert q.num_output_tokens >= self.outputs.get(rid, 0), "a request lost output tokens"
            self.outputs[rid] = q.num_output_tokens
            if q.state.is_terminal:
                ended += 1
                assert not q.block_ids, "a request that ended still holds KV blocks"
                assert self.terminal_state.setdefault(rid, q.state) is q.state, "a request ended twice"
                assert self.finished.get(rid) == 1, f"on_finish fired {self.finished.get(rid, 0)}x for {q}"
            else:
                assert rid not in self.finished, f"on_finish fired for a request that has not ended: {q}"
            self.newest_seq = max(self.newest_seq, q.activation_seq)
        ids = [q.request_id for q in metrics.terminal]
        assert len(ids) == len(set(ids)) == ended


def run_campaign(mode: str, seeds) -> None:
    for seed in seeds:
        try:
            Episode(random.Random(seed), mode).run()
        except Exception as exc:  # name the episode: Episode(random.Random(seed), mode).run() replays it
            raise AssertionError(f"episode seed={seed} mode={mode!r}: {type(exc).__name__}: {exc}") from exc


def test_strict_campaign():
    run_campaign("strict", range(EPISODES_PER_MODE))


def test_soft_campaign():
    run_campaign("soft", range(10 ** 6, 10 ** 6 + EPISODES_PER_MODE))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(r=st.randoms(use_true_random=False), mode=st.sampled_from(MODES))
def test_hypothesis_episodes(r, mode):
    """The same episodes with every choice drawn (and shrunk) by hypothesis."""
    Episode(r, mode).run()


def test_engine_survives_an_unshielded_hostile_controller():
    """The engine alone: whatever the controller does, no exception leaves ``step`` or
    ``add_request``, blocks are conserved and every request ends once (checked without the drain:
    an unshielded controller may legitimately never start anything)."""
    for seed in range(200):
        episode = Episode(random.Random(seed), shielded=False)
        try:
            episode.run()
        except AssertionError as exc:
            if "never ended" not in str(exc):
                raise AssertionError(f"unshielded episode seed={seed}: {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"unshielded episode seed={seed}: {type(exc).__name__}: {exc}") from exc
