"""SimExecutor: the simulator twin's executor. A step's duration comes from a profile;
output lengths come from the requests themselves (the trace's or a synthetic draw)."""

from __future__ import annotations

from engine.core.executor import Batch, StepResult
from engine.core.profile import Profile
from engine.core.request import Request


class SimExecutor:
    """A step takes ``profile.step_time_s(T, K)``: the profile's one step-time formula.

    :param profile: the replica's profile (``engine.core.profile.Profile``).
    """

    def __init__(self, profile: Profile) -> None:
        self.step_time_s = profile.step_time_s

    def execute(self, batch: Batch) -> StepResult:
        return StepResult(self.step_time_s(batch.num_tokens, batch.kv_tokens_read))

    def release(self, request: Request) -> None:
        """Nothing to drop: the simulator keeps no per-request state."""
