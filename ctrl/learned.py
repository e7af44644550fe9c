"""The learned controller: a PPO policy (exported to ONNX) that adjusts the robust heuristic
``slo-flow`` (``ctrl.slo_flow.SloFlowController``) once per control interval, always inside the
flow-control shield.

The policy learns residuals on the heuristic: its action in ``[-1, 1]^3`` scales the heuristic's
memory-safe activation rate, its token budget and its admission threshold by
``RESIDUAL_RANGE ** (s * a)``, so action 0 *is* ``slo-flow``: an untrained policy (PPO starts near a
zero mean action) serves as the heuristic. The residual scale s in [0, 1] (recorded in the policy
file, chosen on validation draws) shrinks a policy toward its prior; s = 0 ships the prior itself.
Whenever the policy cannot answer (file missing or corrupt, an exception, NaN/inf, over its
wall-clock budget on a real engine) the residuals go back to 0, counted and logged once per
cause (``LearnedController`` has the details). A policy that
answers badly is not caught here: the runtime guard (``engine/twin/guard.py``) compares it with the
heuristic on live traffic.

The same pieces serve the Gymnasium env (``env/serving_env.py``) and deployment, so the policy
sees in production exactly the features it saw in training:

- ``ObservationFeatures``: the policy's observation vector, from ``Observation`` and the replica's
  profile only, every entry scale-free (normalised by the replica's own capacity, SLOs and token
  budget; docs/ENV.md has the table);
- ``action_to_residual``: an action to the three multipliers;
- ``LearnedController``: runs the policy every ``control_interval`` steps and sets the residuals
  of its ``SloFlowController``, which makes every Decision and admission;
- ``make_learned_controller``: the only public way to build one, wrapped in the shield.

In a simulation (virtual clock) the policy is called inline and its wall-clock time never changes a
result; an engine on a wall clock calls ``use_wall_clock``, and from then on the policy runs on a
worker thread (``PolicyWorker``) that a step waits on for at most the budget, so a slow or hung
policy never stalls the engine.

Loading and running the exported policy file (``load_policy``, ``NumpyPolicy``, ``OnnxPolicy``) is
``ctrl.policy``; the worker thread is ``ctrl.policy_worker``. Their names are importable from here too.
"""

from __future__ import annotations

import importlib.resources
import logging
import math
import time
from pathlib import Path
from typing import ClassVar

import numpy as np

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation, Rejection, ReplicaProfile
# NumpyPolicy and OnnxPolicy are not used here; they stay importable from ctrl.learned.
from tidegate.ctrl.policy import OBS_CLIP, NumpyPolicy, OnnxPolicy, PolicyError, as_action, load_policy  # noqa: F401
from tidegate.ctrl.policy_worker import PolicyWorker
from tidegate.ctrl.shield import ShieldedController, eviction_cost_of
from tidegate.ctrl.slo_flow import SloFlowController, predicted_ttft_s
from tidegate.ctrl.theory import lambda_max_estimate, safe_activation_rate

log = logging.getLogger(__name__)

#: the shipped policy: package data of ``checkpoints``, found from any current directory and install
DEFAULT_POLICY = Path(str(importlib.resources.files("tidegate.checkpoints") / "policy.onnx"))

#: Names of the observation features, in order (docs/ENV.md has their definitions).
FEATURES = (
    "kv_usage", "kv_usage_trend", "queue_depth", "queued_prefill_steps", "arrival_rate", "completion_rate",
    "ttft_vs_slo", "tpot_vs_slo", "evictions", "rejections", "safe_rate", "running", "last_activation_action",
    "last_token_action", "last_admission_action", "predicted_ttft", "step_time_vs_tpot", "overload",
)
OBS_DIM = len(FEATURES)
ACTION_DIM = 3
#: an action a scales the heuristic's activation rate, token budget and admission threshold by
#: RESIDUAL_RANGE ** a: from half to twice (the shield caps activations at the same memory-safe
#: rate, so raising that one changes little); action 0 is the heuristic itself. The range bounds
#: what a wrong policy can do to its prior: no knob moves by more than a factor of two
RESIDUAL_RANGE = 2.0
#: the shield's overload policy around the learned controller, in training (env/serving_env.py) and
#: deployment alike: a queue of at most LEARNED_MAX_WAITING requests, and a request that waited
#: QUEUE_TIMEOUT_SLOS x the TTFT SLO without starting (a miss already) expires. A policy trained
#: under one overload policy and deployed under another acts on states it never saw
LEARNED_MAX_WAITING = 512
QUEUE_TIMEOUT_SLOS = 5.0
#: the action used before the first policy call and whenever the policy cannot answer
DEFAULT_ACTION = (0.0, 0.0, 0.0)
#: the policy's wall-clock budget per call on a real engine (seconds)
WALL_TIME_BUDGET_S = 1e-3
#: fallback causes that only say the policy did not answer within its wall-clock budget (the
#: machine was busy), as opposed to one that raised or returned garbage
LATE, BUSY, BACKOFF = "policy late", "policy busy", "policy backoff"
TIMING_CAUSES = (LATE, BUSY, BACKOFF)
#: on a wall clock, this many control intervals in a row without an answer in time rest the policy
BACKOFF_AFTER_OVERRUNS = 3
#: the first rest, in control intervals; each further overrun doubles it, up to BACKOFF_MAX_INTERVALS
BACKOFF_FIRST_INTERVALS = 2
BACKOFF_MAX_INTERVALS = 1024


def _clip1(x) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    if not math.isfinite(v):
        return 0.0
    return -1.0 if v < -1.0 else (1.0 if v > 1.0 else v)


def action_to_residual(action, scale: float = 1.0) -> tuple[float, float, float]:
    """(activation rate, token budget, admission threshold) multipliers for an action in
    ``[-1, 1]^3``: ``RESIDUAL_RANGE ** (scale * a)``; entries outside are clipped, NaN/inf/non-numbers
    count as 0 (multiplier 1). ``scale`` in [0, 1] is the policy's residual scale (0: the prior).

    The admission threshold only tightens (at most 1): the prior refuses an arrival only where it predicts
    its TTFT past the SLO with the measured error's margin, so a looser threshold admits requests predicted
    late. That can help only where the predictions run pessimistic, and where the policy misreads a replica
    it never saw, the whole queue's TTFT slides past the SLO (Dong & Cao's slot model at 1.3 x: goodput 0.25
    against the prior's 2.90)."""
    a0, a1, a2 = (RESIDUAL_RANGE ** (scale * _clip1(a)) for a in action[:ACTION_DIM])
    return a0, a1, (a2 if a2 < 1.0 else 1.0)


def residual_scale_of(value) -> float:
    """A residual scale as a float in [0, 1].

    :raises ValueError: not a number in [0, 1].
    """
    try:
        scale = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"residual_scale must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"residual_scale must be in [0, 1], got {value!r}")
    return scale


def _log_ratio(x: float, ref: float) -> float:
    return math.log(max(x, 1e-3 * ref) / ref) if ref > 0 else 0.0


class ObservationFeatures:
    """The policy's observation, from a stream of ``Observation``s sampled once per interval.

    Every feature is a ratio to the replica's own scale: KV to its capacity, rates to the fluid
    bound of the traffic seen so far on this replica (:func:`lambda_max_estimate`), latencies to
    the SLOs, queued prompt tokens to the token budget, running requests to ``max_num_seqs``.

    :param profile: the replica (step-time coefficients, KV capacity, SLOs, batch limits).
    :param target_usage: rho of the memory-safe rate.
    :param prior_output_tokens: output length assumed before any completion.
    """

    def __init__(self, profile: ReplicaProfile, target_usage: float = 0.9, prior_output_tokens: int = 128) -> None:
        self.profile = profile
        self.ttft_slo_s = profile.ttft_slo_s
        self.tpot_slo_s = profile.tpot_slo_s
        self.target_usage = target_usage
        self.prior_output_tokens = prior_output_tokens
        self.vector = np.zeros(OBS_DIM, dtype=np.float32)
        self.lambda_max_rps = 0.0
        self.reset()

    def reset(self) -> None:
        self._kv_usage = 0.0
        self._evictions = 0
        self._rejections = 0
        self.vector[:] = 0.0

    def update(self, obs: Observation, last_action=DEFAULT_ACTION, token_budget: float | None = None) -> np.ndarray:
        """Features of the interval that ends at ``obs``; the returned array is reused."""
        prof = self.profile
        lam = lambda_max_estimate(obs, prof, self.prior_output_tokens)
        self.lambda_max_rps = lam
        cap = obs.kv_capacity_tokens or prof.kv_capacity_tokens
        budget = float(token_budget or prof.max_num_batched_tokens)
        usage = obs.kv_used_tokens / cap
        evicted = obs.evictions_total - self._evictions
        rejected = obs.rejections_total - self._rejections
        self._evictions = obs.evictions_total
        self._rejections = obs.rejections_total
        step_s = obs.mean_step_time_s or obs.last_step_time_s
        safe_rps = safe_activation_rate(obs, self.target_usage, self.prior_output_tokens) / step_s \
            if step_s > 0 else lam
        head = obs.head_prompt_tokens or obs.mean_prompt_tokens
        delay = predicted_ttft_s(obs, int(head), budget, self.target_usage, self.prior_output_tokens, occupied=False)
        done = obs.completion_rate_rps
        features = (
            usage,
            10.0 * (usage - self._kv_usage),
            math.log1p(obs.num_waiting) / 4.0,
            math.log1p(obs.waiting_prompt_tokens / budget),
            obs.arrival_rate_rps / lam,
            done / lam,
            math.log1p(obs.ttft_recent_s / self.ttft_slo_s),
            math.log1p(obs.tpot_recent_s / self.tpot_slo_s),
            math.log1p(max(evicted, 0)),
            math.log1p(max(rejected, 0)),
            _log_ratio(safe_rps, lam),
            obs.num_running / prof.max_num_seqs,
            float(last_action[0]),
            float(last_action[1]),
            float(last_action[2]),
            math.log1p(delay / self.ttft_slo_s) if math.isfinite(delay) else OBS_CLIP,
            math.log1p(obs.last_step_time_s / self.tpot_slo_s),
            _log_ratio(obs.arrival_rate_rps, done) if done > 0 else (1.0 if obs.arrival_rate_rps > 0 else 0.0),
        )
        # NaN -> 0, everything else clipped to +-OBS_CLIP (infinities too), in Python floats and
        # written at once: the same float32 values as writing each and clipping the array, since
        # OBS_CLIP is a float32 and rounding to float32 is monotonic
        self.vector[:] = [0.0 if x != x else (OBS_CLIP if x > OBS_CLIP else (-OBS_CLIP if x < -OBS_CLIP else x))
                          for x in features]
        self._kv_usage = usage
        return self.vector


class LearnedController(Controller):
    """Runs the policy every ``control_interval`` steps to set the residuals of its
    ``SloFlowController`` (``self.prior``), which makes every Decision and admission.

    Build it with :func:`make_learned_controller`, which wraps it in the shield (whose overload
    policy, ``max_waiting`` and the queue timeout, stays on and may refuse arrivals first).

    In a simulation the policy is called inline and its speed never matters. After
    :meth:`use_wall_clock` it runs on :attr:`policy_worker`, and the step waits at most
    ``time_budget_s`` for the answer:

    - a late answer is discarded when it comes (it answers an observation that is gone); the
      interval keeps the residuals of the last answer, if that answer is from the interval just
      before (one late answer is jitter, and the policy's actions last an interval anyway), else
      the prior's (action 0);
    - while a call is still running (slow or hung), no other is issued: the interval is an overrun
      like a late answer;
    - after ``BACKOFF_AFTER_OVERRUNS`` overruns in a row the policy rests (not called, the prior
      decides) for ``BACKOFF_FIRST_INTERVALS`` intervals, twice as long after each further
      overrun, at most ``BACKOFF_MAX_INTERVALS``; an answer in time ends it.

    Any other failure (the features, the lambda estimate, the policy raising or returning NaN/inf,
    the residuals) falls back to the prior (action 0) for the interval; if the prior itself cannot
    decide, the step gets :meth:`safe_decision`. ``decide`` and ``admit`` never raise.

    ``fallbacks`` counts every fallback by cause since construction (``reset`` keeps it: it is a
    monotonic counter, exported as such); each cause is logged once.

    :param policy: a callable obs -> action, or None (always the heuristic).
    :param features: the observation builder.
    :param prior: the heuristic the policy adjusts (and that serves alone while it cannot).
    :param control_interval: engine steps between policy calls.
    :param time_budget_s: the longest a step waits for the policy's answer (wall clock); None (the
        default, and any simulation): no budget, so results never depend on the machine. Set without
        ``use_wall_clock``, it is checked after an inline call instead.
    :param load_error: why ``policy`` is None (logged with the first fallback).
    :param policy_source: where the policy came from (a file path), for logs and the server banner.
    :param residual_scale: the share of the policy's action applied, in [0, 1]: each knob moves by
        ``RESIDUAL_RANGE ** (residual_scale * a)``, so 0 is the prior and 1 the policy as trained.
        The selection picks it on validation draws (``benchmarks/learned_matrix.py``) and the policy
        file records it (``residual_scale`` in its metadata).
    """

    name: ClassVar[str] = "learned"

    def __init__(self, policy, features: ObservationFeatures, prior: SloFlowController, control_interval: int = 10,
                 time_budget_s: float | None = None, load_error: str | None = None, policy_source: str = "",
                 residual_scale: float = 1.0) -> None:
        super().__init__()
        if control_interval < 1:
            raise ValueError(f"control_interval must be >= 1, got {control_interval}")
        self.residual_scale = residual_scale_of(residual_scale)
        self.policy = policy
        self.features = features
        self.prior = prior
        self.control_interval = control_interval
        self.time_budget_s = time_budget_s
        self.load_error = load_error
        self.policy_source = policy_source
        #: fallbacks by cause since construction (not cleared by ``reset``)
        self.fallbacks: dict[str, int] = {}
        self.policy_calls = 0
        #: runs the policy off the engine's thread once on a wall clock
        self.policy_worker = PolicyWorker()
        self._wall_clock = False
        #: while True (a runtime guard found the policy losing to its prior), the heuristic decides
        self.guarded = False
        self.guard_switches = 0
        self.reset()

    @property
    def policy_status(self) -> str:
        """One line: the policy in use, or why every decision comes from the heuristic."""
        if self.policy is None:
            return (f"learned policy unavailable ({self.load_error or 'no policy'}); "
                    "decisions come from the slo-flow heuristic")
        scale = "" if self.residual_scale == 1.0 else f" (residual scale {self.residual_scale:g})"
        return f"learned policy {self.policy_source or type(self.policy).__name__} loaded{scale}"

    @property
    def degraded(self) -> bool:
        """True while the fallback serves instead of the policy: no policy loaded, the last control
        interval fell back (any cause) or the policy rests after overruns. Not merely because the
        runtime guard handed control to the prior (that is ``guarded``)."""
        return self.policy is None or self._degraded

    def use_wall_clock(self) -> None:
        self._wall_clock = True
        if self.time_budget_s is None:
            self.time_budget_s = WALL_TIME_BUDGET_S

    def reset(self) -> None:
        self.prior.reset()
        self.features.reset()
        self._steps = 0
        self._last_action = DEFAULT_ACTION
        self._action_interval = -2  # the control interval whose answer set _last_action
        self._degraded = False
        self._overruns = 0  # late or busy intervals in a row
        self._rest_intervals = 0  # intervals left in the current back-off
        self._next_rest = BACKOFF_FIRST_INTERVALS
        self.prior.set_residual()

    def set_guarded(self, on: bool) -> None:
        """Hand every decision to the heuristic (``on``) or back to the policy; a switch to the
        heuristic is counted in ``guard_switches``. Kept across ``reset``."""
        if on and not self.guarded:
            self.guard_switches += 1
            log.warning("learned controller: the runtime guard hands control to the slo-flow heuristic")
        self.guarded = bool(on)
        if on:
            self._last_action = DEFAULT_ACTION
            self.prior.set_residual()

    @property
    def fallback_total(self) -> int:
        return sum(self.fallbacks.values())

    def _count(self, cause: str, detail: str = "") -> None:
        seen = self.fallbacks.get(cause, 0)
        self.fallbacks[cause] = seen + 1
        if not seen:
            log.warning("learned controller fallback: %s%s (counted in fallbacks; logged once per cause)", cause,
                        f": {detail}" if detail else "")

    def _fall_back(self, cause: str, detail: str = "", keep_action: bool = False) -> None:
        """Count a fallback and give the interval to the prior (action 0), or with ``keep_action``
        to the residuals already set."""
        self._count(cause, detail)
        self._degraded = True
        if keep_action:
            return
        self._last_action = DEFAULT_ACTION
        try:
            self.prior.set_residual()
        except Exception as exc:
            self._count(f"prior set_residual raised {type(exc).__name__}", str(exc))

    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        try:
            return self.prior.admit(obs, prompt_tokens, max_tokens)
        except Exception as exc:  # the shield's queue limit still refuses in overload
            self._count(f"prior admit raised {type(exc).__name__}", str(exc))
            return None

    def decide(self, obs: Observation) -> Decision:
        try:
            if self._steps % self.control_interval == 0:
                self._act(obs)
        except Exception as exc:  # the residuals, set_residual: anything after the policy's answer
            self._fall_back(f"learned step raised {type(exc).__name__}", str(exc))
        self._steps += 1
        try:
            return self.prior.decide(obs)
        except Exception as exc:
            self._fall_back(f"prior decide raised {type(exc).__name__}", str(exc))
            return self.safe_decision(obs)

    def safe_decision(self, obs: Observation) -> Decision:
        """The step's Decision when the prior cannot decide: no activation (one when nothing runs
        and requests wait: the queue never stalls), the prior's batch limits, and every running
        request's prompt + max_tokens reserved (no eviction). The shield bounds it as any other."""
        d = Decision(0, UNLIMITED, UNLIMITED, kv_reserve_ratio=1.0)
        try:
            if obs.num_running == 0 and obs.num_waiting > 0:
                d.activation_budget = 1
            d.token_budget = int(self.prior.max_budget)
            d.running_cap = int(self.prior.max_num_seqs)
        except Exception:  # whatever is left is the shield's to bound
            pass
        return d

    def reads_slot_wait(self) -> bool:
        return self.prior.reads_slot_wait()  # the prior makes every admission

    def admission_state(self):
        """The prior's admission state (None if it has none), for a twin deciding arrivals elsewhere."""
        try:
            return self.prior.admission_state()
        except Exception as exc:
            self._count(f"prior admission_state raised {type(exc).__name__}", str(exc))
            return None

    def set_admission_state(self, state) -> None:
        """Take the admission state of another instance's prior (from :meth:`admission_state`)."""
        try:
            self.prior.set_admission_state(state)
        except Exception as exc:
            self._count(f"prior set_admission_state raised {type(exc).__name__}", str(exc))

    def _act(self, obs: Observation) -> None:
        try:
            x = self.features.update(obs, self._last_action, self.prior._decision.token_budget)
        except Exception as exc:
            self._fall_back(f"features raised {type(exc).__name__}", str(exc))
            return
        if self.policy is None:
            self._fall_back("policy unavailable", self.load_error or "no policy")
            return
        if self.guarded:
            self._degraded = False
            return
        if self._rest_intervals > 0:
            self._rest_intervals -= 1
            self._fall_back(BACKOFF)
            return
        answer = self._ask_worker(x) if self._wall_clock and self.time_budget_s is not None else self._ask_inline(x)
        if answer is None:  # late or busy: counted
            return
        self._overruns = 0  # an answer in time, whatever it says
        self._next_rest = BACKOFF_FIRST_INTERVALS
        if isinstance(answer, Exception):
            self._fall_back(f"policy raised {type(answer).__name__}", str(answer))
            return
        if not all(math.isfinite(v) for v in answer):
            self._fall_back("policy returned NaN or inf")
            return
        self.policy_calls += 1
        self._last_action = (_clip1(answer[0]), _clip1(answer[1]), _clip1(answer[2]))
        self._action_interval = self._steps // self.control_interval
        self.prior.set_residual(*action_to_residual(self._last_action, self.residual_scale))
        self._degraded = False

    def _ask_inline(self, x: np.ndarray) -> tuple[float, float, float] | Exception | None:
        t0 = time.perf_counter()
        try:
            answer = as_action(self.policy(x))
        except Exception as exc:
            return exc
        budget = self.time_budget_s
        if budget is not None and time.perf_counter() - t0 > budget:
            self._overrun(LATE)
            return None
        return answer

    def _ask_worker(self, x: np.ndarray) -> tuple[float, float, float] | Exception | None:
        if self.policy_worker.busy:
            self._overrun(BUSY)
            return None
        answer = self.policy_worker.call(self.policy, x.copy(), self.time_budget_s or 0.0)
        if answer is None:
            self._overrun(LATE)
            return None
        return answer

    def _overrun(self, cause: str) -> None:
        """No answer in time: keep the last answer's residuals for the interval after it, then the
        prior's; rest the policy after ``BACKOFF_AFTER_OVERRUNS`` in a row."""
        self._overruns += 1
        if self._overruns >= BACKOFF_AFTER_OVERRUNS:
            self._rest_intervals = self._next_rest
            self._next_rest = min(2 * self._next_rest, BACKOFF_MAX_INTERVALS)
        fresh = self._steps // self.control_interval - self._action_interval <= 1
        self._fall_back(cause, keep_action=fresh)


def make_prior(profile: ReplicaProfile, target_usage: float = 0.9, prior_output_tokens: int = 128,
               stable_rate: bool = True) -> SloFlowController:
    """The heuristic under the learned policy, with the replica's SLOs and batch limits. It activates at the
    shield's rate: Algorithm 1's ``M / w_hat`` where the steady arrivals ask between rho M and M of the memory,
    ``rho M / w_hat`` elsewhere (``ctrl.theory.stable_activation_rate``; ``stable_rate=False``: the latter always)."""
    return SloFlowController(ttft_slo_s=profile.ttft_slo_s, tpot_slo_s=profile.tpot_slo_s, target_usage=target_usage,
                             prior_output_tokens=prior_output_tokens, profile=profile, stable_rate=stable_rate,
                             max_num_batched_tokens=profile.max_num_batched_tokens, max_num_seqs=profile.max_num_seqs)


def shield_profile_options(profile: ReplicaProfile) -> dict:
    """The shield's options that come from the replica's profile: its batch limits, an eviction's cost (its
    prefill again: soft mode bounds the evictions' share of engine time, not their count) and Algorithm 1's stable
    rate, as the prior's."""
    return {"max_num_seqs": profile.max_num_seqs, "max_num_batched_tokens": profile.max_num_batched_tokens,
            "eviction_cost": eviction_cost_of(profile), "stable_rate": True}


def make_learned_controller(path: str | Path | None = None, *, profile: ReplicaProfile,
                            control_interval: int = 10, runtime: str = "numpy", time_budget_s: float | None = None,
                            shield_mode: str = "soft", residual_scale: float | None = None,
                            **shield_options) -> ShieldedController:
    """The learned controller inside the shield, with ``slo-flow`` as its prior and fallback.

    :param path: the exported policy (default ``checkpoints/policy.onnx``); a missing or corrupt
        file (or one with another observation or action size) is not an error: every decision then
        comes from the heuristic.
    :param profile: the replica's profile (step time, KV capacity, SLOs, batch limits), e.g. an
        ``engine.core.profile.Profile``.
    :param control_interval: engine steps between policy calls (as in training).
    :param runtime: ``numpy`` (faster for this small MLP) or ``onnxruntime``.
    :param time_budget_s: on a wall clock, the longest a step waits for the policy's answer (a later
        one falls back, see ``LearnedController``); None: ``WALL_TIME_BUDGET_S`` once an engine on a
        wall clock asks for a budget.
    :param shield_mode: ``strict`` or ``soft`` (see docs/SAFETY.md).
    :param residual_scale: the share of the policy's action applied, in [0, 1] (0: the prior alone);
        None: the one the policy file records (1 if it records none).
    :param shield_options: more ``ShieldedController`` options; ``max_waiting`` and
        ``queue_timeout_s`` default to those the policy was trained under (``LEARNED_MAX_WAITING``,
        ``QUEUE_TIMEOUT_SLOS`` x the profile's TTFT SLO).
    """
    if residual_scale is not None:
        residual_scale = residual_scale_of(residual_scale)
    path = DEFAULT_POLICY if path is None else Path(path)
    policy, error = None, None
    try:
        policy = load_policy(path, runtime)
        out = np.asarray(policy(np.zeros(OBS_DIM, dtype=np.float32)))
        if out.shape != (ACTION_DIM,):
            raise PolicyError(f"action shape {out.shape}, expected ({ACTION_DIM},)")
    except Exception as exc:
        policy, error = None, f"cannot load {path}: {type(exc).__name__}"
    if residual_scale is None:
        try:
            residual_scale = residual_scale_of(getattr(policy, "residual_scale", 1.0))
        except ValueError as exc:
            policy, error, residual_scale = None, f"cannot load {path}: {exc}", 1.0
    target = shield_options.get("target_usage", 0.9)
    prior_out = shield_options.get("prior_output_tokens", 128)
    features = ObservationFeatures(profile, target, prior_out)
    inner = LearnedController(policy, features, make_prior(profile, target, prior_out), control_interval,
                              time_budget_s, load_error=error, policy_source=str(path),
                              residual_scale=residual_scale)
    shield_options.setdefault("max_waiting", LEARNED_MAX_WAITING)
    shield_options.setdefault("queue_timeout_s", QUEUE_TIMEOUT_SLOS * profile.ttft_slo_s)
    for key, value in shield_profile_options(profile).items():
        shield_options.setdefault(key, value)
    return ShieldedController(inner, mode=shield_mode, **shield_options)
