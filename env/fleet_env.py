"""FleetEnv: the Gymnasium environment around the fleet twin, for learning the gateway's admission.

The fleet is ``engine.gateway.twin.FleetTwin``: N simulated replicas (each with its own controller,
``greedy`` by default: replicas that schedule as vLLM does) behind the gateway's own code (router,
queue, drain admission), with the wire's delay and the gauges' staleness, on one virtual clock.

One ``env.step`` sets the gateway's admission budget for the next ``interval_s`` seconds and runs the
fleet that long. The action is one number in [-1, 1]: the queue wait the gateway admits is
``2 ** action`` times what the TTFT SLO leaves after the first byte (``DrainAdmission.budget_scale``;
action 0 is the gateway's own rule, -1 admits half that wait, +1 twice). The reward is the interval's
goodput net of a small cost per refusal, over the requests the fleet could serve in the interval at
its fluid bound, as ``ServingEnv``'s. Episodes draw a stretch of a trace (or a workload family) and a
load in multiples of the fleet's fluid bound (the replicas' bounds summed). At an episode's end the
arrivals stop and the fleet serves what it holds under action 0 (``drain``): what a policy let in late
is paid for. The observation is ``engine.gateway.features.FleetFeatures``'s vector, which the HTTP
gateway computes the same way. Observation, action and reward are tabulated in docs/ENV.md.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from tidegate.ctrl import build_controller
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import met_slo
from tidegate.engine.gateway.features import FLEET_OBS_DIM, FEATURE_CLIP, FleetFeatures, budget_scale
from tidegate.engine.gateway.routers import ROUTERS
from tidegate.engine.gateway.twin import FleetSettings, FleetTwin
from tidegate.engine.workloads import Arrival, split_segments
from tidegate.engine.workloads.families import family_segment, load_family
from tidegate.env.serving_env import check_shared_options

#: the reward's weights, as ``ServingEnv``'s defaults: goodput, and a small cost per refusal so that, goodput
#: being equal, serving wins over refusing
FLEET_REWARD_WEIGHTS = {"goodput": 1.0, "slo_miss": 0.0, "rejection": 0.01}


class _Counts:
    """The requests that ended, by outcome, since the last ``take``; the ends of those the gateway admitted
    also go to the policy's ``features`` (if any)."""

    __slots__ = ("good", "missed", "rejected", "ttft_slo_s", "tpot_slo_s", "features")

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float, features: FleetFeatures | None) -> None:
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.good = self.missed = self.rejected = 0
        self.features = features

    def __call__(self, request: Request) -> None:
        if request.state is RequestState.REJECTED:
            self.rejected += 1
            return
        good = request.state is RequestState.FINISHED and met_slo(request, self.ttft_slo_s, self.tpot_slo_s)
        if good:
            self.good += 1
        else:
            self.missed += 1
        if self.features is not None:
            self.features.on_end(good)

    def take(self) -> tuple[int, int, int]:
        out = (self.good, self.missed, self.rejected)
        self.good = self.missed = self.rejected = 0
        return out


class FleetEnv(gym.Env):
    """Learn the gateway's admission in front of a fleet of simulated replicas.

    :param replicas: how many replicas the fleet has (each of ``profile``).
    :param profile: the replicas' profile: a name, path or ``Profile`` (default a100-llama2-7b).
    :param replica_controller: each replica's own controller spec (``greedy``: vLLM's scheduling).
    :param router: the gateway's router (``engine.gateway.routers.ROUTERS``).
    :param trace: a shipped trace name or path, a list of them, or a list of ``Arrival``s (None:
        splitwise_conv for ``train``, splitwise_conv and splitwise_code for ``eval``).
    :param split: ``train`` (first 70% of each trace) or ``eval`` (the rest; all of splitwise_code).
    :param families: workload family names or YAML paths; when given, each episode samples
        ``episode_requests`` requests from one drawn uniformly (``trace`` and ``split`` unused).
    :param load_range: (low, high) offered load as multiples of the fleet's fluid bound; each episode
        draws one log-uniformly.
    :param interval_s: seconds of the fleet's clock per env step (default: half the TTFT SLO).
    :param episode_steps: env steps per episode.
    :param reward_weights: weights of ``goodput``, ``slo_miss`` and ``rejection``.
    :param baseline: ``prior``: the reward is net of a shadow fleet's at action 0 (the gateway's own rule)
        on the same arrivals and step noise, advanced to the same time; ``none``: the plain reward.
    :param drain: at an episode's end, arrivals stop and the fleet serves what it holds at action 0; the
        drain's reward is added to the last step's and the episode ends ``terminated``. Without it the
        episode ends ``truncated``.
    :param settings: the gateway's and the wire's settings (``FleetSettings``; its ``admission`` must be on, and
        its router is ``router``).
    :param seed: seed of the episode draws (``reset(seed=...)`` overrides it).
    """

    metadata = {"render_modes": []}

    def __init__(self, replicas: int = 4, profile=None, replica_controller: str = "greedy",
                 router: str = "predicted-delay", trace=None, split: str = "train", families=None,
                 episode_requests: int = 3000, load_range: tuple[float, float] = (0.5, 2.0),
                 interval_s: float | None = None, episode_steps: int = 128, reward_weights: dict | None = None,
                 baseline: str = "none", drain: bool = True, settings: FleetSettings | None = None,
                 seed: int | None = None) -> None:
        super().__init__()
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a whole number >= 1, got {replicas!r}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        low, high = check_shared_options(load_range, reward_weights, FLEET_REWARD_WEIGHTS, baseline)
        if episode_steps < 1:
            raise ValueError(f"episode_steps must be >= 1, got {episode_steps}")
        if interval_s is not None and not (isinstance(interval_s, (int, float)) and 0 < interval_s < math.inf):
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        settings = settings or FleetSettings()
        if not settings.admission:
            raise ValueError("the fleet env learns the gateway's admission: settings.admission must be on")
        self.profile = load_profile(profile or "a100-llama2-7b") if not hasattr(profile, "base_s") else profile
        build_controller(replica_controller, self.profile)  # a bad spec fails here, in one sentence
        self.replicas = replicas
        self.replica_controller = replica_controller
        self.settings = FleetSettings(**{**vars(settings), "router": router})
        self.families = [load_family(f) for f in families] if families else []
        self.episode_requests = int(episode_requests)
        self.segments = [] if self.families else split_segments(trace, split, self.profile, None)
        self.load_range = (low, high)
        self.interval_s = float(interval_s) if interval_s is not None else self.profile.ttft_slo_s / 2
        self.episode_steps = int(episode_steps)
        self.reward_weights = {**FLEET_REWARD_WEIGHTS, **(reward_weights or {})}
        self.baseline = baseline
        self.drain = bool(drain)
        self._seed = seed
        self._episode = 0
        self.fleet: FleetTwin | None = None
        self.observation_space = spaces.Box(-FEATURE_CLIP, FEATURE_CLIP, shape=(FLEET_OBS_DIM,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)

    # ------------------------------------------------------------------ episodes
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and self._seed is not None and self._episode == 0:
            seed = self._seed
        super().reset(seed=seed)
        rng = self.np_random
        options = options or {}
        if self.families:
            family = self.families[int(options.get("family", rng.integers(len(self.families))))]
            seg = family_segment(family, self.profile, rng, self.episode_requests)
        else:
            seg = self.segments[int(options.get("segment", rng.integers(len(self.segments))))]
        low, high = self.load_range
        self.load = float(options.get("load", math.exp(rng.uniform(math.log(low), math.log(high)))))
        self.lambda_max_rps = self.replicas * seg.lambda_max_rps
        start = 0 if self.families else int(options.get("start_index", rng.integers(len(seg.times_s))))
        self.arrivals = _episode_arrivals(seg, start, self.load * self.lambda_max_rps / seg.mean_rate_rps,
                                          self.interval_s * self.episode_steps)
        noise_seed = int(rng.integers(1 << 31))
        self.features = FleetFeatures(self.profile.ttft_slo_s)
        self.fleet, self._counts = self._make_fleet(noise_seed, self.features)
        self._shadow = self._shadow_counts = None
        if self.baseline == "prior":
            self._shadow, self._shadow_counts = self._make_fleet(noise_seed, None)
        self._arrived_before = 0
        self._steps = 0
        self._last_action = 0.0
        self._episode += 1
        self.totals = {"good": 0, "missed": 0, "rejected": 0}
        self.features.reset(self.fleet.now)
        obs = self.features.read(self.fleet.gate, self.fleet.now, 0.0)
        return obs, {"load": self.load, "segment": seg.name, "lambda_max_rps": self.lambda_max_rps,
                     "requests": len(self.arrivals)}

    def _make_fleet(self, noise_seed: int, features: FleetFeatures | None) -> tuple[FleetTwin, _Counts]:
        controllers = [build_controller(self.replica_controller, self.profile, self.arrivals)
                       for _ in range(self.replicas)]
        fleet = FleetTwin(self.arrivals, self.profile, controllers, self.settings, True, noise_seed)
        counts = _Counts(self.profile.ttft_slo_s, self.profile.tpot_slo_s, features)
        fleet.on_end = counts
        fleet.start()
        return fleet, counts

    def step(self, action):
        if self.fleet is None:
            raise RuntimeError("call reset() before step()")
        a = float(np.asarray(action, dtype=np.float64).reshape(-1)[0]) if np.size(action) else 0.0
        a = max(-1.0, min(1.0, a)) if math.isfinite(a) else 0.0  # what budget_scale reads
        self._last_action = a
        fleet = self.fleet
        fleet.admission.budget_scale = budget_scale(a)
        t0 = fleet.now
        until = t0 + self.interval_s
        fleet.advance(until)
        good, missed, rejected = self._counts.take()
        norm = self.lambda_max_rps * self.interval_s
        reward = self._weighted(good, missed, rejected) / norm
        if self._shadow is not None:
            self._shadow.advance(until)
            reward -= self._weighted(*self._shadow_counts.take()) / norm
        self._add_totals(good, missed, rejected)
        arrived = fleet.arrived - self._arrived_before
        self._arrived_before = fleet.arrived
        self._steps += 1
        # the interval's arrivals and the gateway's refusals of them (a refusal ends a request at its arrival)
        self.features.arrived, self.features.refused = arrived, rejected
        obs = self.features.read(fleet.gate, fleet.now, a)
        info = {"goodput_rps": good / self.interval_s, "goodput_frac": good / norm, "slo_missed": missed,
                "rejections": rejected, "arrivals": arrived, "budget_scale": fleet.admission.budget_scale,
                "queue": len(fleet.queue), "load": self.load, "interval_s": self.interval_s}
        if self._steps < self.episode_steps:
            return obs, float(reward), False, False, info
        if self._steps == self.episode_steps and self.drain:
            drained = self._drain(norm)
            info["drain_reward"] = drained
            return obs, float(reward + drained), True, False, info
        return obs, float(reward), False, True, info

    def _drain(self, norm: float) -> float:
        """Serve every arrival left at action 0; the drain's reward over ``norm`` (net of the shadow's)."""
        self.fleet.admission.budget_scale = 1.0
        self.fleet.advance(math.inf)
        self.fleet.finish()
        counts = self._counts.take()
        self._add_totals(*counts)
        reward = self._weighted(*counts)
        if self._shadow is not None:
            self._shadow.advance(math.inf)
            self._shadow.finish()
            reward -= self._weighted(*self._shadow_counts.take())
        return reward / norm

    def _weighted(self, good: int, missed: int, rejected: int) -> float:
        w = self.reward_weights
        return w["goodput"] * good - w["slo_miss"] * missed - w["rejection"] * rejected

    def _add_totals(self, good: int, missed: int, rejected: int) -> None:
        self.totals["good"] += good
        self.totals["missed"] += missed
        self.totals["rejected"] += rejected


def _episode_arrivals(seg, start: int, rate_scale: float, span_s: float) -> list[Arrival]:
    """The segment's requests from index ``start`` on, ``rate_scale`` times as fast, wrapping around its end,
    for ``span_s`` seconds."""
    out: list[Arrival] = []
    n = len(seg.times_s)
    i, offset = start, -float(seg.times_s[start])
    while True:
        t = (float(seg.times_s[i]) + offset) / rate_scale
        if t >= span_s:
            return out
        out.append(Arrival(t, int(seg.prompts[i]), int(seg.outputs[i]), int(seg.max_tokens[i])))
        i += 1
        if i == n:
            i, offset = 0, offset + seg.span_s
