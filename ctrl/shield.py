"""The flow-control shield: a controller wrapper that projects any proposed Decision onto a
safe set derived from Dong & Cao's flow-control theory (arXiv 2604.11001).

Whatever the inner controller (a learned policy, a heuristic, an adversary) proposes, the
engine only ever sees a Decision that satisfies:

- activation budget: an integer in ``[0, max(floor(credit + b_safe), burst)]`` where
  ``b_safe = rho * M / w_hat`` is the activation rate whose steady KV demand is ``rho * M``
  (``ctrl.theory.safe_activation_rate``), the credit carries fractions over, at most one step's
  worth, and ``burst`` is how many requests of the mean size fit at their peak into the free KV
  below ``BURST_USAGE * rho * M`` (``ctrl.theory.headroom_activations``: 0 once the KV is that
  full); at least 1 when nothing runs and something waits (liveness);
- running cap in ``[1, max_num_seqs]``, token budget in ``[1, max_num_batched_tokens]``;
- no class budgets (the per-class activation path ignores the KV reservation);
- ``kv_reserve_ratio = 1.0`` in strict mode (every running request's prompt + max_tokens is
  reserved, TGI's no-evict: zero evictions); in soft mode the proposal is kept while an
  eviction token bucket has tokens, and strict reservation is forced while it is empty
  (a bounded eviction rate; soft resumes as soon as the refill puts the bucket above 0);
- the overload policy is always on: arrivals are refused with a retry-after while the queue
  holds ``max_waiting`` requests, and a queue timeout expires requests that never started.

Nothing the inner controller does leaves the shield: it reads a copy of the engine's Observation
(the shield reads only the engine's own), an exception from any of its calls or from reading or
converting what it returned is absorbed and counted in ``inner_errors``, and every field it
proposes is converted to a number once (non-numbers, NaN, +-inf and ints beyond the float range
included) before the shield compares or clamps it.

The guarantee and its proof sketch are in docs/SAFETY.md.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import ClassVar

from tidegate.ctrl.base import (
    RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, UNLIMITED, Controller, Decision, Observation, Rejection, retry_after_s,
)
from tidegate.ctrl.theory import (
    BURST_USAGE, headroom_activations, prior_output, safe_activation_rate, stable_activation_rate,
)

MODES = ("strict", "soft")

#: soft mode with ``eviction_cost``: the share of engine time the evictions' recomputation may take in the long run
#: (at the A100 preset's sizes, one eviction recomputes about three steps' time: 0.01 evictions a step)
EVICTION_TIME_SHARE = 0.03
#: ... and the most evictions the bucket refills in one step, where an eviction costs (next to) no time
EVICTION_REFILL_MAX = 1.0

#: a refusal's reason is cut to this many characters (it goes into a 429 body)
MAX_REASON_CHARS = 200
#: class budgets read from a proposal at most (class ids are small; an endless mapping must not hang a step)
MAX_CLASSES = 1024
_NAN = float("nan")
_REFUSED = "refused by the controller"

log = logging.getLogger(__name__)


def eviction_cost_of(profile) -> tuple[float, float]:
    """``(seconds per recomputed token, seconds per recompute)`` of a replica's profile: an evicted request's KV
    is prefilled again (``per_token_s`` a token, ``per_prefill_s`` a chunk, 0 where the profile has none)."""
    return float(profile.per_token_s), float(getattr(profile, "per_prefill_s", 0.0) or 0.0)


def _number(value) -> float | None:
    """``value`` as a float (NaN and +-inf as they are, ints beyond the float range saturated to
    +-inf); None for None. Raises whatever converting ``value`` raises (a non-number, a raising
    ``__float__``, an array of several elements)."""
    if type(value) is float:
        return value
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:  # an int (or a fraction) beyond the float range
        return math.inf if value > 0 else -math.inf


def _within(value: float | None, default: int, high: int) -> int:
    """A converted proposal as an int in ``[1, high]``; ``default`` for None and NaN.

    Conditionals rather than ``min``/``max``: this runs twice per step and builtin calls cost more."""
    if value is None or value != value:
        return default
    if value >= high:
        return high
    if value < 1:
        return 1
    return int(value)


class Intervention:
    """How far the shield moved the last proposal.

    :param changed: whether the applied Decision differs from the proposal.
    :param fields: names of the Decision fields the shield changed.
    :param proposed_activation_budget: what the inner controller asked for, as a float (NaN: not a
        number; None: not proposed).
    :param applied_activation_budget: what the engine got.
    :param safe_activation_budget: ``b_safe = rho * M / w_hat`` this step (activations per step).
    :param magnitude: relative size of the change, ``sum |log1p(applied) - log1p(proposed)|`` over
        the numeric fields (0 when nothing changed; a non-number proposal counts 1).
    :param strict_reserve: whether ``kv_reserve_ratio = 1`` was in force.
    """

    __slots__ = ("changed", "fields", "proposed_activation_budget", "applied_activation_budget",
                 "safe_activation_budget", "magnitude", "strict_reserve")

    def __init__(self) -> None:
        self.changed = False
        self.fields: tuple[str, ...] = ()
        self.proposed_activation_budget: float | None = None
        self.applied_activation_budget = 0
        self.safe_activation_budget = 0.0
        self.magnitude = 0.0
        self.strict_reserve = False

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return f"Intervention({self.as_dict()})"


def _log_gap(proposed: float | None, applied: int) -> float:
    if proposed is None or not math.isfinite(proposed):
        return 1.0
    if proposed < 0:
        return math.log1p(applied) + 1.0 if applied > 0 else 1.0
    return abs(math.log1p(proposed) - math.log1p(applied if applied > 0 else 0))


#: ``Intervention.fields`` by which of (activation_budget, running_cap, token_budget, kv_reserve_ratio) changed
_CHANGED_FIELDS = tuple(
    tuple(name for bit, name in ((8, "activation_budget"), (4, "running_cap"), (2, "token_budget"),
                                 (1, "kv_reserve_ratio")) if key & bit)
    for key in range(16))


class ShieldedController(Controller):
    """Wraps ``inner`` and makes every Decision it proposes safe.

    :param inner: the controller whose decisions are projected (learned policy or heuristic).
    :param mode: ``strict`` (zero evictions when outputs are bounded by max_tokens) or ``soft``
        (the proposal's reserve ratio while the eviction budget lasts).
    :param target_usage: rho in ``b_safe = rho * M / w_hat``.
    :param prior_output_tokens: output length assumed for w_hat before any request completed.
    :param max_num_seqs: most running requests (None: one per KV block).
    :param max_num_batched_tokens: most new tokens per step (None: the KV capacity).
    :param max_waiting: arrivals are refused while this many requests wait (always on).
    :param queue_timeout_s: a request that waited this long without starting expires (always on).
    :param eviction_budget_per_step: soft mode: evictions the bucket refills per engine step (without
        ``eviction_cost``).
    :param eviction_burst: soft mode: bucket size; strict reservation is forced while the bucket is
        empty (at or below 0).
    :param eviction_cost: soft mode: ``(seconds per recomputed token, seconds per recompute)``, the replica's
        prefill cost (``eviction_cost_of``). With it the bucket refills each step what ``eviction_time_share`` of
        the mean step's time buys in recomputation of a request of the running requests' mean KV, at most
        ``EVICTION_REFILL_MAX``: evictions are bounded by their cost, so where prefill is cheap (Dong & Cao's slot
        model, where it takes no time) the proposal's reservation holds.
    :param eviction_time_share: see ``eviction_cost``.
    :param stable_rate: ``b_safe`` is raised to Algorithm 1's ``M / w_hat`` where the steady arrivals ask between
        rho M and M of the memory (``ctrl.theory.stable_activation_rate``); else ``rho M / w_hat`` always.
    """

    name: ClassVar[str] = "shielded"

    def __init__(self, inner: Controller, mode: str = "strict", target_usage: float = 0.9,
                 prior_output_tokens: int = 128, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_waiting: int = 1024,
                 queue_timeout_s: float = 60.0, eviction_budget_per_step: float = 0.01,
                 eviction_burst: float = 8.0, eviction_cost: tuple[float, float] | None = None,
                 eviction_time_share: float = EVICTION_TIME_SHARE, stable_rate: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"shield mode must be one of {', '.join(MODES)}, got {mode!r}")
        if max_waiting is None or queue_timeout_s is None:
            raise ValueError("the shield's overload policy is always on: max_waiting and queue_timeout_s "
                             "must be numbers")
        if not 0 < target_usage <= 1:
            raise ValueError(f"target_usage must be in (0, 1], got {target_usage}")
        if prior_output_tokens < 1:
            raise ValueError(f"prior_output_tokens must be >= 1, got {prior_output_tokens}")
        if eviction_budget_per_step < 0 or eviction_burst < 1:
            raise ValueError("need eviction_budget_per_step >= 0 and eviction_burst >= 1")
        if eviction_cost is not None and not (len(eviction_cost) == 2 and all(c >= 0 for c in eviction_cost)):
            raise ValueError(f"eviction_cost must be two seconds >= 0 (per token, per recompute), got {eviction_cost}")
        if not 0 < eviction_time_share <= 1:
            raise ValueError(f"eviction_time_share must be in (0, 1], got {eviction_time_share}")
        for n, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if v is not None and v < 1:
                raise ValueError(f"{n} must be >= 1, got {v}")
        # The tighter of the inner controller's overload options and the shield's own.
        if inner.max_waiting is not None:
            max_waiting = min(max_waiting, inner.max_waiting)
        if inner.queue_timeout_s is not None:
            queue_timeout_s = min(queue_timeout_s, inner.queue_timeout_s)
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        self.inner = inner
        self.mode = mode
        self.target_usage = target_usage
        self.prior_output_tokens = prior_output_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eviction_budget_per_step = eviction_budget_per_step
        self.eviction_burst = float(eviction_burst)
        self.eviction_cost = None if eviction_cost is None else (float(eviction_cost[0]), float(eviction_cost[1]))
        self.eviction_time_share = eviction_time_share
        self.stable_rate = stable_rate
        self.last_intervention = Intervention()
        self._late_after_s: float | None = None
        #: the inner controller's copy of the Observation, overwritten at every call
        self._scratch = Observation()
        self.reset()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        #: exceptions and unusable answers from the inner controller since the last reset, by cause
        self.inner_errors: dict[str, int] = {}
        self.decisions = 0
        self.interventions = 0
        self.magnitude_total = 0.0
        self.rejections = 0
        self._credit = 0.0
        self._bucket = self.eviction_burst
        self._evictions_seen = 0
        #: the largest ``max_tokens`` of the arrivals judged since the reset (``output_prior``)
        self._longest_allowed = 0
        #: evictions the bucket was refilled with since the reset (soft mode's bound: docs/SAFETY.md)
        self.refilled = 0.0
        try:
            self.inner.reset()
        except Exception as exc:
            self._absorb("reset()", exc)

    def use_wall_clock(self) -> None:
        try:
            self.inner.use_wall_clock()
        except Exception as exc:
            self._absorb("use_wall_clock()", exc)

    def reads_slot_wait(self) -> bool:
        try:
            return bool(self.inner.reads_slot_wait())
        except Exception as exc:
            self._absorb("reads_slot_wait()", exc)
            return True  # fill them: the inner controller may read them

    def admission_state(self):
        """The inner controller's admission state (the shield's own admission reads only the
        Observation and its options); None if the inner controller cannot give it."""
        try:
            return self.inner.admission_state()
        except Exception as exc:
            self._absorb("admission_state()", exc)
            return None

    def set_admission_state(self, state) -> None:
        try:
            self.inner.set_admission_state(state)
        except Exception as exc:
            self._absorb("set_admission_state()", exc)

    @property
    def intervention_rate(self) -> float:
        """Fraction of decisions the shield changed since the last reset."""
        return self.interventions / self.decisions if self.decisions else 0.0

    # ------------------------------------------------------------------ the safe set
    def output_prior(self, obs: Observation) -> int:
        """The output length w_hat and the burst assume before the first completion: ``prior_output_tokens``,
        or the largest ``max_tokens`` of the arrivals judged since the reset where that is less. No output runs
        past its ``max_tokens``, so the smaller still overstates every request's output (the reasoning of
        ``SloFlowController.output_prior``, ``ctrl.theory.prior_output``); the prior alone made the shield pace Dong &
        Cao's slot model (20-token outputs) six times slower than its arrivals until the first completion, and the
        queue that built up then started at once into the memory the running requests were about to take."""
        return prior_output(obs, self.prior_output_tokens, self._longest_allowed)

    def safe_budget(self, obs: Observation) -> float:
        """rho * M / w_hat activations per step: steady KV demand rho * M (Little's law on KV); with
        ``stable_rate``, Algorithm 1's M / w_hat where the steady arrivals ask between rho M and M."""
        if self.stable_rate:
            return stable_activation_rate(obs, self.target_usage, self.output_prior(obs))
        return safe_activation_rate(obs, self.target_usage, self.output_prior(obs))

    def eviction_refill(self, obs: Observation) -> float:
        """Evictions the bucket refills this step: ``eviction_budget_per_step``, or with ``eviction_cost``
        what ``eviction_time_share`` of a mean step buys in recomputation of a request holding the running
        requests' mean KV (at most ``EVICTION_REFILL_MAX``; 0 before the first step is timed)."""
        if self.eviction_cost is None:
            return self.eviction_budget_per_step
        per_token_s, per_recompute_s = self.eviction_cost
        held = obs.kv_used_tokens / obs.num_running if obs.num_running > 0 else obs.mean_prompt_tokens
        cost_s = per_token_s * held + per_recompute_s
        step_s = obs.mean_step_time_s if obs.mean_step_time_s > 0 else obs.last_step_time_s
        if cost_s <= 0:
            return EVICTION_REFILL_MAX if step_s > 0 else 0.0
        refill = self.eviction_time_share * step_s / cost_s
        return refill if refill < EVICTION_REFILL_MAX else EVICTION_REFILL_MAX

    def limits(self, obs: Observation) -> tuple[int, int]:
        """(most running requests, most new tokens per step) the pool can hold."""
        capacity, block_size = obs.kv_capacity_tokens, obs.block_size
        blocks = capacity // block_size if block_size > 1 else capacity
        if blocks < 1:
            blocks = 1
        seqs = self.max_num_seqs
        if seqs is None or seqs > blocks:
            seqs = blocks
        return seqs, self.max_num_batched_tokens or (capacity if capacity > 1 else 1)

    def _strict_now(self, obs: Observation) -> bool:
        if self.mode == "strict":
            return True
        total = obs.evictions_total
        # a counter below the last one seen belongs to a new engine: all of it is new
        new = total - self._evictions_seen if total >= self._evictions_seen else total
        self._evictions_seen = total
        burst = self.eviction_burst
        refill = self.eviction_refill(obs)
        self.refilled += refill
        b = self._bucket + refill
        b = (burst if b > burst else b) - new
        self._bucket = b
        # Strict exactly while the budget is spent. Waiting for a full bucket instead (800 steps at
        # the defaults) bounds evictions no better (docs/SAFETY.md: the proof needs strict only while
        # b <= 0) and cost slo-flow up to 23% of its goodput on bursty traffic at overload.
        return b <= 0

    def _view(self, obs: Observation) -> Observation:
        """The inner controller's copy of ``obs``: whatever it writes there, the shield and the
        engine read only the engine's own Observation."""
        try:
            return Observation.copy(obs, self._scratch)
        except Exception:  # the inner controller broke its copy (swapped its class): start a new one
            self._scratch = Observation()
            return Observation.copy(obs, self._scratch)

    # ------------------------------------------------------------------ Controller
    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        if type(max_tokens) is int and max_tokens > self._longest_allowed:
            self._longest_allowed = max_tokens
        if self.max_waiting is not None and obs.num_waiting >= self.max_waiting:
            self.rejections += 1
            return Rejection(f"queue is full ({obs.num_waiting} waiting)", retry_after_s(obs))
        try:
            answer = self.inner.admit(self._view(obs), prompt_tokens, max_tokens)
        except Exception as exc:  # a broken inner controller must not take admission down with it
            self._absorb("admit()", exc)
            return None
        if answer is None:
            return None
        return self._refusal(obs, answer)

    def _refusal(self, obs: Observation, answer) -> Rejection | None:
        """The inner controller's non-None admission answer as a fresh Rejection (reason a short
        str, retry-after a number in [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]); None (accept) when it
        is neither a Rejection nor has a ``reason``."""
        try:
            refuses = isinstance(answer, Rejection) or hasattr(answer, "reason")
            if not refuses:
                self._count(f"inner controller's admit() returned {type(answer).__name__}",
                            "expected None or a Rejection")
                return None
        except Exception as exc:
            self._absorb("admit()'s answer", exc)
            return None
        try:
            reason = getattr(answer, "reason", None)
        except Exception as exc:
            self._absorb("admit().reason", exc)
            reason = None
        reason = reason[:MAX_REASON_CHARS] if type(reason) is str and reason else _REFUSED
        try:
            wait = _number(getattr(answer, "retry_after_s", None))
        except Exception as exc:
            self._absorb("admit().retry_after_s", exc)
            wait = None
        if wait is None or not RETRY_AFTER_MIN_S <= wait <= RETRY_AFTER_MAX_S:
            # NaN, inf, negative, out of bounds or not a number: the drain-rate estimate within the bounds
            wait = retry_after_s(obs)
        self.rejections += 1
        return Rejection(reason, wait)

    def decide(self, obs: Observation) -> Decision:
        p_act, p_tok, p_cap, p_ratio, folded = self._proposal(obs)
        seqs_max, tokens_max = self.limits(obs)
        strict = self._strict_now(obs)
        safe = self.safe_budget(obs)
        act = self._activation_budget(obs, p_act, safe)
        cap = _within(p_cap, seqs_max, seqs_max)
        tok = _within(p_tok, tokens_max, tokens_max)
        ratio = 1.0 if strict else _reserve_ratio(p_ratio)

        self._report(p_act, p_cap, p_tok, p_ratio, folded, act, cap, tok, ratio, safe)
        return Decision(act, tok, cap, ratio, None, self._late_after_s)  # fresh: nobody shares a step's decision

    def _proposal(self, obs: Observation) -> tuple[float | None, float | None, float | None, float | None, bool]:
        """The inner controller's proposal, converted: (activations, tokens, cap, ratio, whether
        class budgets were folded into the activations). None for a field it left None, NaN for
        one it could not give (its ``decide`` raised or returned no Decision, reading or converting
        the field raised)."""
        self._late_after_s = None
        try:
            proposed = self.inner.decide(self._view(obs))
            if type(proposed) is not Decision and not isinstance(proposed, Decision):
                self._count(f"inner controller's decide() returned {type(proposed).__name__}", "expected a Decision")
                return _NAN, _NAN, _NAN, _NAN, False
        except Exception as exc:
            self._absorb("decide()", exc)
            return _NAN, _NAN, _NAN, _NAN, False
        # the prefill order among running requests: no bound depends on it, so it passes as proposed
        # (a non-negative number; anything else is no order)
        try:
            late = proposed.late_after_s
            self._late_after_s = late if type(late) is float and late >= 0.0 else _late_after(late)
        except Exception as exc:
            self._absorb("decide().late_after_s", exc)
        try:  # the common case, plain numbers: one conversion each, no method calls
            a, t, c, r = proposed.activation_budget, proposed.token_budget, proposed.running_cap, \
                proposed.kv_reserve_ratio
            if proposed.class_budgets is None:
                return (a if type(a) is float else float(a), t if type(t) is float else float(t),
                        c if type(c) is float else float(c), None if r is None else float(r), False)
        except Exception:
            pass  # field by field below, where each failure is counted
        field = self._field
        p_act = field(proposed, "activation_budget")
        try:
            classes = getattr(proposed, "class_budgets", None)
        except Exception as exc:
            self._absorb("decide().class_budgets", exc)
            classes = None
        if classes is not None:
            # The per-class path ignores the reservation; fold the allowances into one budget.
            p_act = self._folded_class_budgets(classes)
        return (p_act, field(proposed, "token_budget"), field(proposed, "running_cap"),
                field(proposed, "kv_reserve_ratio"), classes is not None)

    def _field(self, proposed: Decision, name: str) -> float | None:
        try:
            return _number(getattr(proposed, name, None))
        except Exception as exc:
            self._absorb(f"decide().{name}", exc)
            return _NAN

    def _folded_class_budgets(self, classes) -> float:
        """The sum of the positive class allowances, an unreadable one counting 0 (NaN when the
        allowances cannot be listed)."""
        total = 0
        try:
            for v in itertools.islice(classes.values(), MAX_CLASSES):
                try:
                    n = _number(v)
                except Exception as exc:
                    self._absorb("decide().class_budgets[...]", exc)
                    continue
                if n is not None and n >= 1:  # NaN is not
                    total += UNLIMITED if n >= UNLIMITED else int(n)
        except Exception as exc:
            self._absorb("decide().class_budgets", exc)
            return _NAN
        return float(total)

    def _activation_budget(self, obs: Observation, proposed: float | None, safe: float) -> int:
        """Within the safe rate (with credit for fractions) or, if more, the requests that fit at
        their peak into the free KV below rho M (a burst into free memory); at least 1 when nothing
        runs and something waits (liveness)."""
        allowance = self._credit + safe
        allowed = int(allowance) if allowance < UNLIMITED else UNLIMITED
        burst = headroom_activations(obs, BURST_USAGE * self.target_usage, self.output_prior(obs))
        if burst > allowed:
            allowed = burst
        if proposed is None or not proposed >= 1:  # also NaN
            act = 0
        elif proposed >= allowed:
            act = allowed
        else:
            act = int(proposed)
        if act == 0 and obs.num_running == 0 and obs.num_waiting > 0:
            act = 1
        credit = allowance - act
        credit_max = safe if safe > 1.0 else 1.0
        self._credit = 0.0 if credit < 0.0 else (credit_max if credit > credit_max else credit)
        return act

    def _report(self, p_act: float | None, p_cap: float | None, p_tok: float | None, p_ratio: float | None,
                folded: bool, act: int, cap: int, tok: int, ratio: float | None, safe: float) -> None:
        """Record what the shield changed in ``last_intervention`` and the running totals."""
        iv = self.last_intervention
        self.decisions += 1
        iv.proposed_activation_budget = p_act
        iv.applied_activation_budget = act
        iv.safe_activation_budget = safe
        iv.strict_reserve = ratio == 1.0
        changed = ((8 if folded or act != p_act else 0) | (4 if cap != p_cap else 0) | (2 if tok != p_tok else 0)
                   | (1 if ratio != p_ratio else 0))
        iv.fields = _CHANGED_FIELDS[changed]
        iv.changed = changed != 0
        if not changed:
            iv.magnitude = 0.0
            return
        mag = 0.0
        if changed & 8:
            mag += _log_gap(p_act, act)
        if changed & 4:
            mag += _log_gap(p_cap, cap)
        if changed & 2:
            mag += _log_gap(p_tok, tok)
        if changed & 1:
            if p_ratio is None or ratio is None:
                mag += 1.0
            else:
                gap = abs(ratio - (p_ratio if math.isfinite(p_ratio) else 0.0))
                mag += gap if gap < 1.0 else 1.0
        iv.magnitude = mag
        self.interventions += 1
        self.magnitude_total += mag

    def _absorb(self, call: str, exc: Exception) -> None:
        """Count an exception from the inner controller (the shield then uses its safe default)."""
        try:
            cause = f"inner controller's {call} raised {type(exc).__name__}"
        except Exception:  # an exception type that cannot even name itself
            cause = f"inner controller's {call} raised an exception"
        self._count(cause, exc)

    def _count(self, cause: str, detail) -> None:
        """Count one failure of the inner controller by cause, and log each cause once."""
        seen = self.inner_errors.get(cause, 0)
        self.inner_errors[cause] = seen + 1
        if not seen:
            try:
                text = str(detail)[:MAX_REASON_CHARS]
            except Exception:
                text = "(unprintable)"
            log.warning("%s: %s (counted in inner_errors; logged once per cause)", cause, text)


def _late_after(proposed) -> float | None:
    """A proposed ``late_after_s`` as a non-negative float, else None (activation order)."""
    if proposed is None or isinstance(proposed, bool):
        return None
    value = _number(proposed)
    return value if value is not None and value >= 0.0 else None


def _reserve_ratio(proposed: float | None) -> float | None:
    """Soft mode: the proposed reserve ratio within [0, 1] (None: no reservation); NaN, negative or
    not a number: 1."""
    if proposed is None:
        return None
    if not proposed >= 0:
        return 1.0
    return proposed if proposed < 1.0 else 1.0
