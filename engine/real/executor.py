"""TorchExecutor: runs each engine step on a transformers model with paged KV storage.

The engine core schedules, owns the KV pool and collects metrics; this executor only turns a
``Batch`` into one forward pass over the packed sequence of the step's new tokens, writes their
keys and values at the blocks the core gave each request, and samples the next tokens.
"""

from __future__ import annotations

import time

import torch

from engine.core.executor import Batch, StepResult
from engine.core.request import Request
from engine.real.model import IncrementalDetokenizer, resolve_device, resolve_dtype
from engine.real.paged_cache import PagedKVCache, _long, build_layout, register_attention
from engine.real.sampling import SamplingParams

_GREEDY = SamplingParams()


class _RequestState:
    """What the executor keeps per running request: its generator and, for stop strings, its text."""

    __slots__ = ("generator", "detok", "stop_ids")

    def __init__(self, sampling: SamplingParams, eos: int | None, tokenizer, device) -> None:
        self.generator = None
        if sampling.seed is not None and not sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed)
        self.detok = IncrementalDetokenizer(tokenizer) if sampling.stop else None
        stop_ids = set(sampling.stop_token_ids)
        if eos is not None and not sampling.ignore_eos:
            stop_ids.add(eos)
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
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.vocab_size = model.config.vocab_size
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(0)
        self._attn_name = register_attention()
        self._states: dict[Request, _RequestState] = {}
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

    # ------------------------------------------------------------------ the step
    def execute(self, batch: Batch) -> StepResult:
        """Run one step: pack the new tokens, one forward pass, sample, and find the requests that stop."""
        if not batch.requests:
            return StepResult(None)
        if self.cache is None:
            raise RuntimeError("TorchExecutor.attach_pool(pool) was not called")
        step = self._pack(batch)
        logits = self._forward(batch, step)
        samplers = [batch.requests[i] for i in step.samplers]
        with torch.inference_mode():
            tokens = self._sample(logits, samplers)
        token_ids: list[int | None] = [None] * len(batch.requests)
        for i, tok in zip(step.samplers, tokens):
            token_ids[i] = tok
        stopped = [r for r, tok in zip(samplers, tokens) if self._stops(r, tok)]
        return StepResult(None, token_ids, stopped)

    def _pack(self, batch: Batch) -> "_PackedStep":
        """The step's new tokens as one packed sequence, and which rows sample a token."""
        step = _PackedStep()
        row = 0
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if r not in self._states:  # new, or started over after an eviction that reset it
                self._start(r)
            c = r.num_computed_tokens
            step.input_ids.extend(_new_token_ids(r, c, n))
            step.positions.append(c)
            step.tables.append(r.block_ids)
            row += n
            if c + n >= r.num_tokens:  # the chunk reaches the end of the sequence: it samples
                step.sample_rows.append(row - 1)
                step.samplers.append(i)
        return step

    def _forward(self, batch: Batch, step: "_PackedStep") -> torch.Tensor:
        """One forward pass over the packed step; logits of the sampling rows, ``[samplers, vocab]``."""
        dev = self.device
        layout, position_ids = build_layout(self.cache.block_size, batch.num_decodes, step.positions,
                                            batch.num_new_tokens, step.tables, dev, self.dtype)
        self.cache.layout = layout
        ids = _long(step.input_ids, dev).unsqueeze(0)
        keep = _long(step.sample_rows, dev)
        config = self.model.config
        previous = config._attn_implementation
        self._set_attn(config, self._attn_name)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter() if self.time_forward else 0.0
                logits = self.model(input_ids=ids, position_ids=position_ids.unsqueeze(0), cache=self.cache,
                                    use_cache=False, logits_to_keep=keep, paged_layout=layout).logits[0]
                if self.time_forward:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    self.forward_time_s += time.perf_counter() - t0
        finally:
            self._set_attn(config, previous)
            self.cache.layout = None
        return logits

    def _stops(self, r: Request, tok: int) -> bool:
        """Whether ``tok`` ends ``r``: a stop token (EOS included unless ignored) or a stop string."""
        state = self._states[r]
        if tok in state.stop_ids:
            return True
        return state.detok is not None and self._hits_stop_string(r, state, tok)

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
        self._states[r] = _RequestState(sampling, self.eos_token_id, self.tokenizer, self.device)

    @staticmethod
    def _set_attn(config, name) -> None:
        """Switch the model's attention function for one step.

        The ``_attn_implementation`` setter validates and walks sub-configs (tens of microseconds
        per step); a config without sub-configs only needs the stored name changed.
        """
        if not getattr(config, "sub_configs", None) and "_attn_implementation_internal" in vars(config):
            vars(config)["_attn_implementation_internal"] = name
        else:
            config._attn_implementation = name

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """One token per row of ``logits`` (``[len(reqs), vocab]``)."""
        if not reqs:
            return []
        params = [r.sampling if r.sampling is not None else _GREEDY for r in reqs]
        if all(p.greedy for p in params):
            return logits.argmax(-1).tolist()
        out = logits.argmax(-1).tolist()
        for i, (r, p) in enumerate(zip(reqs, params)):
            if p.greedy:
                continue
            row = logits[i].float() / p.temperature
            if p.top_k:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if p.top_p < 1:
                sorted_p, order = probs.sort(descending=True)
                drop = sorted_p.cumsum(0) - sorted_p > p.top_p  # keep the token that crosses top_p
                probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
            gen = self._states[r].generator or self.generator
            out[i] = int(torch.multinomial(probs, 1, generator=gen))
        return out

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

    __slots__ = ("input_ids", "positions", "tables", "sample_rows", "samplers")

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []      # first position of each request's new tokens
        self.tables: list[list[int]] = []   # block tables of the step's requests
        self.sample_rows: list[int] = []    # packed row of the last token of each sampling request
        self.samplers: list[int] = []       # batch index of each sampling request


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
