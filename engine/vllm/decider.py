"""The Decision a step of vLLM applies: the controller's, checked, and in time; else a conservative one.

The controller is called inline: tidegate's controllers answer in microseconds, and handing each
call to another thread cost half a millisecond a step in vLLM's engine process (the thread waits
for the interpreter lock), a tenth of a small model's step. A call that takes longer than
``timeout_s`` is counted as a fallback, and from then on the controller answers on a thread of its
own and each step waits at most ``timeout_s`` for it: a slow or hung controller then costs a step
that wait, and the steps after it nothing while it is still busy (they take the conservative
decision at once). The learned controller's policy has a thread and a time budget of its own
(``LearnedController``). A controller that raises or answers something that is not a usable
Decision is checked exactly as tidegate's own engine checks it (``tidegate.engine.core.decision``).
Every fallback is counted by cause and logged once per cause.
"""

from __future__ import annotations

import logging
import threading
import time

from tidegate.ctrl.base import Controller, Decision, Observation
from tidegate.engine.core.decision import bounded, plainly_usable

log = logging.getLogger(__name__)


class _Worker:
    """One daemon thread that runs ``controller.decide`` calls, one at a time."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._cond = threading.Condition()
        self._obs: Observation | None = None
        self._issued = self._answered = 0
        self._answer: object = None
        self._error: BaseException | None = None
        threading.Thread(target=self._serve, name="tidegate-decide", daemon=True).start()

    @property
    def busy(self) -> bool:
        return self._answered != self._issued

    def call(self, obs: Observation, timeout_s: float) -> tuple[bool, object, BaseException | None]:
        """``(answered, decision, exception)`` of ``decide(obs)`` within ``timeout_s``."""
        with self._cond:
            self._issued += 1
            call = self._issued
            self._obs = obs
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._answered == call, timeout_s):
                return False, None, None
            return True, self._answer, self._error

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no call is running; False if one still is after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.busy, timeout_s)

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._obs is not None)
                obs, self._obs = self._obs, None
                call = self._issued
            answer, error = None, None
            try:
                answer = self.controller.decide(obs)
            except Exception as exc:
                error = exc
            with self._cond:
                self._answer, self._error, self._answered = answer, error, call
                self._cond.notify_all()


class CheckedDecider:
    """Asks ``controller`` for each step's Decision and hands back one the scheduler can apply.

    :param controller: any tidegate controller.
    :param timeout_s: the longest a step waits for the answer (on the controller's thread, once one
        call took longer inline).
    :param token_budget: vLLM's configured token budget, the conservative one until a decision applies.
    :param running_cap: vLLM's configured running cap, the same.
    """

    def __init__(self, controller: Controller, timeout_s: float, token_budget: int, running_cap: int) -> None:
        self.controller = controller
        self.timeout_s = timeout_s
        #: the controller's thread, once a call took longer than ``timeout_s`` (None: it is called inline)
        self.worker: _Worker | None = None
        #: steps whose decision was the conservative one, by cause
        self.fallbacks: dict[str, int] = {}
        #: the cause of the last step's fallback (None: the controller's decision was applied)
        self.last_fallback: str | None = None
        #: wall seconds the last step waited for its decision
        self.last_wait_s = 0.0
        self._token_budget = token_budget
        self._running_cap = running_cap

    def decide(self, obs: Observation) -> Decision:
        """The Decision for a step observed as ``obs`` (``obs.num_running`` requests running)."""
        self.last_fallback = None
        worker = self.worker
        start = time.perf_counter()
        if worker is None:
            try:
                d = self.controller.decide(obs)
            except Exception as exc:
                return self._conservative(obs, f"controller.decide raised {type(exc).__name__}", exc)
            finally:
                self.last_wait_s = time.perf_counter() - start
            if self.last_wait_s > self.timeout_s:
                self.worker = _Worker(self.controller)
                return self._conservative(obs, f"controller.decide took longer than {self.timeout_s:g} s "
                                               "(it answers on a thread of its own from now on)")
            return self._checked(obs, d)
        if worker.busy:
            self.last_wait_s = 0.0
            return self._conservative(obs, "controller.decide is still busy with an earlier step")
        answered, d, error = worker.call(obs, self.timeout_s)
        self.last_wait_s = time.perf_counter() - start
        if not answered:
            return self._conservative(obs, f"controller.decide took longer than {self.timeout_s:g} s")
        if error is not None:
            return self._conservative(obs, f"controller.decide raised {type(error).__name__}", error)
        return self._checked(obs, d)

    def _checked(self, obs: Observation, d: object) -> Decision:
        try:
            if type(d) is Decision:
                if plainly_usable(d):
                    return self._applied(d)
            elif not isinstance(d, Decision):
                return self._conservative(obs, f"controller.decide returned {type(d).__name__}, not a Decision")
            checked = bounded(d)
            if isinstance(checked, str):
                return self._conservative(obs, f"controller.decide gave {checked}")
            return self._applied(checked)
        except Exception as exc:  # a field that fails to read, convert or compare
            return self._conservative(obs, f"controller.decide gave an unusable Decision ({type(exc).__name__})",
                                      exc)

    def _applied(self, d: Decision) -> Decision:
        self._token_budget, self._running_cap = d.token_budget, d.running_cap
        return d

    def _conservative(self, obs: Observation, cause: str, exc: BaseException | None = None) -> Decision:
        """No activation while anything runs (the queue's head when nothing does, so vLLM never
        stalls), every remaining max_tokens reserved, the last applied token budget and running cap."""
        seen = self.fallbacks.get(cause, 0)
        self.fallbacks[cause] = seen + 1
        self.last_fallback = cause
        if not seen:
            log.warning("tidegate: %s; this step takes the conservative decision (logged once, counted from now "
                        "on)", cause, exc_info=exc)
        return Decision(0 if obs.num_running else 1, self._token_budget, max(self._running_cap, 1), 1.0)
