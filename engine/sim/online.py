"""A replica's profile, refitted from its own steps while it serves.

A controller's estimates (the fluid bound of slo-flow's capacity witness, the learned policy's
features, the runtime guard's twin) read the step-time model of the replica's profile. A profile
fitted beforehand describes the machine, model and engine it was fitted on; one from another
machine or engine can be off many times over (docs/PROFILES.md, "Refitted while serving").
:class:`OnlineProfile` starts from such a prior and keeps it true to the replica: it holds the
last ``window_steps`` timed steps and refits the model's core (``engine.sim.fit.fit_core``:
base, prefill token, decode token, KV token and prefill chunk costs) every ``refit_steps`` steps
once ``min_steps`` are there, or every ``refit_s`` seconds of serving where that comes first; a fit reads
the steps of the last ``window_s`` seconds of serving alone (``min_steps`` at least). The KV size, batch limits
and SLOs stay the prior's. A fitted
profile has no optional terms and no noise: the line fitted on relative error is near the mean
step, the step the bound wants.

Controllers hold the object itself, which reads as the current profile (every attribute is the
current ``Profile``'s), so a refit reaches them without being handed over; the vLLM plugin's API
process takes the engine's fits with :meth:`OnlineProfile.adopt`.

Worst cases, each bounded by a rule that does not read the profile:

- A fit on a narrow range of batches (light load) extrapolates a line to the full batch. If it
  errs high, the bound errs low and slo-flow's capacity witness stops overruling its overload
  witnesses, which then judge alone, as they do without a profile: arrivals outpacing completions,
  or the KV at its target; nothing is refused without one of them.
- If it errs low, the bound errs high, as the prior's did; the steady-rate test (arrivals over
  hundreds of events outpacing completions) still overrules the capacity witness once a backlog
  builds.
- The window is measured in serving time, not in steps: the line is a poor model of a CPU's steps across
  regimes (the cost of a decode beside 85 running requests is some thirty times what a fit over light load
  says), and a minute of full batches is a few hundred steps where a minute of light load is thousands.
  A minute and a half into a 1.5 x overload of a vLLM CPU replica, a window of 4,096 steps still held 3,600
  of the light load before it, and the bound read 4.4 requests a second where the replica served 3.8 (5.4 at
  40 s); over a time window it read 3.8 (4.1): the fit is the regime the replica is in.
- A fit that fails (too few timed steps, a profile it cannot build) keeps the profile it had.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tidegate.engine.core.profile import Profile, ProfileError
from tidegate.engine.sim.fit import fit_core

class OnlineProfile:
    """A profile whose step-time model is refitted from the replica's timed steps.

    :param prior: the profile used until the first fit; its KV size, batch limits and SLOs stay.
    :param window_steps: the most recent steps each fit uses at most.
    :param refit_steps: steps between fits.
    :param min_steps: timed steps needed before the first fit, and the fewest each fit uses.
    :param window_s: seconds of serving (the timed steps' durations summed) whose steps each fit uses.
    :param refit_s: seconds of serving between fits, where fewer than ``refit_steps`` steps take that long.
    """

    def __init__(self, prior: Profile, window_steps: int = 4096, refit_steps: int = 256,
                 min_steps: int = 128, window_s: float = 60.0, refit_s: float = 5.0) -> None:
        if not (8 <= min_steps <= window_steps and refit_steps >= 1 and window_s > 0 and refit_s > 0):
            raise ValueError("need 8 <= min_steps <= window_steps, refit_steps >= 1, window_s > 0 and refit_s > 0")
        self.prior = prior
        self.current = prior
        #: fits made (or adopted) so far
        self.fits = 0
        #: the last fit's report (``fit_core``'s dict), None before the first
        self.last_fit: dict | None = None
        self.window_steps = window_steps
        self.refit_steps = refit_steps
        self.min_steps = min_steps
        self.window_s = window_s
        self.refit_s = refit_s
        # each row: the step's (tokens, KV read, seconds, decodes, prefill chunks) and the serving time at its end
        self._rows = np.zeros((window_steps, 6))
        self._seen = 0
        self._since = 0
        self._served_s = 0.0
        self._since_s = 0.0

    def __getattr__(self, name: str) -> Any:
        # only names the object itself lacks come here: they are the current profile's (``current``
        # itself is missing only before ``__init__`` set it, as while a copy is made)
        if name == "current" or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.current, name)

    def step(self, tokens: int, kv_tokens_read: int, seconds: float, decode_tokens: int, prefills: int) -> bool:
        """One timed step: its new tokens, the KV tokens its attention read, its duration, its decode
        tokens and its prefill chunks. True when it triggered a fit that changed the profile."""
        if not (seconds > 0 and tokens > 0):
            return False
        self._served_s += seconds
        self._rows[self._seen % self.window_steps] = (tokens, kv_tokens_read, seconds, decode_tokens, prefills,
                                                      self._served_s)
        self._seen += 1
        self._since += 1
        self._since_s += seconds
        if self._seen < self.min_steps or (self._since < self.refit_steps and self._since_s < self.refit_s
                                           and self.last_fit is not None):
            return False
        self._since, self._since_s = 0, 0.0
        return self.refit()

    def window(self) -> np.ndarray:
        """The rows the next fit reads: those of the last ``window_s`` seconds of serving, the ``min_steps`` most
        recent at least (of the ``window_steps`` held)."""
        rows = self._rows[:min(self._seen, self.window_steps)]
        ends = rows[:, 5]
        start = self._served_s - self.window_s
        if len(rows) > self.min_steps:
            start = min(start, float(np.partition(ends, len(rows) - self.min_steps)[len(rows) - self.min_steps]))
        return rows[ends >= start, :5]

    def refit(self) -> bool:
        """Fit the core to the window's steps now; True when the profile changed."""
        fit = fit_core(self.window())
        if fit is None:
            return False
        try:
            fitted = dataclasses.replace(
                self.prior, base_s=fit["base_s"], per_token_s=fit["per_token_s"],
                per_kv_token_s=fit["per_kv_token_s"], per_decode_token_s=fit["per_decode_token_s"],
                per_prefill_s=fit["per_prefill_s"], noise_sigma=0.0, extras=None,
                source=f"{self.prior.name}, refitted on the replica's last {fit['points']} steps "
                       f"(MAPE {fit['mape']:.1%})", extra={})
        except ProfileError:
            return False
        self.last_fit = fit
        self.adopt(fitted)
        return True

    def adopt(self, profile: Profile) -> None:
        """Take ``profile`` as the current one (a fit made elsewhere: the engine's, in vLLM's API process)."""
        self.current = profile
        self.fits += 1
