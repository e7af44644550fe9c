"""The executor interface: the only thing the simulator twin and the real engine do not share."""

from __future__ import annotations

from typing import Protocol

from tidegate.engine.core.request import Request


class Batch:
    """The work of one step, its plan (vLLM's ``SchedulerOutput``): built fresh by the scheduler
    at every step, each scheduled request with its number of new tokens.

    A request samples an output token in this step when its new tokens reach the end of its
    sequence (the last prefill chunk, or a decode).

    :param requests: scheduled requests, decodes first, then prefill chunks (for an executor with
        ``reads_requests = False``, decodes counted in aggregate are not listed).
    :param num_new_tokens: new tokens per request, parallel to ``requests``.
    :param num_tokens: total new tokens in the step.
    :param kv_tokens_read: context tokens the step's attention reads (cached plus new).
    """

    __slots__ = ("requests", "num_new_tokens", "num_tokens", "kv_tokens_read", "num_decodes", "num_prefills",
                 "prefill_pairs", "first_decodes")

    def __init__(self) -> None:
        # scheduled requests: the listed decodes first, then the prefill chunks
        self.requests: list[Request] = []
        # new tokens per request, parallel to requests (1 for a decode)
        self.num_new_tokens: list[int] = []
        # new tokens in the step: decodes plus prefill chunks, within the Decision's token budget
        self.num_tokens = 0
        # context tokens the step's attention reads (cached plus new)
        self.kv_tokens_read = 0
        # decodes in the step, listed or counted in aggregate (steady decodes are not in requests)
        self.num_decodes = 0
        self.num_prefills = 0  # prefill chunks, one per prefilling request in the step
        # query-key pairs of the prefills' attention: a chunk of n tokens after c cached ones has
        # n c + n (n + 1) / 2 (each of its tokens attends to every token up to itself)
        self.prefill_pairs = 0
        # decodes that are a request's first (the one after its prefill sampled the first token)
        self.first_decodes = 0

    def __len__(self) -> int:
        return len(self.requests)


class StepResult:
    """What the executor produced for a batch.

    :param duration_s: the step's duration; None means "measured by the wall clock".
    :param token_ids: for each request in the batch, the sampled token id, or None when it
        sampled nothing (a non-final prefill chunk). None overall in simulation, where tokens
        carry no identity.
    :param stopped: requests that hit EOS or a stop condition with this step's token.
    :param failed: requests the executor could not serve, with the reason.
    """

    __slots__ = ("duration_s", "token_ids", "stopped", "failed")

    def __init__(
        self,
        duration_s: float | None,
        token_ids: list[int | None] | None = None,
        stopped: list[Request] | None = None,
        failed: list[tuple[Request, str]] | None = None,
    ) -> None:
        self.duration_s = duration_s
        self.token_ids = token_ids
        self.stopped = stopped or ()
        self.failed = failed or ()


class Executor(Protocol):
    """Runs a step's batch. The engine calls ``release`` when a request ends, and when it is evicted in
    the paper's ``eviction="reset"`` mode (a recomputed request keeps its generator and state).

    An executor with ``reads_requests = False`` declares that it reads only a batch's counts
    (``num_tokens``, ``kv_tokens_read``, ``num_decodes``) and returns no token ids; the engine may
    then leave decodes out of ``batch.requests`` and count them in aggregate. Without the
    attribute, every scheduled request is listed.
    """

    def execute(self, batch: Batch) -> StepResult: ...

    def release(self, request: Request) -> None: ...
