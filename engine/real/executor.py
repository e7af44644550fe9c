"""TorchExecutor: runs each engine step on a transformers model with paged KV storage.

The engine core schedules, owns the KV pool and collects metrics; this executor only turns a
``Batch`` into one forward pass over the packed sequence of the step's new tokens, writes their
keys and values at the blocks the core gave each request, and hands the logits to its ``Sampler``
(``engine.real.sampler``) for the next tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from tidegate.engine.core.executor import Batch, StepResult
from tidegate.engine.core.request import Request
from tidegate.engine.real.model import (
    IncrementalDetokenizer, context_limit, eos_token_ids, resolve_device, resolve_dtype,
)
from tidegate.engine.real.paged_cache import (
    PagedKVCache, _long, build_layout, forward_paged, register_attention, text_config,
)
from tidegate.engine.real.sampler import RequestSampling, Sampler, prompt_logprobs
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.real.structured import check_grammar, grammar_tokenizer

_GREEDY = SamplingParams()


#: grammars whose starting matcher the executor keeps (``TorchExecutor._matcher``)
MATCHERS_KEPT = 32


class _RequestState:
    """What the executor keeps per running request: its sampling state, and its text and stop ids
    (for the stop check)."""

    __slots__ = ("sampling", "detok", "stop_ids")

    def __init__(self, r: Request, sampling: SamplingParams, stop_ids: frozenset[int], tokenizer, device,
                 vocab_size: int, grammar=None) -> None:
        self.sampling = RequestSampling(r, sampling, stop_ids, device, vocab_size, grammar)
        self.detok = IncrementalDetokenizer(tokenizer) if sampling.stop else None
        self.stop_ids = stop_ids


class TorchExecutor:
    """The real engine's executor.

    :param model: a transformers causal LM (Llama-style: it calls ``cache.update`` per layer).
    :param tokenizer: has ``eos_token_id`` and ``decode`` (for stop strings).
    :param pool: the engine's ``BlockPool``; the KV tensors get its blocks. May be given later
        with :meth:`attach_pool` (the core builds its pool in its constructor).
    :param device: torch device; None: the model's device.
    :param dtype: KV dtype; None: the model's dtype.
    """

    def __init__(self, model, tokenizer, pool=None, device=None, dtype=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        params = next(model.parameters())
        self.device = resolve_device(device) if device is not None else params.device
        self.dtype = resolve_dtype(dtype, self.device) if dtype is not None else params.dtype
        #: the ids that end generation unless a request ignores EOS (see ``eos_token_ids``)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        text = text_config(model.config)
        self.vocab_size = text.vocab_size
        self.max_model_len = context_limit(model.config)
        self.sampler = Sampler(self.device)
        self._attn_name = register_attention()
        self._states: dict[Request, _RequestState] = {}
        self._grammar_tokenizer = None  # built at the first request with structured output
        #: a matcher at the start of each recent grammar: a sequence's own is a copy (building one costs up to
        #: a second for a large schema; a copy, microseconds), so n copies of a request or a schema sent again
        #: build it once
        self._matchers: OrderedDict[str, object] = OrderedDict()
        self.cache: PagedKVCache | None = None
        self.pool = None
        self.forward_time_s = 0.0  # time inside the model forward, summed (for overhead figures)
        self.time_forward = False
        if pool is not None:
            self.attach_pool(pool)

    def attach_pool(self, pool) -> None:
        """Allocate the KV tensors for ``pool``'s blocks."""
        self.pool = pool
        self.cache = PagedKVCache.for_model(self.model.config, pool, self.device, self.dtype)

    def stop_token_ids(self, sampling: SamplingParams) -> frozenset[int]:
        """The ids that end a request with ``sampling``: its ``stop_token_ids`` and, unless it
        ignores EOS, every EOS id of the model."""
        ids = frozenset(sampling.stop_token_ids)
        return ids if sampling.ignore_eos else ids | self.eos_token_ids

    def check_structured(self, output) -> None:
        """Raise ValueError (one sentence) where a structured output cannot run over this model's tokenizer. A grammar
        checked before is not checked again: the matcher its check built is the one its sequences copy."""
        if output.grammar not in self._matchers:
            self._keep_matcher(output.grammar, check_grammar(output, self._grammar()))

    def _grammar(self):
        """The model's tokenizer as llguidance reads it, built at the first request with structured output."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_tokenizer

    def _matcher(self, output) -> tuple:
        """A new matcher at the start of ``output``'s grammar, and the size of its masks."""
        from llguidance import LLMatcher

        tokenizer = self._grammar()
        start = self._matchers.pop(output.grammar, None)
        if start is None:
            start = LLMatcher(tokenizer, output.grammar, log_level=0)
        self._keep_matcher(output.grammar, start)
        return start.deep_copy(), tokenizer.vocab_size

    def _keep_matcher(self, grammar: str, start) -> None:
        """Keep ``start`` as the most recent grammar's, the least recent ones past ``MATCHERS_KEPT`` dropped."""
        self._matchers[grammar] = start
        self._matchers.move_to_end(grammar)
        while len(self._matchers) > MATCHERS_KEPT:
            self._matchers.popitem(last=False)

    # ------------------------------------------------------------------ the step
    def execute(self, batch: Batch) -> StepResult:
        """Run one step: pack the new tokens, one forward pass, sample, and find the requests that stop."""
        if not batch.requests:
            return StepResult(None)
        if self.cache is None:
            raise RuntimeError("TorchExecutor.attach_pool(pool) was not called")
        step = self._pack(batch)
        logits = self._forward(batch, step)
        sampled = [batch.requests[i] for i in step.samplers]
        n = len(sampled)
        with torch.inference_mode():
            tokens = self._sample(logits[:n], sampled)
            if step.prompt_targets:
                prompt_logprobs(logits[n:], step.prompt_targets)
        token_ids: list[int | None] = [None] * len(batch.requests)
        for i, tok in zip(step.samplers, tokens):
            token_ids[i] = tok
        failed = [(r, f"structured output failed: {error}") for r, error in
                  ((r, self._advance_grammar(r, tok)) for r, tok in zip(sampled, tokens)) if error is not None]
        broken = {r for r, _ in failed}
        stopped = [r for r, tok in zip(sampled, tokens) if r not in broken and self._stops(r, tok)]
        return StepResult(None, token_ids, stopped, failed)

    def _advance_grammar(self, r: Request, tok: int) -> str | None:
        """Advance ``r``'s grammar (if it has one) by its sampled token; the matcher's error where it failed."""
        grammar = self._states[r].sampling.grammar
        return None if grammar is None else grammar.advance(tok)

    def _pack(self, batch: Batch) -> "_PackedStep":
        """The step's new tokens as one packed sequence, which rows sample a token, and which rows
        give prompt logprobs."""
        step = _PackedStep()
        row = 0
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if r not in self._states:  # new, or started over after an eviction that reset it
                self._start(r)
            c = r.num_computed_tokens
            step.input_ids.extend(_new_token_ids(r, c, n))
            step.positions.append(c)
            step.tables.append(r.block_ids)
            if r.prompt_logprobs is not None and len(r.prompt_logprobs) < r.prompt_len:
                # position j's logits give prompt token j + 1; each prompt token gets its entry once,
                # so a re-prefill after an eviction skips the ones it has
                for t in range(max(c + 1, len(r.prompt_logprobs)), min(c + n, r.prompt_len - 1) + 1):
                    step.prompt_rows.append(row + t - 1 - c)
                    step.prompt_targets.append((r, t))
            row += n
            if c + n >= r.num_tokens:  # the chunk reaches the end of the sequence: it samples
                step.sample_rows.append(row - 1)
                step.samplers.append(i)
        return step

    def _forward(self, batch: Batch, step: "_PackedStep") -> torch.Tensor:
        """One forward pass over the packed step; logits of the sampling rows then of the prompt
        logprob rows, ``[samplers + prompt rows, vocab]``."""
        dev = self.device
        layout, position_ids = build_layout(self.cache.block_size, batch.num_decodes, step.positions,
                                            batch.num_new_tokens, step.tables, dev, self.dtype)
        keep = _long(step.sample_rows + step.prompt_rows if step.prompt_rows else step.sample_rows, dev)
        t0 = time.perf_counter() if self.time_forward else 0.0
        logits = forward_paged(self.model, self.cache, self._attn_name, layout, _long(step.input_ids, dev),
                               position_ids, keep)
        if self.time_forward:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self.forward_time_s += time.perf_counter() - t0
        return logits

    def _stops(self, r: Request, tok: int) -> bool:
        """Whether ``tok`` ends ``r``: a stop token (EOS included unless ignored) or a stop string,
        once ``min_tokens`` tokens came before it."""
        state = self._states[r]
        if state.sampling.grammar is not None and state.sampling.grammar.whole:
            return True  # the structured output is whole: nothing more can follow it
        early = len(r.output_token_ids) < state.sampling.params.min_tokens  # the tokens before this one
        if tok in state.stop_ids and not early:
            return True
        if state.detok is None:
            return False
        hit = self._hits_stop_string(r, state, tok)  # pushes the token's text either way
        return hit and not early

    def release(self, request: Request) -> None:
        """Drop the request's generator and detokenizer: it ended, or its progress was reset.

        The engine does not call it when it evicts a request that keeps its output (recompute
        eviction): the request's seeded generator then goes on from where it was, so the
        continuation after the re-prefill is the one it would have had without the eviction.
        """
        self._states.pop(request, None)

    # ------------------------------------------------------------------ helpers
    def _start(self, r: Request) -> None:
        sampling = r.sampling if r.sampling is not None else _GREEDY
        grammar = self._matcher(sampling.structured_outputs) if sampling.structured_outputs is not None else None
        self._states[r] = _RequestState(r, sampling, self.stop_token_ids(sampling), self.tokenizer, self.device,
                                        self.vocab_size, grammar)
        if sampling.logprobs is not None:
            r.logprobs = (r.logprobs or [])[:len(r.output_token_ids)]  # a reset request starts over
        if sampling.prompt_logprobs is not None and r.prompt_logprobs is None:
            r.prompt_logprobs = [None]

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """One token per row of ``logits`` (``[len(reqs), vocab]``), from the sampler with each
        request's sampling state."""
        return self.sampler.sample(logits, reqs, [self._states[r].sampling for r in reqs])

    def _hits_stop_string(self, r: Request, state: _RequestState, tok: int) -> bool:
        detok = state.detok
        before = len(detok.text)
        detok.push([tok])
        stops = r.sampling.stop
        window = max(len(s) for s in stops) - 1
        tail = detok.text[max(0, before - window):]
        return any(s in tail for s in stops)


class _PackedStep:
    """A step's requests laid out as one packed sequence."""

    __slots__ = ("input_ids", "positions", "tables", "sample_rows", "samplers", "prompt_rows", "prompt_targets")

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []      # first position of each request's new tokens
        self.tables: list[list[int]] = []   # block tables of the step's requests
        self.sample_rows: list[int] = []    # packed row of the last token of each sampling request
        self.samplers: list[int] = []       # batch index of each sampling request
        self.prompt_rows: list[int] = []    # packed rows whose logits give a prompt logprob
        self.prompt_targets: list[tuple[Request, int]] = []  # (request, prompt position) of each


def _new_token_ids(r: Request, computed: int, n: int) -> list[int]:
    """Ids of the ``n`` tokens of ``r``'s sequence (prompt then output) from position ``computed``:
    a decode's last output token, a prompt chunk, or a chunk of the prompt and the output that a
    request re-prefills after an eviction."""
    p = r.prompt_len
    if computed >= p:  # output tokens only: a decode, or a re-prefill chunk past the prompt
        if n == 1:
            return [r.output_token_ids[computed - p]]
        return r.output_token_ids[computed - p:computed - p + n]
    if computed + n <= p:
        return r.prompt_token_ids[computed:computed + n]
    return r.prompt_token_ids[computed:] + r.output_token_ids[:computed + n - p]
