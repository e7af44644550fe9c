"""vLLM v1's default scheduler: activate FIFO while the pool has blocks for the prompt, up to
``max_num_seqs`` running and a ``max_num_batched_tokens`` step budget; on overflow the newest
request is preempted and recomputed (the engine's LIFO eviction)."""

from __future__ import annotations

from typing import ClassVar

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation


class GreedyController(Controller):
    """:param max_num_seqs: most running requests (vLLM default 256).
    :param max_num_batched_tokens: most new tokens per step (vLLM v1 default 8192 with chunked prefill).
    """

    name: ClassVar[str] = "greedy"

    def __init__(self, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_waiting: int | None = None,
                 queue_timeout_s: float | None = None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self._decision = Decision(UNLIMITED, max_num_batched_tokens, max_num_seqs)

    def decide(self, obs: Observation) -> Decision:
        return self._decision

    def steady_decision(self) -> Decision:
        return self._decision
