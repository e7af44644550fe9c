"""The learned controller: a PPO policy (exported to ONNX) that sets three knobs, the activation
rate, the batch size and the admission (429) threshold on the predicted queueing delay, once per
control interval, always inside the flow-control shield.

The same pieces serve the Gymnasium env (``env/serving_env.py``) and deployment, so the
policy sees in production exactly the features it saw in training:

- ``ObservationFeatures``: the policy's observation vector, computed from ``Observation`` only;
- ``action_to_knobs``: an action in ``[-1, 1]^3`` to (activations per second, batch fraction,
  rejection delay threshold in seconds);
- ``predicted_delay_s``: the queueing delay a new arrival would see, from ``Observation`` only;
- ``KnobController``: turns the knobs into a Decision every step, and refuses an arrival (429
  with ``retry_after_s``) when its predicted delay exceeds the threshold;
- ``LearnedController``: runs the policy every ``control_interval`` steps; whenever it cannot
  answer (file missing or corrupt, an exception, NaN/inf, slower than its time budget) the
  step's Decision comes from ``FlowController(adaptive=True)``, counted and logged once per cause;
- ``make_learned_controller``: the only public way to build one, wrapped in the shield.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import math
import time
from pathlib import Path

import numpy as np

from ctrl.base import Controller, Decision, Observation, Rejection, ReplicaProfile, retry_after_s
from ctrl.flow import FlowController
from ctrl.shield import ShieldedController
from ctrl.theory import estimated_kv_workload, fluid_lambda_max

log = logging.getLogger(__name__)

#: the shipped policy: package data of ``checkpoints``, found from any current directory and install
DEFAULT_POLICY = Path(str(importlib.resources.files("checkpoints") / "policy.onnx"))

#: Names of the observation features, in order (docs/ENV.md has their definitions).
FEATURES = (
    "kv_usage", "kv_usage_trend", "queue_depth", "queued_prompt_tokens", "arrival_rate",
    "completion_rate", "ttft_vs_slo", "tpot_vs_slo", "evictions", "rejections", "safe_rate",
    "running", "last_admission_action", "last_batch_action", "last_reject_action", "predicted_delay",
)
OBS_DIM = len(FEATURES)
ACTION_DIM = 3
OBS_CLIP = 10.0
#: activation rate = lambda_max * ADMISSION_RANGE ** (action[0] + ADMISSION_BIAS): at action 0 it is
#: 2 x lambda_max (the shield's safe rate binds, as for watermark's unlimited activation)
ADMISSION_RANGE = 4.0
ADMISSION_BIAS = 0.5
#: batch fraction = BATCH_RANGE ** ((action[1] - 1) / 2): from 1/BATCH_RANGE to 1 (0.5 at action 0)
BATCH_RANGE = 4.0
#: rejection threshold d = TTFT SLO * REJECT_RANGE ** (action[2] + REJECT_BIAS) on the predicted delay:
#: from SLO/8 to 2 x SLO, SLO/2 at action 0
REJECT_RANGE = 4.0
REJECT_BIAS = -0.5
#: the action whose knobs are used before the first policy call and while the policy is unavailable
DEFAULT_ACTION = (0.0, 0.0, 0.0)
#: the training workload (splitwise_conv): S = E[P] + E[D] tokens per request and lifetime KV
#: workload W = E[P*D] + E[D(D+1)]/2, the policy's prior on traffic until the engine has seen
#: completions of its own (a test pins them to the trace)
PRIOR_MEAN_TOKENS_PER_REQUEST = 1365.8233502013838
PRIOR_LIFETIME_KV_WORKLOAD = 259152.66172673757


def _clip1(x) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return 0.0
    if not math.isfinite(v):
        return 0.0
    return -1.0 if v < -1.0 else (1.0 if v > 1.0 else v)


def action_to_knobs(action0: float, action1: float, lambda_max_rps: float, action2: float = 0.0,
                    ttft_slo_s: float = 2.0) -> tuple[float, float, float]:
    """(activation rate in requests per second, batch fraction in (0, 1], rejection threshold in
    seconds of predicted queueing delay) for an action in [-1, 1]^3 (NaN/inf count as 0)."""
    a0, a1, a2 = _clip1(action0), _clip1(action1), _clip1(action2)
    return (lambda_max_rps * ADMISSION_RANGE ** (a0 + ADMISSION_BIAS), BATCH_RANGE ** ((a1 - 1.0) / 2.0),
            ttft_slo_s * REJECT_RANGE ** (a2 + REJECT_BIAS))


def predicted_delay_s(obs: Observation, prompt_tokens: int = 0, token_budget: float | None = None,
                      prior_output_tokens: int = 128) -> float:
    """Seconds a new arrival with ``prompt_tokens`` would wait before its first token, from
    ``Observation`` only: the larger of the request drain time (waiting requests / completion
    rate; before any completion, Little's law on the running set) and the prefill drain time
    (queued plus own prompt tokens / tokens per step x steps per second). 0 with an empty queue,
    and 0 before the first step has been timed (no evidence of delay: a cold server admits)."""
    if obs.num_waiting <= 0:
        return 0.0
    step_s = obs.mean_step_time_s or obs.last_step_time_s
    if not step_s > 0:
        return 0.0
    rate = obs.completion_rate_rps
    if not rate > 0.0:
        out = obs.mean_output_tokens or prior_output_tokens
        rate = max(obs.num_running, 1) / (out * step_s)
    queue = obs.num_waiting / rate
    tokens = token_budget if token_budget and token_budget > 0 else max(obs.last_step_tokens, 1)
    prefill = (obs.waiting_prompt_tokens + prompt_tokens) * step_s / tokens
    return max(queue, prefill)


class ObservationFeatures:
    """The policy's observation, from a stream of ``Observation``s sampled once per interval.

    :param lambda_max_rps: the fluid throughput bound of the workload on this replica.
    :param ttft_slo_s: time-to-first-token SLO.
    :param tpot_slo_s: time-per-output-token SLO.
    :param max_num_seqs: the running-request cap of the profile.
    :param target_usage: rho of the shield's safe rate.
    :param prior_output_tokens: output length assumed before any completion.
    """

    def __init__(self, lambda_max_rps: float, ttft_slo_s: float, tpot_slo_s: float, max_num_seqs: int,
                 target_usage: float = 0.9, prior_output_tokens: int = 128) -> None:
        if not lambda_max_rps > 0:
            raise ValueError(f"lambda_max_rps must be > 0, got {lambda_max_rps}")
        self.lambda_max_rps = lambda_max_rps
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.max_num_seqs = max_num_seqs
        self.target_usage = target_usage
        self.prior_output_tokens = prior_output_tokens
        self.vector = np.zeros(OBS_DIM, dtype=np.float32)
        self.reset()

    def reset(self) -> None:
        self._kv_usage = 0.0
        self._evictions = 0
        self._rejections = 0
        self.vector[:] = 0.0

    def update(self, obs: Observation, last_action=DEFAULT_ACTION, token_budget: float | None = None) -> np.ndarray:
        """Features of the interval that ends at ``obs``; the returned array is reused."""
        lam = self.lambda_max_rps
        cap = obs.kv_capacity_tokens or 1
        usage = obs.kv_used_tokens / cap
        evicted = obs.evictions_total - self._evictions
        rejected = obs.rejections_total - self._rejections
        self._evictions = obs.evictions_total
        self._rejections = obs.rejections_total
        step_s = obs.mean_step_time_s or obs.last_step_time_s
        w = estimated_kv_workload(obs, self.prior_output_tokens)
        safe_rps = self.target_usage * cap / w / step_s if step_s > 0 else lam
        v = self.vector
        v[0] = usage
        v[1] = 10.0 * (usage - self._kv_usage)
        v[2] = math.log1p(obs.num_waiting) / 4.0
        v[3] = math.log1p(obs.waiting_prompt_tokens / cap)
        v[4] = obs.arrival_rate_rps / lam
        v[5] = obs.completion_rate_rps / lam
        v[6] = math.log1p(obs.ttft_recent_s / self.ttft_slo_s)
        v[7] = math.log1p(obs.tpot_recent_s / self.tpot_slo_s)
        v[8] = math.log1p(max(evicted, 0))
        v[9] = math.log1p(max(rejected, 0))
        v[10] = math.log(max(safe_rps / lam, 1e-3))
        v[11] = obs.num_running / self.max_num_seqs
        v[12] = last_action[0]
        v[13] = last_action[1]
        v[14] = last_action[2] if len(last_action) > 2 else 0.0
        delay = predicted_delay_s(obs, 0, token_budget, self.prior_output_tokens)
        v[15] = math.log1p(delay / self.ttft_slo_s) if math.isfinite(delay) else OBS_CLIP
        np.clip(v, -OBS_CLIP, OBS_CLIP, out=v)
        np.nan_to_num(v, copy=False, nan=0.0, posinf=OBS_CLIP, neginf=-OBS_CLIP)
        self._kv_usage = usage
        return v


class KnobController(Controller):
    """Activates at ``admission_rate_rps`` (credit carried across steps) with batch size
    ``batch_fraction`` x (``max_num_batched_tokens``, ``max_num_seqs``), and refuses an arrival
    (429, retry-after from ``ctrl.base.retry_after_s``) when its ``predicted_delay_s`` exceeds
    ``reject_delay_s``: a request that would miss its TTFT SLO anyway is better refused early than
    queued until it expires.

    :param max_num_batched_tokens: the token budget at batch fraction 1.
    :param max_num_seqs: the running cap at batch fraction 1.
    :param prior_output_tokens: output length assumed by the delay prediction before any completion.
    """

    name = "knobs"

    def __init__(self, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 prior_output_tokens: int = 128) -> None:
        super().__init__()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prior_output_tokens = prior_output_tokens
        self.admission_rate_rps = 0.0
        self.batch_fraction = 1.0
        self.reject_delay_s = math.inf
        self._decision = Decision(0, max_num_batched_tokens, max_num_seqs)
        self._credit = 0.0

    def set_knobs(self, admission_rate_rps: float, batch_fraction: float,
                  reject_delay_s: float = math.inf) -> None:
        self.admission_rate_rps = admission_rate_rps
        self.batch_fraction = batch_fraction
        self.reject_delay_s = reject_delay_s
        self._decision.token_budget = max(1, int(batch_fraction * self.max_num_batched_tokens))
        self._decision.running_cap = max(1, int(batch_fraction * self.max_num_seqs))

    def reset(self) -> None:
        self._credit = 0.0

    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        if obs.num_waiting <= 0 or not self.reject_delay_s < math.inf:
            return None
        delay = predicted_delay_s(obs, prompt_tokens, self._decision.token_budget, self.prior_output_tokens)
        if delay > self.reject_delay_s:
            return Rejection(f"predicted queueing delay {delay:.3g} s exceeds {self.reject_delay_s:.3g} s",
                             retry_after_s(obs))
        return None

    def decide(self, obs: Observation) -> Decision:
        step_s = obs.last_step_time_s or obs.mean_step_time_s
        per_step = self.admission_rate_rps * step_s
        c = self._credit + per_step
        n = int(c)
        # unused credit does not pile up into a burst while the queue is short
        self._credit = min(c - n, max(1.0, per_step))
        self._decision.activation_budget = n
        return self._decision


class PolicyError(RuntimeError):
    """The policy could not answer this step."""


class OnnxPolicy:
    """The exported actor (VecNormalize folded in) run with onnxruntime: obs -> action in [-1, 1]."""

    def __init__(self, path: str | Path) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: obs.reshape(1, -1)})[0][0]


class NumpyPolicy:
    """The same actor as a numpy forward pass over the ONNX file's weights (no runtime needed).

    The export names its initializers ``obs_mean``, ``obs_std``, ``layer{i}.weight``/``.bias``
    (hidden, tanh) and ``action.weight``/``.bias``; see ``training/export.py``.
    """

    def __init__(self, path: str | Path) -> None:
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        w = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
        meta = {p.key: p.value for p in model.metadata_props}
        self.clip = float(meta.get("clip_obs", OBS_CLIP))
        self.mean = w["obs_mean"]
        self.inv_std = (1.0 / w["obs_std"]).astype(np.float32)
        self.layers = []
        i = 0
        while f"layer{i}.weight" in w:
            self.layers.append((w[f"layer{i}.weight"].T.copy(), w[f"layer{i}.bias"]))
            i += 1
        self.action = (w["action.weight"].T.copy(), w["action.bias"])
        if not self.layers:
            raise PolicyError(f"{path}: no layer0.weight in the ONNX file, expected an export of training/export.py")

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        # np.minimum/np.maximum: np.clip costs more than the matmuls at this size
        c = self.clip
        x = np.maximum(np.minimum((obs - self.mean) * self.inv_std, c), -c)
        for weight, bias in self.layers:
            x = np.tanh(x @ weight + bias)
        a = x @ self.action[0] + self.action[1]
        return np.maximum(np.minimum(a, 1.0), -1.0)


def load_policy(path: str | Path, runtime: str = "numpy"):
    """The policy at ``path`` run by ``numpy`` or ``onnxruntime``."""
    if runtime == "numpy":
        return NumpyPolicy(path)
    if runtime == "onnxruntime":
        return OnnxPolicy(path)
    raise ValueError(f"runtime must be numpy or onnxruntime, got {runtime!r}")


class LearnedController(Controller):
    """Runs the policy every ``control_interval`` steps to set the knobs of a ``KnobController``:
    its Decisions each step, and its admission threshold on every arrival (``admit``).

    Build it with :func:`make_learned_controller`, which wraps it in the shield (whose overload
    policy, ``max_waiting`` and the queue timeout, stays on and may refuse arrivals first).

    While the policy cannot answer, Decisions come from ``FlowController(adaptive=True)`` and
    admission uses the knobs of ``DEFAULT_ACTION`` (reject above 1 x TTFT SLO of predicted delay).

    :param policy: a callable obs -> action, or None (always the fallback).
    :param features: the observation builder (its lambda_max and SLOs must match training).
    :param control_interval: engine steps between policy calls.
    :param time_budget_s: a policy call slower than this is discarded for the fallback.
    :param max_num_batched_tokens: the token budget at batch fraction 1.
    :param max_num_seqs: the running cap at batch fraction 1.
    :param load_error: why ``policy`` is None (counted as the cause of every fallback).
    :param policy_source: where the policy came from (a file path), for logs and the server banner.
    :param lambda_estimator: ``obs -> lambda_max_rps``, called before every policy call to follow
        the traffic actually served (see :func:`lambda_max_estimate`); None keeps the features'
        fixed lambda_max.
    """

    name = "learned"

    def __init__(self, policy, features: ObservationFeatures, control_interval: int = 10,
                 time_budget_s: float = 1e-3, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 load_error: str | None = None, lambda_estimator=None, policy_source: str = "") -> None:
        super().__init__()
        if control_interval < 1:
            raise ValueError(f"control_interval must be >= 1, got {control_interval}")
        self.policy = policy
        self.features = features
        self.control_interval = control_interval
        self.time_budget_s = time_budget_s
        self.knobs = KnobController(max_num_batched_tokens, max_num_seqs, features.prior_output_tokens)
        self.fallback = FlowController(adaptive=True, max_num_batched_tokens=max_num_batched_tokens,
                                       max_num_seqs=max_num_seqs)
        self.load_error = load_error
        self.policy_source = policy_source
        self.lambda_estimator = lambda_estimator
        self.fallbacks: dict[str, int] = {}
        self.policy_calls = 0
        self.reset()

    @property
    def policy_status(self) -> str:
        """One line: the policy in use, or why every decision comes from the fallback."""
        if self.policy is None:
            return (f"learned policy unavailable ({self.load_error or 'no policy'}); "
                    "decisions come from the flow fallback")
        return f"learned policy {self.policy_source or type(self.policy).__name__} loaded"

    def reset(self) -> None:
        self.knobs.reset()
        self.fallback.reset()
        self.features.reset()
        self._steps = 0
        self._last_action = DEFAULT_ACTION
        self._set_knobs(DEFAULT_ACTION)
        self._use_fallback = self.policy is None

    def _set_knobs(self, action) -> None:
        f = self.features
        self.knobs.set_knobs(*action_to_knobs(action[0], action[1], f.lambda_max_rps, action[2], f.ttft_slo_s))

    @property
    def fallback_total(self) -> int:
        return sum(self.fallbacks.values())

    def _fall_back(self, cause: str) -> None:
        if cause not in self.fallbacks:
            log.warning("learned controller: falling back to flow:adaptive=true (%s)", cause)
            self.fallbacks[cause] = 0
        self.fallbacks[cause] += 1
        self._use_fallback = True
        self._set_knobs(DEFAULT_ACTION)

    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        rejection = super().admit(obs, prompt_tokens, max_tokens)
        if rejection is not None:
            return rejection
        return self.knobs.admit(obs, prompt_tokens, max_tokens)

    def decide(self, obs: Observation) -> Decision:
        if self._steps % self.control_interval == 0:
            self._act(obs)
        self._steps += 1
        if self._use_fallback:
            if self.policy is None:
                self._fall_back(f"policy unavailable: {self.load_error or 'no policy'}")
            return self.fallback.decide(obs)
        self.fallback.decide(obs)  # keep its credit and estimates warm for a switch
        return self.knobs.decide(obs)

    def _act(self, obs: Observation) -> None:
        if self.lambda_estimator is not None:
            lam = self.lambda_estimator(obs)
            if math.isfinite(lam) and lam > 0:
                self.features.lambda_max_rps = lam
        x = self.features.update(obs, self._last_action, self.knobs._decision.token_budget)
        if self.policy is None:
            return
        t0 = time.perf_counter()
        try:
            action = self.policy(x)
            a0, a1, a2 = float(action[0]), float(action[1]), float(action[2])
        except Exception as exc:
            self._fall_back(f"policy raised {type(exc).__name__}")
            return
        if time.perf_counter() - t0 > self.time_budget_s:
            self._fall_back(f"policy slower than {self.time_budget_s * 1e6:.0f} us")
            return
        if not (math.isfinite(a0) and math.isfinite(a1) and math.isfinite(a2)):
            self._fall_back("policy returned NaN or inf")
            return
        self.policy_calls += 1
        self._use_fallback = False
        self._last_action = (_clip1(a0), _clip1(a1), _clip1(a2))
        self._set_knobs(self._last_action)


def lambda_max_estimate(obs: Observation, profile: ReplicaProfile, prior_output_tokens: int = 128) -> float:
    """The fluid bound ``1 / (a W / M + c W + b S)`` (``ctrl.theory.capacity``) of the traffic
    seen so far: S and W from the engine's running estimates over completed requests (before
    the first completion, the queue head's prompt with ``prior_output_tokens``), a, b, c from
    the profile, M the engine's own KV capacity."""
    w = estimated_kv_workload(obs, prior_output_tokens)
    if obs.completed_total > 0 and obs.lifetime_kv_workload > 0:
        s = obs.mean_prompt_tokens + obs.mean_output_tokens
    else:
        s = (obs.head_prompt_tokens or obs.mean_prompt_tokens or 1.0) + prior_output_tokens
    return fluid_lambda_max(s, w, profile, obs.kv_capacity_tokens)


def prior_lambda_max(profile: ReplicaProfile) -> float:
    """lambda_max of ``profile`` with the training workload's S and W."""
    return fluid_lambda_max(PRIOR_MEAN_TOKENS_PER_REQUEST, PRIOR_LIFETIME_KV_WORKLOAD, profile)


def make_learned_controller(path: str | Path | None = None, *, profile: ReplicaProfile,
                            lambda_max_rps: float | None = None,
                            control_interval: int = 10, runtime: str = "numpy", time_budget_s: float = 1e-3,
                            shield_mode: str = "soft", **shield_options) -> ShieldedController:
    """The learned controller inside the shield, with the flow controller as its fallback.

    :param path: the exported policy (default ``checkpoints/policy.onnx``); a missing or corrupt
        file (or one with another action size) is not an error: every decision then comes from the
        fallback.
    :param profile: the replica's profile (step time, KV capacity, SLOs, batch limits), e.g. an
        ``engine.core.profile.Profile``. The shipped policy was trained on a100-llama2-7b.
    :param lambda_max_rps: the fluid bound of the expected workload; None (a server that cannot
        know its traffic in advance): estimated online from the requests served
        (:func:`lambda_max_estimate`), starting from the training workload on this profile (:func:`prior_lambda_max`).
    :param control_interval: engine steps between policy calls (as in training).
    :param runtime: ``numpy`` (faster for this small MLP) or ``onnxruntime``.
    :param time_budget_s: a policy call slower than this falls back for that interval.
    :param shield_mode: ``strict`` or ``soft`` (see docs/SAFETY.md).
    :param shield_options: more ``ShieldedController`` options.
    """
    estimator = None
    if lambda_max_rps is None:
        lambda_max_rps = prior_lambda_max(profile)
        estimator = functools.partial(lambda_max_estimate, profile=profile)
    path = DEFAULT_POLICY if path is None else Path(path)
    policy, error = None, None
    try:
        policy = load_policy(path, runtime)
        out = np.asarray(policy(np.zeros(OBS_DIM, dtype=np.float32)))
        if out.shape != (ACTION_DIM,):
            raise PolicyError(f"action shape {out.shape}, expected ({ACTION_DIM},)")
    except Exception as exc:
        policy, error = None, f"cannot load {path}: {type(exc).__name__}"
    features = ObservationFeatures(lambda_max_rps, profile.ttft_slo_s, profile.tpot_slo_s, profile.max_num_seqs)
    inner = LearnedController(policy, features, control_interval, time_budget_s,
                              profile.max_num_batched_tokens, profile.max_num_seqs, load_error=error,
                              lambda_estimator=estimator, policy_source=str(path))
    shield_options.setdefault("max_num_seqs", profile.max_num_seqs)
    shield_options.setdefault("max_num_batched_tokens", profile.max_num_batched_tokens)
    return ShieldedController(inner, mode=shield_mode, **shield_options)
