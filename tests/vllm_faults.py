"""A vLLM scheduler whose controller misbehaves on purpose, for tests/test_vllm.py.

vLLM's engine process loads it by ``--scheduler-cls vllm_faults.FaultyScheduler`` with tests/ on
its PYTHONPATH. The controller is the configured one, except that while the file named by
``TIDEGATE_TEST_FAULTS`` exists, its calls raise, answer a Decision that is not a number, or sleep
past the plugin's decision timeout, in a fixed rotation. (So one server serves the tests of the
plugin as it is, then those of its faults: a vLLM start is a minute of a 2-core machine.)
"""

from __future__ import annotations

import math
import os
import time

from tidegate.ctrl.base import Decision
from tidegate.engine.vllm.scheduler import TidegateScheduler

#: how long a slow call sleeps (well past the plugin's default decision timeout, 0.05 s)
SLOW_S = 0.3


class FaultyController:
    """Of every 4 calls the 1st raises and the 2nd answers NaN activations; every 40th call (the 20th,
    the 60th, ...) sleeps ``SLOW_S`` first. The other calls are the wrapped controller's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0
        self.switch = os.environ.get("TIDEGATE_TEST_FAULTS", "")

    def decide(self, obs):
        if not (self.switch and os.path.exists(self.switch)):
            return self.inner.decide(obs)
        self.calls += 1
        k = self.calls
        if k % 40 == 20:
            time.sleep(SLOW_S)
        if k % 4 == 1:
            raise RuntimeError("a controller that fails on purpose")
        if k % 4 == 2:
            return Decision(math.nan, 512, 64)
        return self.inner.decide(obs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FaultyScheduler(TidegateScheduler):
    """The plugin's scheduler around a :class:`FaultyController`."""

    def _start_tidegate(self) -> None:
        super()._start_tidegate()
        assert self._decider is not None, "FaultyScheduler needs a controller, not the pass-through"
        self._decider.controller = FaultyController(self._decider.controller)
