"""PolicyWorker: runs policy calls off the engine's thread, with a wall-clock deadline per call.

``LearnedController`` uses it once its engine runs on a wall clock, so that a slow or hung policy
never stalls a step: the step waits at most the policy's time budget, then goes on without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from tidegate.ctrl.policy import as_action


class PolicyWorker:
    """Runs policy calls on one daemon thread (started at the first call), one call at a time, so
    that a slow or hung policy never holds up the engine's thread: :meth:`call` hands an observation
    over and waits at most its timeout for the action. An answer that comes later is discarded.

    A copy (``copy.deepcopy``, pickle) is a new idle worker: threads and locks are not copied.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._job: tuple[int, Callable, np.ndarray] | None = None
        self._issued = 0  # calls handed over
        self._answered = 0  # the call whose answer is in _answer
        self._answer: tuple[float, float, float] | Exception | None = None

    def __reduce__(self):
        return (PolicyWorker, ())

    @property
    def started(self) -> bool:
        """Whether the thread exists (only after a call on a wall clock)."""
        return self._thread is not None

    @property
    def busy(self) -> bool:
        """Whether a call handed over earlier is still running."""
        return self._answered != self._issued

    def call(self, policy, obs: np.ndarray, timeout_s: float) -> tuple[float, float, float] | Exception | None:
        """``policy(obs)`` as three floats, the exception it raised, or None when no answer came
        within ``timeout_s``. Call only when not :attr:`busy`; ``obs`` must not change afterwards."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="tidegate-policy", daemon=True)
                self._thread.start()
            self._issued += 1
            call = self._issued
            self._job = (call, policy, obs)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._answered == call, timeout_s):
                return None
            return self._answer

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no call is running; False if one still is after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.busy, timeout_s)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                call, policy, obs = self._job
                self._job = None
            answer: tuple[float, float, float] | Exception
            try:
                answer = as_action(policy(obs))
            except Exception as exc:
                answer = exc
            with self._cond:
                self._answer = answer
                self._answered = call
                self._cond.notify_all()
