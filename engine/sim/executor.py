"""SimExecutor: the simulator twin's executor. A step's duration comes from a profile;
output lengths come from the requests themselves (the trace's or a synthetic draw)."""

from __future__ import annotations

import math
import random

from mypy_extensions import mypyc_attr

from tidegate.engine.core.executor import Batch, StepResult
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request


class StepNoise:
    """Seeded log-normal factors with median 1: ``exp(sigma * Z)``, Z standard normal; with
    ``corr`` > 0, successive Z form an AR(1) series, ``Z' = corr * Z + sqrt(1 - corr^2) * E``
    (E a fresh standard normal, the first Z drawn as one), so each Z stays standard normal. With
    ``white`` = w > 0, the Z used is ``sqrt(1 - w) * Z + sqrt(w) * E'``, E' one more fresh standard
    normal: still standard normal, its correlation ``(1 - w) * corr^k`` at lag k. With
    ``sigma_below``, a Z below 0 is scaled by it instead: the factor's median stays 1.

    :param sigma: the log-normal's sigma (``Profile.noise_sigma``); 0 gives factors of exactly 1.
    :param seed: seeds the draws, so a simulation stays a pure function of its inputs.
    :param corr: lag-one correlation of successive Z (``Profile.noise_corr``), in [0, 1).
    :param sigma_below: the sigma below the median (``Profile.noise_sigma_below``; None: ``sigma``).
    :param white: the share of Z's variance drawn afresh at every step (``Profile.noise_white``), in
        [0, 1]; 0 draws the same factors as before it existed.
    """

    def __init__(self, sigma: float, seed: int = 0, corr: float = 0.0, sigma_below: float | None = None,
                 white: float = 0.0) -> None:
        for name, value in (("sigma", sigma), ("sigma below the median", sigma_below)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"noise {name} must be a non-negative number, got {value!r}")
        if not 0.0 <= corr < 1.0:
            raise ValueError(f"noise correlation must be in [0, 1), got {corr!r}")
        if not 0.0 <= white <= 1.0:
            raise ValueError(f"noise white share must be in [0, 1], got {white!r}")
        self.sigma = sigma
        self.corr = corr
        self.sigma_below = sigma_below
        self._fresh = math.sqrt(1.0 - corr * corr)
        self._white = math.sqrt(white)
        self._wander = math.sqrt(1.0 - white)
        self._rng = random.Random(seed)
        self._z: float | None = None

    def __call__(self, scale: float = 1.0) -> float:
        """The next factor, its sigmas times ``scale`` (``Profile.noise_scale``); the draws are the
        same whatever the scale."""
        if not self.sigma:
            return 1.0
        below = self.sigma_below
        if not self.corr and below is None:
            return self._rng.lognormvariate(0.0, self.sigma * scale)
        e = self._rng.gauss(0.0, 1.0)
        z = self._z = e if self._z is None or not self.corr else self.corr * self._z + self._fresh * e
        if self._white and self.corr:
            z = self._wander * z + self._white * self._rng.gauss(0.0, 1.0)
        return math.exp((self.sigma if z >= 0.0 or below is None else below) * scale * z)


@mypyc_attr(allow_interpreted_subclasses=True)  # an executor with other step times or outputs
class SimExecutor:
    """A step takes ``profile.step_time_s(T, K, D, C, Q, F, A, B)``, the profile's one step-time formula,
    times a seeded log-normal factor when the profile has ``noise_sigma`` > 0 (idle ticks are exact),
    whose sigmas shrink for steps longer than ``noise_knee_s`` (``Profile.noise_scale``).
    A and B, the weights of the prefill steps before and of their prefill tokens, are kept here
    from the steps this executor ran.

    :param profile: the replica's profile (``engine.core.profile.Profile``).
    :param seed: seeds the step-time noise.
    """

    #: a step's time depends on the batch's counts only, and no token ids come back: the engine
    #: may count steady decodes in aggregate (a subclass that reads ``batch.requests`` sets True)
    reads_requests = False

    def __init__(self, profile: Profile, seed: int = 0) -> None:
        self.step_time_s = profile.median_step_s  # the engine's counts are consistent by construction
        self.noise = (StepNoise(profile.noise_sigma, seed, profile.noise_corr, profile.noise_sigma_below,
                                profile.noise_white)
                      if profile.noise_sigma else None)
        self._noise_knee = profile.noise_knee_s
        self._noise_scale = profile.noise_scale
        self._after_cost = profile.per_after_prefill_s or profile.per_after_prefill_token_s
        self._after_decay = profile.after_prefill_decay
        #: the weights A and B of the prefill steps so far and of their prefill tokens
        #: (``engine.core.profile.after_prefill_weights``)
        self.after_prefill = 0.0
        self.after_prefill_tokens = 0.0

    def execute(self, batch: Batch) -> StepResult:
        tokens = batch.num_tokens
        after = after_tokens = 0.0
        if self._after_cost and tokens:
            after, after_tokens = self.after_prefill, self.after_prefill_tokens
            decay, prefill = self._after_decay, tokens - batch.num_decodes
            self.after_prefill = decay * after + (1.0 if prefill else 0.0)
            self.after_prefill_tokens = decay * after_tokens + prefill
        t = self.step_time_s(tokens, batch.kv_tokens_read, batch.num_decodes, batch.num_prefills,
                             batch.prefill_pairs, batch.first_decodes, after, after_tokens)
        if self.noise is not None and tokens:
            t *= self.noise(self._noise_scale(t) if self._noise_knee and t > self._noise_knee else 1.0)
        return StepResult(t)

    def release(self, request: Request) -> None:
        """Nothing to drop: the simulator keeps no per-request state."""
