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
  (a bounded eviction rate);
- the overload policy is always on: arrivals are refused with a retry-after while the queue
  holds ``max_waiting`` requests, and a queue timeout expires requests that never started.

The guarantee and its proof sketch are in docs/SAFETY.md.
"""

from __future__ import annotations

import logging
import math

from ctrl.base import (RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, UNLIMITED, Controller, Decision, Observation, Rejection,
                       retry_after_s)
from ctrl.theory import BURST_USAGE, headroom_activations, safe_activation_rate

MODES = ("strict", "soft")

log = logging.getLogger(__name__)


def _finite_int(value, default: int) -> int:
    """``value`` as an int; ``default`` for None, NaN and non-numbers; +-inf saturate."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    if math.isnan(v):
        return default
    if v >= UNLIMITED:
        return UNLIMITED
    if v <= -UNLIMITED:
        return -UNLIMITED
    return int(v)


class Intervention:
    """How far the shield moved the last proposal.

    :param changed: whether the applied Decision differs from the proposal.
    :param fields: names of the Decision fields the shield changed.
    :param proposed_activation_budget: what the inner controller asked for (None: not a number).
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


def _log_gap(proposed, applied: int) -> float:
    try:
        p = float(proposed)
    except (TypeError, ValueError):
        return 1.0
    if not math.isfinite(p):
        return 1.0
    return abs(math.log1p(max(p, 0.0)) - math.log1p(max(applied, 0))) + (1.0 if p < 0 else 0.0)


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
    :param eviction_budget_per_step: soft mode: evictions the bucket refills per engine step.
    :param eviction_burst: soft mode: bucket size; strict reservation is forced from empty until
        the bucket is full again.
    """

    name = "shielded"

    def __init__(self, inner: Controller, mode: str = "strict", target_usage: float = 0.9,
                 prior_output_tokens: int = 128, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_waiting: int = 1024,
                 queue_timeout_s: float = 60.0, eviction_budget_per_step: float = 0.01,
                 eviction_burst: float = 8.0) -> None:
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
        self.last_intervention = Intervention()
        self._decision = Decision(0, 1, 1)
        self.reset()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        self.inner.reset()
        self.decisions = 0
        self.interventions = 0
        self.magnitude_total = 0.0
        self.rejections = 0
        self._credit = 0.0
        self._bucket = self.eviction_burst
        self._refilling = False
        self._evictions_seen = 0
        #: exceptions from the inner controller absorbed since the last reset, by cause
        self.inner_errors: dict[str, int] = {}

    def use_wall_clock(self) -> None:
        try:
            self.inner.use_wall_clock()
        except Exception as exc:
            self._absorb("use_wall_clock", exc)

    @property
    def intervention_rate(self) -> float:
        """Fraction of decisions the shield changed since the last reset."""
        return self.interventions / self.decisions if self.decisions else 0.0

    # ------------------------------------------------------------------ the safe set
    def safe_budget(self, obs: Observation) -> float:
        """rho * M / w_hat activations per step: steady KV demand rho * M (Little's law on KV)."""
        return safe_activation_rate(obs, self.target_usage, self.prior_output_tokens)

    def limits(self, obs: Observation) -> tuple[int, int]:
        """(most running requests, most new tokens per step) the pool can hold."""
        blocks = max(1, obs.kv_capacity_tokens // max(1, obs.block_size))
        seqs = blocks if self.max_num_seqs is None else min(self.max_num_seqs, blocks)
        tokens = self.max_num_batched_tokens or max(1, obs.kv_capacity_tokens)
        return seqs, tokens

    def _strict_now(self, obs: Observation) -> bool:
        if self.mode == "strict":
            return True
        new = obs.evictions_total - self._evictions_seen
        self._evictions_seen = obs.evictions_total
        burst = self.eviction_burst
        b = min(burst, self._bucket + self.eviction_budget_per_step) - new
        self._bucket = b
        if b <= 0:
            self._refilling = True
        elif self._refilling and b >= burst:
            self._refilling = False
        return self._refilling

    # ------------------------------------------------------------------ Controller
    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        if self.max_waiting is not None and obs.num_waiting >= self.max_waiting:
            self.rejections += 1
            return Rejection(f"queue is full ({obs.num_waiting} waiting)", retry_after_s(obs))
        try:
            rejection = self.inner.admit(obs, prompt_tokens, max_tokens)
        except Exception as exc:  # a broken inner controller must not take admission down with it
            self._absorb("admit", exc)
            rejection = None
        if rejection is None:
            return None
        self.rejections += 1
        wait = getattr(rejection, "retry_after_s", None)
        if not isinstance(wait, (int, float)) or not RETRY_AFTER_MIN_S <= wait <= RETRY_AFTER_MAX_S:
            # NaN, inf, negative or not a number: the drain-rate estimate within its bounds
            rejection = Rejection(str(getattr(rejection, "reason", "refused by the controller")), retry_after_s(obs))
        return rejection

    def decide(self, obs: Observation) -> Decision:
        p_act, p_tok, p_cap, p_ratio, p_classes = self._proposal(obs)
        seqs_max, tokens_max = self.limits(obs)
        strict = self._strict_now(obs)
        safe = self.safe_budget(obs)
        act = self._activation_budget(obs, p_act, safe)
        cap = _clamp(_finite_int(p_cap, seqs_max), seqs_max)
        tok = _clamp(_finite_int(p_tok, tokens_max), tokens_max)
        ratio = 1.0 if strict else _reserve_ratio(p_ratio)

        d = self._decision
        d.activation_budget = act
        d.running_cap = cap
        d.token_budget = tok
        d.kv_reserve_ratio = ratio
        d.class_budgets = None
        self._report(p_act, p_cap, p_tok, p_ratio, p_classes, act, cap, tok, ratio, safe)
        return d

    def _proposal(self, obs: Observation) -> tuple:
        """The inner controller's proposal as (activations, tokens, cap, ratio, class budgets);
        None for whatever it did not propose or could not answer."""
        try:
            proposed = self.inner.decide(obs)
        except Exception as exc:
            self._absorb("decide", exc)
            return None, None, None, None, None
        if proposed is None:
            return None, None, None, None, None
        p_act = getattr(proposed, "activation_budget", None)
        p_classes = getattr(proposed, "class_budgets", None)
        if p_classes is not None:
            # The per-class path ignores the reservation; fold the allowances into one budget.
            try:
                p_act = sum(max(0, _finite_int(v, 0)) for v in p_classes.values())
            except Exception as exc:
                self._absorb("class_budgets", exc)
                p_act = None
        return (p_act, getattr(proposed, "token_budget", None), getattr(proposed, "running_cap", None),
                getattr(proposed, "kv_reserve_ratio", None), p_classes)

    def _activation_budget(self, obs: Observation, proposed, safe: float) -> int:
        """Within the safe rate (with credit for fractions) or, if more, the requests that fit at
        their peak into the free KV below rho M (a burst into free memory); at least 1 when nothing
        runs and something waits (liveness)."""
        allowance = self._credit + safe
        allowed = int(allowance) if allowance < UNLIMITED else UNLIMITED
        allowed = max(allowed, headroom_activations(obs, BURST_USAGE * self.target_usage, self.prior_output_tokens))
        act = min(max(_finite_int(proposed, 0), 0), allowed)
        if act == 0 and obs.num_running == 0 and obs.num_waiting > 0:
            act = 1
        self._credit = min(max(allowance - act, 0.0), max(safe, 1.0))
        return act

    def _report(self, p_act, p_cap, p_tok, p_ratio, p_classes, act: int, cap: int, tok: int,
                ratio: float | None, safe: float) -> None:
        """Record what the shield changed in ``last_intervention`` and the running totals."""
        iv = self.last_intervention
        fields = []
        if p_classes is not None or act != p_act:
            fields.append("activation_budget")
        if cap != p_cap:
            fields.append("running_cap")
        if tok != p_tok:
            fields.append("token_budget")
        if ratio != p_ratio:
            fields.append("kv_reserve_ratio")
        self.decisions += 1
        iv.changed = bool(fields)
        iv.fields = tuple(fields)
        iv.proposed_activation_budget = p_act if isinstance(p_act, (int, float)) else None
        iv.applied_activation_budget = act
        iv.safe_activation_budget = safe
        iv.strict_reserve = ratio == 1.0
        mag = 0.0
        if "activation_budget" in fields:
            mag += _log_gap(p_act, act)
        if "running_cap" in fields:
            mag += _log_gap(p_cap, cap)
        if "token_budget" in fields:
            mag += _log_gap(p_tok, tok)
        if "kv_reserve_ratio" in fields:
            mag += 1.0 if p_ratio is None or ratio is None else min(1.0, abs(ratio - _finite_float(p_ratio)))
        iv.magnitude = mag
        if fields:
            self.interventions += 1
            self.magnitude_total += mag

    def _absorb(self, call: str, exc: Exception) -> None:
        """Count an exception from the inner controller (its step then gets the shield's safe
        default) and log it once per cause."""
        cause = f"inner controller's {call}() raised {type(exc).__name__}"
        seen = self.inner_errors.get(cause, 0)
        self.inner_errors[cause] = seen + 1
        if not seen:
            log.warning("%s: %s (counted in inner_errors; logged once per cause)", cause, exc)


def _clamp(value: int, high: int) -> int:
    return 1 if value < 1 else (high if value > high else value)


def _reserve_ratio(proposed) -> float | None:
    """Soft mode: the proposed reserve ratio within [0, 1]; NaN, negative or unreadable: 1."""
    if proposed is None:
        return None
    try:
        ratio = float(proposed)
    except (TypeError, ValueError):
        return 1.0
    if not ratio >= 0:
        return 1.0
    return min(ratio, 1.0)


def _finite_float(value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) else 0.0
