"""SimExecutor: the simulator twin's executor. A step's duration comes from a profile;
output lengths come from the requests themselves (the trace's or a synthetic draw)."""

from __future__ import annotations

from engine.core.executor import Batch, StepResult
from engine.core.request import Request


class SimExecutor:
    """Step time ``base_s + per_token_s * tokens + per_kv_token_s * kv_tokens_read``.

    :param profile: an ``engine.core.profile.Profile`` (or anything with the same coefficients).
    """

    def __init__(self, profile) -> None:
        self.base_s = profile.base_s
        self.per_token_s = profile.per_token_s
        self.per_kv_token_s = profile.per_kv_token_s
        self.idle_s = profile.idle_s if profile.idle_s is not None else profile.base_s

    def execute(self, batch: Batch) -> StepResult:
        if not batch.num_tokens:
            return StepResult(self.idle_s)
        return StepResult(self.base_s + self.per_token_s * batch.num_tokens
                          + self.per_kv_token_s * batch.kv_tokens_read)

    def release(self, request: Request) -> None:
        """Nothing to drop: the simulator keeps no per-request state."""
