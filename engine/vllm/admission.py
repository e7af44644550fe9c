"""Arrivals decided in vLLM's API process, by a twin of the engine's controller, without waiting.

The engine publishes its latest Observation and the controller's admission state after every step
(``channel``). The API process builds the same controller from the same settings on the replica's
limits (read from the record), copies the admission state into it (and the step model the engine
last refitted from its steps), and asks ``admit``. Requests
that it admitted and that the engine has not seen yet count as waiting (tidegate's own server does
the same), so a flood that arrives between two steps is not judged on an empty queue; they and the
arrivals refused since the record was written join its busy period (``FrontArrivals``), so the busy
period's witness of overload sees the flood as it lands, as the engine's own stats would.

No record yet (start-up), a record the engine stopped updating while it had work, or an ``admit``
that raises: the arrival is admitted (fail open) and counted by cause.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from tidegate.ctrl.base import Controller, Rejection
from tidegate.engine.core.stats import FrontArrivals
from tidegate.engine.sim.online import OnlineProfile
from tidegate.engine.vllm.channel import EngineRecord, EngineRecordReader, RefusalWriter, default_channel
from tidegate.engine.vllm.config import PluginConfig, build_plugin_controller, replica_profile

log = logging.getLogger(__name__)

#: a record older than this while the engine had requests means the engine stopped stepping
STALE_AFTER_S = 10.0
#: the most engine requests (``n`` choices times prompts) one arrival is judged as; vLLM decides whether it serves more
MOST_JUDGED = 1024


def reason_label(rejection: Rejection) -> str:
    """The metric label of a refusal: the first word of its reason, as ``tidegate serve`` counts them."""
    word = rejection.reason.split(" ", 1)[0].lower()
    return "".join(c for c in word if c.isalnum() or c == "_") or "refused"


class AdmissionGate:
    """The API process's admission: one per vLLM server, used from its event loop only.

    :param config: the plugin's settings (the same the engine reads).
    :param channel: the shared records' path prefix (default: named after this process's pid).
    """

    def __init__(self, config: PluginConfig, channel: str | None = None) -> None:
        self.config = config
        self.channel = channel or config.channel or default_channel(os.getpid())
        self._reader = EngineRecordReader(self.channel)
        self._refusals: RefusalWriter | None = None
        self.controller: Controller | None = None
        # the twin's profile, when it takes the engine's refits of the step model
        self._profile: OnlineProfile | None = None
        #: refusals by reason label
        self.refusals: dict[str, int] = {}
        #: arrivals admitted without a usable record or answer, by cause
        self.fail_open: dict[str, int] = {}
        self.admitted = 0
        self.latest: EngineRecord | None = None
        # engine requests admitted here (net of those answered with an error before the engine saw
        # them), their prompt sizes, and the arrivals the engine saw that did not come through here
        self._net_admitted = 0
        self._sizes: deque[int] = deque(maxlen=4096)
        self._offset = 0
        self._errors_logged: set[str] = set()
        # the times of the arrivals judged here, and of those refused (wall clock: the record's is)
        self._front = FrontArrivals()
        self._refused_at: deque[float] = deque(maxlen=4096)
        atexit.register(self.close)

    def admit(self, prompt_tokens: int, max_tokens: int, requests: int = 1) -> Rejection | None:
        """The twin controller's answer on an arrival of ``requests`` engine requests (``n`` choices
        or several prompts) of ``prompt_tokens`` and ``max_tokens`` each; None admits them. An arrival of more
        than ``MOST_JUDGED`` is judged as that many (its cost here would grow with a client's ``n``)."""
        requests = min(requests, MOST_JUDGED)
        now = time.time()
        for _ in range(requests):  # every arrival judged here, as tidegate serve's front counts them
            self._front.judged(now)
        record = self._reader.read()
        if record is None:
            self._open("no_observation", requests, prompt_tokens)
            return None
        self.latest = record
        obs = record.observation
        if record.age_s > STALE_AFTER_S and (obs.num_running or obs.num_waiting):
            self._open("stale_observation", requests, prompt_tokens)
            return None
        try:
            controller = self.controller or self._twin(record)
            controller.set_admission_state(record.admission_state)
            fitted = record.counters.fitted
            if fitted is not None and self._profile is not None and self._profile.current is not fitted:
                self._profile.adopt(fitted)  # the engine refitted the step model
            # what was admitted here and has not reached the engine yet waits too
            self._offset = max(self._offset, record.arrivals - self._net_admitted)
            in_transit = min(max(self._net_admitted + self._offset - record.arrivals, 0), len(self._sizes))
            # the engine counts the refusals it reads at its next step
            refused = len(self._refused_at) - bisect.bisect_right(self._refused_at, record.published_wall_s)
            self._front.count(obs, in_transit + refused + requests, now)
            obs.num_waiting += in_transit
            obs.waiting_prompt_tokens += sum(itertools.islice(reversed(self._sizes), in_transit))
            for _ in range(requests):
                rejection = controller.admit(obs, prompt_tokens, max_tokens)
                if rejection is not None:
                    return self._refuse(rejection, prompt_tokens, requests)
                obs.num_waiting += 1
                obs.waiting_prompt_tokens += prompt_tokens
        except Exception as exc:  # admission must never fail a request with a 500
            cause = f"admit raised {type(exc).__name__}"
            if cause not in self._errors_logged:
                self._errors_logged.add(cause)
                log.exception("tidegate: the controller's %s; arrivals are admitted (logged once)", cause)
            self._open("admit_failed", requests, prompt_tokens)
            return None
        self._admitted(requests, prompt_tokens)
        return None

    def not_queued(self, requests: int) -> None:
        """Admitted requests that vLLM answered with an error before its engine saw them."""
        self._net_admitted -= requests

    def close(self) -> None:
        """Unmap the records and remove them (the engine removes its own at shutdown; not when killed)."""
        self._reader.close()
        if self._refusals is not None:
            self._refusals.close()
            self._refusals = None
        for suffix in (".obs", ".refusals"):
            Path(self.channel + suffix).unlink(missing_ok=True)

    def _twin(self, record: EngineRecord) -> Controller:
        profile = replica_profile(self.config, record.limits)
        controller = build_plugin_controller(self.config, profile)
        if controller is None:
            raise RuntimeError("the pass-through controller decides no arrivals")
        self.controller = controller
        self._profile = profile if isinstance(profile, OnlineProfile) else None
        return controller

    def _admitted(self, requests: int, prompt_tokens: int) -> None:
        self.admitted += requests
        self._net_admitted += requests
        self._sizes.extend([prompt_tokens] * min(requests, 4096))

    def _open(self, cause: str, requests: int, prompt_tokens: int) -> None:
        self.fail_open[cause] = self.fail_open.get(cause, 0) + requests
        self._admitted(requests, prompt_tokens)

    def _refuse(self, rejection: Rejection, prompt_tokens: int, requests: int) -> Rejection:
        label = reason_label(rejection)
        self.refusals[label] = self.refusals.get(label, 0) + 1
        if self._refusals is None:
            self._refusals = RefusalWriter(self.channel)
        now = time.time()
        for _ in range(requests):
            self._refusals.refused(prompt_tokens)
            self._refused_at.append(now)
        return rejection

    def counters(self) -> tuple[dict[str, int], dict[str, int], Any]:
        """(refusals by reason, fail-opens by cause, the engine's counters or None) for /metrics."""
        record = self._reader.read()
        return dict(self.refusals), dict(self.fail_open), record.counters if record is not None else None
