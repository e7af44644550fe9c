"""ServingEnv: the Gymnasium environment around the engine loop.

One ``env.step`` sets the learned controller's three residuals on the ``slo-flow`` heuristic
(multipliers of its activation rate, token budget and admission threshold; action 0 is the
heuristic) for the next control interval, projects the Decisions through the flow-control shield
(whose overload policy stays on), runs the engine for ``control_interval`` steps (jumping the
clock over idle gaps) and rewards the interval's goodput. Episodes draw a workload family (YAML,
``engine.workloads.families``) or a stretch of a trace, a load, and optionally a replica whose
step-time coefficients and KV capacity differ from the profile the controller is told.
Observation, action and reward are tabulated in docs/ENV.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from tidegate.ctrl.learned import (
    ACTION_DIM,
    DEFAULT_ACTION,
    LEARNED_MAX_WAITING,
    OBS_CLIP,
    OBS_DIM,
    QUEUE_TIMEOUT_SLOS,
    ObservationFeatures,
    action_to_residual,
    make_prior,
    shield_profile_options,
)
from tidegate.ctrl.base import Observation
from tidegate.ctrl.shield import ShieldedController
from tidegate.engine.sim import compiled
from tidegate.engine.core.builder import build_engine
from tidegate.engine.core.clock import WallClock
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import met_slo
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.sim.simulate import make_sim_engine
from tidegate.engine.workloads import augment_segments, split_segments
from tidegate.engine.workloads.families import family_segment, load_family, perturbed_profile

log = logging.getLogger(__name__)


def check_shared_options(load_range, reward_weights, known_weights, baseline) -> tuple[float, float]:
    """One sentence for the first bad option both envs take; the load range as floats."""
    low, high = (float(x) for x in load_range)
    if not 0 < low <= high:
        raise ValueError(f"load_range must be (low, high) with 0 < low <= high, got {load_range}")
    unknown = set(reward_weights or {}) - set(known_weights)
    if unknown:
        raise ValueError(f"unknown reward weights {sorted(unknown)}; expected some of {', '.join(known_weights)}")
    if baseline not in ("none", "prior"):
        raise ValueError(f"baseline must be 'none' or 'prior', got {baseline!r}")
    return low, high


def _check_options(backend, load_range, control_interval, episode_steps, reward_weights, baseline, profile_spread,
                   episode_requests, max_waiting) -> tuple[float, float]:
    """One sentence for the first bad option; the load range as floats."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "engine" and compiled.active():
        raise ValueError("backend 'engine' runs the real engine, which runs the interpreted source: drop --compiled")
    low, high = check_shared_options(load_range, reward_weights, DEFAULT_REWARD_WEIGHTS, baseline)
    if control_interval < 1 or episode_steps < 1:
        raise ValueError("control_interval and episode_steps must be >= 1")
    if baseline == "prior" and backend != "sim":
        raise ValueError("baseline='prior' needs the sim backend (a shadow engine runs the prior alongside)")
    if not 0 <= profile_spread < 1:
        raise ValueError(f"profile_spread must be in [0, 1), got {profile_spread}")
    if episode_requests < 2:
        raise ValueError(f"episode_requests must be >= 2, got {episode_requests}")
    if isinstance(max_waiting, bool) or not isinstance(max_waiting, (int, float)) \
            or not math.isfinite(max_waiting) or max_waiting < 1 or max_waiting != int(max_waiting):
        raise ValueError(f"max_waiting must be a whole number >= 1, got {max_waiting!r}")
    return low, high


#: ``sim``: the simulator twin; ``engine``: tidegate's engine; ``vllm``: a vLLM server with the plugin
BACKENDS = ("sim", "engine", "vllm")


class _Cursor:
    """Where an engine is in the episode's arrival stream."""

    __slots__ = ("next", "offset_s", "next_time_s", "req_id")

    def __init__(self, first: int, offset_s: float) -> None:
        self.next = first
        self.offset_s = offset_s
        self.next_time_s = 0.0
        self.req_id = 0


#: the vllm backend's options (``VllmReplica``'s, and the learned controller's time budget in vLLM)
VLLM_OPTIONS = frozenset({"time_budget_s", "kv_cache_gib", "vllm_python", "vllm_args", "work_dir", "log", "max_open",
                          "replica"})
#: how long, by default, the learned controller inside vLLM waits for the env's action
VLLM_TIME_BUDGET_S = 0.02

#: engine steps a drain may take at most (the shield's queue timeout ends every wait long before)
DRAIN_MAX_STEPS = 1_000_000

#: the evaluation's objective, goodput, and a small cost per refusal so that, goodput being equal, serving
#: wins over refusing. A penalty on served requests that miss their SLO would pay the policy for refusing
#: them (a refusal counts as a miss in goodput, but costs less than a missed SLO), which the matrix
#: and a user at light load count as a loss
DEFAULT_REWARD_WEIGHTS = {"goodput": 1.0, "slo_miss": 0.0, "rejection": 0.01, "eviction": 0.0}


class ServingEnv(gym.Env):
    """Learn the activation rate, batch size and admission threshold of one serving replica.

    :param backend: ``sim`` (the simulator twin, virtual clock), ``engine`` (the real engine:
        ``TorchExecutor`` running ``model`` on CPU with a wall clock; random prompt tokens of the
        trace's lengths, outputs forced to the trace's lengths; default profile tiny-cpu; request
        lengths are clipped to the model's context) or ``vllm`` (a vLLM server from ``.venv-vllm``
        running ``model`` with tidegate's plugin, its learned controller asking the env for every
        action; the same requests, streamed over HTTP; ``env.vllm_replica``). The profile's KV
        size, block size and batch limits become the vLLM replica's.
    :param model: the real engine's model (``tiny`` or a local Hugging Face folder); engine backend only.
    :param length_scale: multiply every prompt and output length (fit a trace to a small model).
    :param trace: a shipped trace name or path, a list of them, or a list of ``Arrival``s
        (None: splitwise_conv for ``train``, splitwise_conv and splitwise_code for ``eval``).
    :param workload: alias of ``trace`` for a list of ``Arrival``s.
    :param split: ``train`` (first 70% of each trace) or ``eval`` (the rest; all of splitwise_code).
    :param load_range: (low, high) offered load as multiples of lambda_max; each episode draws one
        log-uniformly.
    :param profile: a profile name, path or ``Profile`` (None: a100-llama2-7b for ``sim``, tiny-cpu for ``engine``).
    :param control_interval: engine steps per env step.
    :param episode_steps: env steps per episode (then ``terminated`` after the drain, or ``truncated``
        without it).
    :param ttft_slo_s: TTFT SLO (default: the profile's).
    :param tpot_slo_s: TPOT SLO (default: the profile's).
    :param reward_weights: weights of ``goodput``, ``slo_miss``, ``rejection``, ``eviction``.
    :param shield_mode: ``strict`` or ``soft`` (docs/SAFETY.md).
    :param max_waiting: the shield's queue limit (arrivals beyond it are rejected with 429).
    :param queue_timeout_s: the shield's queue timeout (default 5 x TTFT SLO).
    :param max_tokens_cap: every request's max_tokens (default the trace reader's).
    :param augment: (prompt_scale, output_scale) pairs: each adds a copy of every segment with
        scaled request lengths (``augment_segments``); episodes draw segments uniformly.
    :param families: workload family names or YAML paths (``engine.workloads.families``); when given,
        every episode draws one uniformly and samples ``episode_requests`` fresh requests from it
        (``trace``, ``split`` and ``augment`` are then unused).
    :param episode_requests: requests sampled per episode from a family.
    :param profile_spread: each episode's replica has the profile's step-time coefficients and KV
        capacity times factors uniform in ``[1 - spread, 1 + spread]``; the controller is still told
        the nominal profile (a profile measured on another day, or on a neighbouring machine).
    :param baseline: ``prior``: the reward is the interval's reward minus that of the prior alone
        (``slo-flow``, action 0) serving the same arrivals in a shadow simulation advanced to the
        same time: the policy is paid for what it adds to its prior, and the traffic's own noise
        (common to both) cancels. ``none``: the plain reward. Sim backend only.
    :param drain: at the end of an episode (sim backend), arrivals stop and the engine (and the
        shadow) finish every request they hold, under the prior (action 0); the drain's reward,
        in the same units as an interval's (requests over lambda_max times the episode's mean
        interval), is added to the last step's, and the episode ends ``terminated``: a policy
        that leaves a backlog behind pays for it, as it would in a whole run. Without it an
        episode is a window of the stream that ends ``truncated``, and requests the policy let in
        late are never counted.
    :param seed: seed of the episode draws (``reset(seed=...)`` overrides it).
    :param vllm_options: the vLLM backend's ``VllmReplica`` options: ``time_budget_s`` (how long the
        controller in vLLM waits for each action, default 0.02), ``kv_cache_gib``, ``vllm_python``,
        ``vllm_args``, ``work_dir``, ``log``, ``max_open`` (the clients' streams open at once; an
        arrival past them is dropped, a miss, counted in ``info["requests_dropped"]``); or ``replica``:
        a ``VllmReplica`` started (or launched) beforehand, for several envs in turn without
        restarting vLLM. Call :meth:`close` to stop the server the env started.
    """

    metadata = {"render_modes": []}

    def __init__(self, backend: str = "sim", trace=None, workload=None, split: str = "train",
                 load_range: tuple[float, float] = (0.5, 2.0), profile=None,
                 control_interval: int = 10, episode_steps: int = 256, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None, reward_weights: dict | None = None,
                 shield_mode: str = "soft", max_waiting: int = LEARNED_MAX_WAITING,
                 queue_timeout_s: float | None = None,
                 max_tokens_cap: int | None = None, augment=None, seed: int | None = None, model: str = "tiny",
                 length_scale: float = 1.0, families=None, episode_requests: int = 3000,
                 profile_spread: float = 0.0, baseline: str = "none", drain: bool = True,
                 vllm_options: dict | None = None) -> None:
        super().__init__()
        low, high = _check_options(backend, load_range, control_interval, episode_steps, reward_weights, baseline,
                                   profile_spread, episode_requests, max_waiting)
        if profile is None:
            profile = "a100-llama2-7b" if backend == "sim" else "tiny-cpu"
        profiles = list(profile) if isinstance(profile, (list, tuple)) else [profile]
        if not profiles or (len(profiles) > 1 and not families):
            raise ValueError("give one profile, or several together with families")
        self.profiles = [p if hasattr(p, "base_s") else load_profile(p) for p in profiles]
        self._replica = None
        if backend == "vllm":
            self._check_vllm(max_waiting, queue_timeout_s, profile_spread, ttft_slo_s, tpot_slo_s, vllm_options)
            self._start_vllm(model, control_interval, shield_mode, vllm_options or {})
        self.profile = self.profiles[0]
        self.backend = backend
        self.baseline = baseline
        self.drain = bool(drain) and backend == "sim"
        self.families = [load_family(f) for f in families] if families else []
        self.episode_requests = int(episode_requests)
        self.profile_spread = float(profile_spread)
        self.segments = [] if self.families else split_segments(
            workload if workload is not None else trace, split, self.profile, max_tokens_cap)
        if length_scale != 1.0:
            self.segments = augment_segments(self.segments, [(length_scale, length_scale)], self.profile)[
                len(self.segments):]
        if augment:
            self.segments = augment_segments(self.segments, augment, self.profile)
        self._executor = None
        if backend == "engine":
            self._init_engine(model)
        self.split = split
        self.load_range = (low, high)
        self.control_interval = int(control_interval)
        self.episode_steps = int(episode_steps)
        if ttft_slo_s or tpot_slo_s:  # the controller aims at the SLOs the reward counts
            self.profiles = [dataclasses.replace(p, ttft_slo_s=ttft_slo_s or p.ttft_slo_s,
                                                 tpot_slo_s=tpot_slo_s or p.tpot_slo_s) for p in self.profiles]
        self.reward_weights = {**DEFAULT_REWARD_WEIGHTS, **(reward_weights or {})}
        self.shield_mode = shield_mode
        self.max_waiting = int(max_waiting)  # a whole number (_check_options); a YAML 100.0 is the count 100
        self._queue_timeout_s = queue_timeout_s
        self._seed = seed

        self.observation_space = spaces.Box(-OBS_CLIP, OBS_CLIP, shape=(OBS_DIM,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(ACTION_DIM,), dtype=np.float32)
        self._use_profile(self.profiles[0])
        self.core = None
        self._episode = 0
        self._traffic = False

    def _use_profile(self, profile) -> None:
        """The replica's nominal profile: what the controller (the heuristic, the shield and the
        features) is told, and the SLOs the reward counts."""
        self.profile = profile
        self.ttft_slo_s = profile.ttft_slo_s
        self.tpot_slo_s = profile.tpot_slo_s
        self.queue_timeout_s = self._queue_timeout_s or QUEUE_TIMEOUT_SLOS * self.ttft_slo_s
        self.prior = make_prior(profile)
        options = shield_profile_options(profile)
        self.shield = ShieldedController(self.prior, mode=self.shield_mode, max_waiting=self.max_waiting,
                                         queue_timeout_s=self.queue_timeout_s, **options)
        self._shadow_shield = ShieldedController(make_prior(profile), mode=self.shield_mode,
                                                 max_waiting=self.max_waiting, queue_timeout_s=self.queue_timeout_s,
                                                 **options)

    # ------------------------------------------------------------------ episodes
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and self._seed is not None and self._episode == 0:
            seed = self._seed
        super().reset(seed=seed)
        rng = self.np_random
        options = options or {}
        if len(self.profiles) > 1:
            self._use_profile(self.profiles[int(options.get("profile", rng.integers(len(self.profiles))))])
        self.replica = perturbed_profile(self.profile, rng, self.profile_spread) if self.profile_spread \
            else self.profile
        if self.families:
            family = self.families[int(options.get("family", rng.integers(len(self.families))))]
            seg = family_segment(family, self.replica, rng, self.episode_requests)
        else:
            seg = self.segments[int(options.get("segment", rng.integers(len(self.segments))))]
        low, high = self.load_range
        load = float(options.get("load", math.exp(rng.uniform(math.log(low), math.log(high)))))
        self.segment = seg
        self.load = load
        self.lambda_max_rps = seg.lambda_max_rps
        self._rate_scale = load * seg.lambda_max_rps / seg.mean_rate_rps
        start = 0 if self.families else rng.integers(len(seg.times_s))
        first = int(options.get("start_index", start))
        self._cursor = _Cursor(first, -float(seg.times_s[first]))

        self.shield.reset()
        self._noise_seed = int(rng.integers(1 << 31))  # the step noise of a noisy profile: the same for the shadow
        self.core = None if self._replica is not None else self._make_engine()
        self._shadow = None
        if self.baseline == "prior":
            self._shadow_shield.reset()
            self._shadow = make_sim_engine(self.replica, self._shadow_shield, record_steps=False,
                                           noise_seed=self._noise_seed)
            self._shadow_cursor = _Cursor(first, -float(seg.times_s[first]))
        self.features = ObservationFeatures(self.profile, self.shield.target_usage, self.shield.prior_output_tokens)
        self._last_action = DEFAULT_ACTION
        self._set_residual(DEFAULT_ACTION)
        self._steps = 0
        self._elapsed_s = 0.0
        self._episode += 1
        self.totals = {"good": 0, "finished": 0, "missed": 0, "rejected": 0, "evictions": 0}
        if self._replica is not None:
            obs = self._reset_vllm()
        else:
            obs = self.features.update(self.core.observe(), self._last_action,
                                       self.prior._decision.token_budget).copy()
        return obs, {"load": load, "segment": seg.name, "lambda_max_rps": seg.lambda_max_rps,
                     "replica": self.replica.name}

    def _init_engine(self, model: str) -> None:
        from tidegate.engine.real.executor import TorchExecutor
        from tidegate.engine.real.model import load_model

        hf_model, tokenizer = load_model(model, "cpu", None)
        self._executor = TorchExecutor(hf_model, tokenizer, device="cpu")
        self._sampling = SamplingParams(ignore_eos=True)
        self._max_len = self._executor.max_model_len or 1 << 30
        vocab = self._executor.vocab_size
        self._token_low = 3 if vocab > 3 else 0
        self._vocab = vocab

    def _make_engine(self):
        if self._executor is None:
            return make_sim_engine(self.replica, self.shield, record_steps=False, noise_seed=self._noise_seed)
        core = build_engine(self.replica, self.shield, self._executor, WallClock(), record_steps=False)
        self._executor.attach_pool(core.pool)
        self._token_rng = np.random.default_rng(int(self.np_random.integers(1 << 31)))
        return core

    def _make_request(self, i: int, cursor: _Cursor) -> Request:
        seg = self.segment
        if self._executor is None:
            return Request(str(cursor.req_id), cursor.next_time_s, seg.prompts[i], seg.max_tokens[i],
                           target_output_len=seg.outputs[i])
        # the real engine: random prompt tokens, lengths within the model's context
        prompt = max(1, min(seg.prompts[i], self._max_len // 2))
        max_tokens = max(1, min(seg.max_tokens[i], self._max_len - prompt))
        ids = self._token_rng.integers(self._token_low, self._vocab, size=prompt).tolist()
        return Request(str(cursor.req_id), cursor.next_time_s, prompt, max_tokens,
                       target_output_len=min(seg.outputs[i], max_tokens), prompt_token_ids=ids,
                       sampling=self._sampling)

    def _pull_arrivals(self, now_s: float, core=None, cursor: _Cursor | None = None) -> int:
        """Queue every arrival up to ``now_s`` (on the main engine, or ``core`` with its own
        ``cursor``); returns how many were rejected."""
        core = self.core if core is None else core
        c = self._cursor if cursor is None else cursor
        rejected = 0
        add = core.add_request
        advance = self._advance
        while c.next_time_s <= now_s:
            if add(self._make_request(c.next, c)) is not None:
                rejected += 1
            advance(c)
        return rejected

    def _advance(self, c: _Cursor) -> None:
        """Move ``c`` past its arrival to the episode's next one."""
        seg = self.segment
        c.req_id += 1
        i = c.next + 1
        if i == len(seg.times_s):  # wrap around: the stream continues from the segment's start
            i = 0
            c.offset_s += seg.span_s
        c.next = i
        c.next_time_s = (float(seg.times_s[i]) + c.offset_s) / self._rate_scale

    # ------------------------------------------------------------------ the vLLM backend
    def _check_vllm(self, max_waiting, queue_timeout_s, profile_spread, ttft_slo_s, tpot_slo_s,
                    vllm_options) -> None:
        """One sentence for an option the vLLM backend cannot honour."""
        if len(self.profiles) > 1:
            raise ValueError("the vllm backend serves one replica: give one profile")
        if max_waiting != LEARNED_MAX_WAITING or queue_timeout_s is not None:
            raise ValueError("the vllm backend runs the learned controller's own overload policy: leave "
                             "max_waiting and queue_timeout_s at their defaults")
        if profile_spread:
            raise ValueError("the vllm backend's replica is vLLM itself: profile_spread needs the sim backend")
        if ttft_slo_s or tpot_slo_s:
            raise ValueError("the vllm backend's controller aims at its profile's SLOs: set them in the profile")
        unknown = set(vllm_options or {}) - VLLM_OPTIONS
        if unknown:
            raise ValueError(f"vllm_options has no {sorted(unknown)[0]!r}; it takes {', '.join(sorted(VLLM_OPTIONS))}")

    def _start_vllm(self, model: str, control_interval: int, shield_mode: str, options: dict) -> None:
        """Start the vLLM replica (or take the one given); the profile takes its KV size, block size and
        batch limits."""
        from tidegate.engine.vllm.config import with_limits
        from tidegate.env.vllm_replica import VllmReplica

        options = dict(options)
        replica = options.pop("replica", None)
        if replica is not None:
            if options:
                raise ValueError(f"vllm_options: a given replica was started with its own options; drop "
                                 f"{', '.join(sorted(options))}")
            mine = (self.profiles[0].name, int(control_interval), shield_mode)
            theirs = (replica.profile.name, replica.control_interval, replica.shield_mode)
            if mine != theirs:
                raise ValueError(f"the given vLLM replica runs (profile, control_interval, shield_mode) = {theirs}, "
                                 f"this env {mine}")
            self._owns_replica = False
        else:
            budget = float(options.pop("time_budget_s", VLLM_TIME_BUDGET_S))
            if not 0 < budget < 10:
                raise ValueError(f"vllm_options time_budget_s must be in (0, 10) seconds, got {budget}")
            replica = VllmReplica(model, self.profiles[0], int(control_interval), shield_mode, budget, **options)
            self._owns_replica = True
        self._replica = replica
        self.profiles = [with_limits(self.profiles[0], replica.ready())]

    def _reset_vllm(self) -> np.ndarray:
        """End the last episode's traffic; the observation of an idle replica (the first interval's
        features come when vLLM first calls the policy)."""
        replica = self._replica
        if self._traffic:
            replica.stop_traffic()
            self._traffic = False
        self._call = replica.latest_call()[0] + 1  # the first interval's call, answered by the first action
        self._arrival_rng_seed = int(self.np_random.integers(1 << 31))
        idle = Observation(kv_capacity_tokens=self.profile.kv_capacity_tokens)
        return self.features.update(idle, DEFAULT_ACTION, self.profile.max_num_batched_tokens).copy()

    def _next_arrival(self) -> tuple[float, int, int]:
        """The episode's next arrival for the vLLM replica: (seconds from the episode's start, prompt
        tokens, output tokens)."""
        c, seg = self._cursor, self.segment
        i = c.next
        arrival = (c.next_time_s, int(seg.prompts[i]), int(min(seg.outputs[i], seg.max_tokens[i])))
        self._advance(c)
        return arrival

    def _step_vllm(self, action) -> tuple:
        replica = self._replica
        if not self._traffic:
            replica.actions.answer(self._call, action)  # before the first arrival: the first interval's
            replica.start_traffic(self._next_arrival, self._arrival_rng_seed)
            self._traffic = True
            self._interval_start = time.monotonic()
            self._record0 = replica.record()
        self._call, x = replica.answer_and_wait(self._call, action)
        now = time.monotonic()
        dt = max(now - self._interval_start, 1e-9)
        self._interval_start = now
        good = finished = missed = rejected = 0
        for rec in replica.ended():
            outcome = record_outcome(rec, self.ttft_slo_s, self.tpot_slo_s)
            finished += outcome in ("good", "late")
            good += outcome == "good"
            rejected += outcome == "rejected"
            missed += outcome in ("late", "failed")
        record, before = replica.record(), self._record0
        self._record0 = record
        evictions = interventions = 0
        usage = 0.0
        if record is not None:
            usage = record.observation.kv_used_tokens / max(record.limits.kv_capacity_tokens, 1)
            if before is not None:
                evictions = record.observation.evictions_total - before.observation.evictions_total
                interventions = record.counters.interventions - before.counters.interventions
        norm = self.lambda_max_rps * dt
        reward = self._weighted(good, missed, rejected, evictions) / norm
        self._steps += 1
        self._add_totals(good, finished, missed, rejected, evictions)
        info = {
            "goodput_rps": good / dt, "goodput_frac": good / norm, "finished": finished, "slo_missed": missed,
            "rejections": rejected, "evictions": evictions, "kv_usage": usage, "interval_s": dt,
            "shield_interventions": interventions, "shield_intervention_rate": interventions / self.control_interval,
            "load": self.load, "policy_call": self._call, "requests_sent": replica.sent,
            "requests_dropped": replica.dropped,
        }
        obs = np.clip(np.nan_to_num(x, nan=0.0), -OBS_CLIP, OBS_CLIP).astype(np.float32)
        return self._end_of_step(obs, reward, info)

    def close(self) -> None:
        """Stop the vLLM replica the env started (the vllm backend; one it was given, its owner stops);
        nothing to do for the others."""
        if self._replica is not None:
            if self._traffic:
                self._replica.stop_traffic()
                self._traffic = False
            if self._owns_replica:
                self._replica.close()
            self._replica = None
        super().close()

    def _run_shadow(self, until_s: float) -> tuple[int, int, int, int]:
        """Advance the shadow engine (the prior alone, same arrivals) to ``until_s``; its interval's
        (good, missed, rejected, evictions)."""
        core, cursor = self._shadow, self._shadow_cursor
        clock = core.clock
        good = missed = rejected = 0
        evictions0 = core.metrics.evictions
        while clock.now() < until_s:
            rejected += self._pull_arrivals(clock.now(), core, cursor)
            if not (core.waiting or core.running):
                if cursor.next_time_s > until_s:
                    clock.advance_to(until_s)
                    break
                clock.advance_to(cursor.next_time_s)
                continue
            for r in core.step(False):
                if r.state is RequestState.FINISHED and met_slo(r, self.ttft_slo_s, self.tpot_slo_s):
                    good += 1
                else:
                    missed += 1
        return good, missed, rejected, core.metrics.evictions - evictions0

    def _set_residual(self, action) -> None:
        self.prior.set_residual(*action_to_residual(action))

    def step(self, action):
        a = [float(x) for x in np.asarray(action, dtype=np.float64).reshape(-1)[:ACTION_DIM]]
        if len(a) < ACTION_DIM or not all(math.isfinite(x) for x in a):
            a = list(DEFAULT_ACTION)
        a = tuple(-1.0 if x < -1.0 else (1.0 if x > 1.0 else x) for x in a)
        self._last_action = a
        if self._replica is not None:
            return self._step_vllm(a)
        self._set_residual(a)

        core = self.core
        clock = core.clock
        now = clock.now
        shield = self.shield
        t0 = now()
        evictions0 = core.metrics.evictions
        interventions0, magnitude0 = shield.interventions, shield.magnitude_total
        ttft_slo, tpot_slo = self.ttft_slo_s, self.tpot_slo_s
        good = finished = missed = rejected = 0
        for _ in range(self.control_interval):
            rejected += self._pull_arrivals(now())
            if not (core.waiting or core.running):
                clock.advance_to(self._cursor.next_time_s)  # idle: jump to (on a wall clock, wait for) the next one
                rejected += self._pull_arrivals(now())
            for r in core.step(False):
                if r.state is RequestState.FINISHED:
                    finished += 1
                    if met_slo(r, ttft_slo, tpot_slo):
                        good += 1
                    else:
                        missed += 1
                else:
                    missed += 1  # expired or failed
        evictions = core.metrics.evictions - evictions0
        dt = max(now() - t0, 1e-9)
        norm = self.lambda_max_rps * dt  # requests the replica could serve in the interval
        reward = self._weighted(good, missed, rejected, evictions) / norm
        if self._shadow is not None:
            reward -= self._weighted(*self._run_shadow(now())) / norm
        self._steps += 1
        self._add_totals(good, finished, missed, rejected, evictions)
        obs = self.features.update(core.observe(), self._last_action, self.prior._decision.token_budget).copy()
        n_int = shield.interventions - interventions0
        info = {
            "goodput_rps": good / dt,
            "goodput_frac": good / norm,
            "finished": finished,
            "slo_missed": missed,
            "rejections": rejected,
            "evictions": evictions,
            "kv_usage": core.pool.used_tokens / core.pool.capacity_tokens,
            "interval_s": dt,
            "shield_interventions": n_int,
            "shield_intervention_rate": n_int / self.control_interval,
            "shield_magnitude": shield.magnitude_total - magnitude0,
            "shield_last": shield.last_intervention.fields,
            "safe_activation_budget": shield.last_intervention.safe_activation_budget,
            "load": self.load,
        }
        return self._end_of_step(obs, reward, info)

    def _end_of_step(self, obs, reward: float, info: dict):
        """The step's return value; the last step of an episode drains the engines first (``drain``)."""
        self._elapsed_s += info["interval_s"]
        end = self._steps >= self.episode_steps
        if self._steps == self.episode_steps and self.drain:  # once: steps after the end do not drain again
            drained = self._drain(self.lambda_max_rps * self._elapsed_s / self._steps)
            info["drain_reward"] = drained
            return obs, float(reward + drained), True, False, info
        return obs, float(reward), False, end, info

    def _drain(self, norm: float) -> float:
        """Stop arrivals at the engine's time, finish every request on the engine (and the shadow)
        under the prior, and return the drain's reward over ``norm`` (net of the shadow's)."""
        self._set_residual(DEFAULT_ACTION)
        end_s = self.core.clock.now()
        rejected = self._pull_arrivals(end_s)
        good, finished, missed, evictions = self._settle(self.core)
        self._add_totals(good, finished, missed, rejected, evictions)
        reward = self._weighted(good, missed, rejected, evictions)
        if self._shadow is not None:
            b_rejected = self._pull_arrivals(end_s, self._shadow, self._shadow_cursor)
            b_good, _, b_missed, b_evictions = self._settle(self._shadow)
            reward -= self._weighted(b_good, b_missed, b_rejected, b_evictions)
        return reward / norm

    def _weighted(self, good: int, missed: int, rejected: int, evictions: int) -> float:
        """The reward's numerator for these counts (``reward_weights``)."""
        w = self.reward_weights
        return w["goodput"] * good - w["slo_miss"] * missed - w["rejection"] * rejected - w["eviction"] * evictions

    def _add_totals(self, good: int, finished: int, missed: int, rejected: int, evictions: int) -> None:
        t = self.totals
        t["good"] += good
        t["finished"] += finished
        t["missed"] += missed
        t["rejected"] += rejected
        t["evictions"] += evictions

    def _settle(self, core) -> tuple[int, int, int, int]:
        """Step ``core`` without new arrivals until it holds no request: (good, finished, missed,
        evictions), missed counting finished requests that missed an SLO and expired or failed ones."""
        good = finished = missed = 0
        evictions0 = core.metrics.evictions
        ttft_slo, tpot_slo = self.ttft_slo_s, self.tpot_slo_s
        for _ in range(DRAIN_MAX_STEPS):
            if not (core.waiting or core.running):
                break
            for r in core.step(False):
                done = r.state is RequestState.FINISHED
                finished += done
                if done and met_slo(r, ttft_slo, tpot_slo):
                    good += 1
                else:
                    missed += 1
        else:  # not reached while the shield's queue timeout holds; what is left counts as missed
            left = len(core.waiting) + len(core.running)
            log.warning("env drain: %d requests still held after %d steps, counted as missed", left, DRAIN_MAX_STEPS)
            missed += left
        return good, finished, missed, core.metrics.evictions - evictions0


def record_outcome(rec: dict, ttft_slo_s: float, tpot_slo_s: float) -> str:
    """What one streamed request's record (``engine.bench.vllm.clients``) counts as: ``good`` (every
    token, TTFT and TPOT within the SLOs), ``late`` (every token, an SLO missed), ``rejected`` (429)
    or ``failed`` (anything else)."""
    from tidegate.engine.bench.vllm.stats import record_tpot_s  # the vllm backend's: httpx stays out of the others

    if rec.get("status") == 429:
        return "rejected"
    if rec.get("outcome") != "completed" or rec.get("first_token_s") is None:
        return "failed"
    ttft = rec["first_token_s"] - rec["start_s"]
    return "good" if ttft <= ttft_slo_s and record_tpot_s(rec) <= tpot_slo_s else "late"
