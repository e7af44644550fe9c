"""Clocks: virtual time for the simulator, wall time for the real engine."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """What EngineCore needs of time: read it, and move it (virtual) or wait for it (wall)."""

    def now(self) -> float: ...

    def advance(self, seconds: float) -> None: ...

    def advance_to(self, time_s: float) -> None: ...


class VirtualClock:
    """Simulated time that moves only when the simulator advances it."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def now(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds

    def advance_to(self, time_s: float) -> None:
        if time_s > self.now_s:
            self.now_s = time_s


class WallClock:
    """Monotonic wall time in seconds since the clock was made."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def advance(self, seconds: float) -> None:
        """The real engine's time passes by itself; executing the step was the advance."""

    def advance_to(self, time_s: float) -> None:
        delay = time_s - self.now()
        if delay > 0:
            time.sleep(delay)
