"""A request and its lifecycle: waiting -> running -> exactly one terminal state."""

from __future__ import annotations

import enum
from typing import Any


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self not in (RequestState.WAITING, RequestState.RUNNING)


class Request:
    """One generation request as the engine sees it.

    ``num_computed_tokens`` counts the tokens whose KV entries are in the cache; the
    sequence is the prompt followed by the output tokens generated so far. A request decodes
    (one token per step) when exactly one token of its sequence is pending and it has an output
    token; otherwise its pending tokens are a prefill: the prompt, or after an eviction, which
    frees the cache but keeps the output, the prompt and the output again.

    :param request_id: unique id.
    :param arrival_time_s: when the request arrived, on the engine's clock.
    :param prompt_len: prompt length in tokens.
    :param max_tokens: the most output tokens it may generate.
    :param target_output_len: in simulation, the output length the trace says it produced
        (the request ends there as if it had hit EOS); None for real requests.
    :param prompt_token_ids: the prompt's token ids (real engine only).
    :param sampling: sampling parameters for the real executor (opaque to the core).
    :param class_id: workload class, used by per-class controllers.
    :param prefix: in simulation, what the prompt's content is for the prefix cache: ``(content ids,
        tokens per id)``, a Mooncake trace's ``hash_ids`` (``engine.core.prefix``); None for none.
    :param cache_salt: requests with different salts share no cached prefix.
    :param skip_reading_prefix_cache: compute the whole prompt even when its prefix is cached (a
        request that asks for prompt logprobs needs every prompt token's logits); its blocks are
        still cached for others.

    The real executor fills ``logprobs`` (one entry per output token: ``(token_id, logprob,
    [(alt_id, alt_logprob), ...])`` with the alternatives most likely first) and ``prompt_logprobs``
    (one entry per prompt token, the first None) when the sampling parameters ask for them; both
    stay None otherwise. Each token gets its entry once, also across evictions.
    """

    __slots__ = (
        "request_id", "arrival_time_s", "prompt_len", "max_tokens", "target_output_len",
        "prompt_token_ids", "sampling", "class_id",
        "state", "num_computed_tokens", "num_output_tokens", "output_token_ids", "block_ids",
        "activation_seq", "ever_activated", "start_time_s", "first_token_time_s", "finish_time_s",
        "finish_reason", "retry_after_s", "num_evictions", "wasted_tokens", "cancel_requested",
        "user_data", "predicted_ttft_s", "logprobs", "prompt_logprobs", "decode_lag",
        "prefix", "cache_salt", "skip_reading_prefix_cache", "block_hashes", "registered_blocks",
        "num_cached_tokens", "queued_tokens",
    )

    def __init__(
        self,
        request_id: str,
        arrival_time_s: float,
        prompt_len: int,
        max_tokens: int,
        target_output_len: int | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: Any = None,
        class_id: int = 0,
        prefix: tuple[tuple[int, ...], float] | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self.arrival_time_s = arrival_time_s
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.target_output_len = target_output_len
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.class_id = class_id
        self.state = RequestState.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.output_token_ids: list[int] = []
        self.block_ids: list[int] = []
        self.activation_seq = -1
        self.ever_activated = False
        self.start_time_s: float | None = None  # first activation (queue time ends here)
        self.first_token_time_s: float | None = None
        self.finish_time_s: float | None = None
        self.finish_reason: str | None = None
        self.retry_after_s: float | None = None
        #: the TTFT the engine predicted when it admitted the request (``ctrl.slo_flow.predicted_ttft_s``)
        self.predicted_ttft_s: float | None = None
        self.num_evictions = 0
        self.wasted_tokens = 0
        self.cancel_requested = False
        self.user_data: Any = None
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
        self.prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None
        #: while the engine counts this request's decodes in aggregate (``EngineCore``'s steady
        #: decodes), its output length is the engine's decode tick minus this; None otherwise
        self.decode_lag: int | None = None
        self.prefix = prefix
        self.cache_salt = cache_salt
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        #: the chained hashes of the prompt's full blocks (``engine.core.prefix``), set when it is
        #: queued on an engine with prefix caching; None otherwise
        self.block_hashes: list[int] | None = None
        #: how many of ``block_ids`` the pool has looked at for registering in the prefix cache
        self.registered_blocks = 0
        #: prompt tokens found in the prefix cache when it first started (vLLM's ``num_cached_tokens``)
        self.num_cached_tokens = 0
        #: the tokens it adds to the queue's prefill work while it waits (the scheduler's
        #: ``waiting_prompt_tokens``): its sequence less what the prefix cache held when it was queued
        self.queued_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far: the sequence the cache must eventually hold."""
        return self.prompt_len + self.num_output_tokens

    @property
    def is_prefilling(self) -> bool:
        """Whether its pending tokens are a prefill (the prompt, or a recompute after an eviction)."""
        return self.num_computed_tokens + 1 != self.num_tokens or not self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.state.value}, prompt={self.prompt_len}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")


def unservable_reason(prompt_len: int, max_tokens: int, kv_capacity_tokens: int,
                      max_model_len: int | None = None) -> str | None:
    """Why a request can never run on this engine, as one sentence; None when it can.

    The one definition used by the engine (rejection), the offline API and the server (4xx).

    :param max_model_len: the model's context length, when it has one.
    """
    if prompt_len < 1:
        return "the prompt is empty; a request needs at least one prompt token."
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}."
    if max_model_len is not None and prompt_len > max_model_len:
        return f"the prompt has {prompt_len} tokens, more than the model context of {max_model_len} tokens."
    if max_model_len is not None and prompt_len + max_tokens > max_model_len:
        return (f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model context "
                f"of {max_model_len} tokens.")
    if prompt_len + max_tokens > kv_capacity_tokens:
        return (f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the KV capacity "
                f"of {kv_capacity_tokens} tokens.")
    return None
