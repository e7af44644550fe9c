"""TorchExecutor: runs each engine step on a transformers model with paged KV storage.

The engine core schedules, owns the KV pool and collects metrics; this executor only turns a
``Batch`` into one forward pass over the packed sequence of the step's new tokens, writes their
keys and values at the blocks the core gave each request, and samples the next tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.core.executor import Batch, StepResult
from engine.real.paged_cache import PagedKVCache, _long, build_layout, register_attention
from engine.core.request import Request
from engine.real.model import IncrementalDetokenizer, resolve_dtype


@dataclass
class SamplingParams:
    """How a request picks its tokens (``max_tokens`` lives on the Request).

    :param temperature: 0 (or below 1e-5) is greedy; otherwise logits are divided by it before sampling.
    :param top_p: nucleus sampling: keep the smallest set of tokens with this much probability.
    :param top_k: keep the k most likely tokens; 0 keeps all.
    :param seed: seeds the request's own generator, so its samples reproduce (also after an
        eviction, which restarts the request from scratch); None uses the executor's generator.
    :param stop_token_ids: token ids that end the request (the token is kept in the output).
    :param stop: strings that end the request once the output text contains one.
    :param ignore_eos: keep generating past EOS (up to ``max_tokens``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # Below this temperature logits / temperature overflows to inf: the limit is argmax anyway.
        return self.temperature < 1e-5 or self.top_k == 1


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
        self.device = torch.device(device) if device is not None else params.device
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
        if not batch.requests:
            return StepResult(None)
        if self.cache is None:
            raise RuntimeError("TorchExecutor.attach_pool(pool) was not called")
        reqs, counts = batch.requests, batch.num_new_tokens
        input_ids: list[int] = []
        positions: list[int] = []     # first position of each request's new tokens
        tables: list[list[int]] = []  # block tables of the step's requests
        sample_rows: list[int] = []   # packed row of the last token of each sampling request
        samplers: list[int] = []      # batch index of each sampling request
        states = self._states
        row = 0
        for i, r in enumerate(reqs):
            n = counts[i]
            c = r.num_computed_tokens
            if r not in states:  # new, or restarted after an eviction released it
                self._start(r)
            p = r.prompt_len
            if c >= p:  # a decode: the token at position c is an output token
                if n == 1:
                    input_ids.append(r.output_token_ids[c - p])
                else:
                    input_ids.extend(r.output_token_ids[c - p:c - p + n])
            elif c + n <= p:
                input_ids.extend(r.prompt_token_ids[c:c + n])
            else:
                input_ids.extend((r.prompt_token_ids + r.output_token_ids)[c:c + n])
            positions.append(c)
            tables.append(r.block_ids)
            row += n
            if c + n >= r.num_tokens:
                sample_rows.append(row - 1)
                samplers.append(i)

        layout, position_ids = build_layout(self.cache.block_size, batch.num_decodes, positions, counts, tables,
                                            self.device, self.dtype)
        self.cache.layout = layout
        dev = self.device
        ids = _long(input_ids, dev).unsqueeze(0)
        keep = _long(sample_rows, dev)
        config = self.model.config
        previous = config._attn_implementation
        self._set_attn(config, self._attn_name)
        try:
            with torch.inference_mode():
                if self.time_forward:
                    t0 = time.perf_counter()
                logits = self.model(input_ids=ids, position_ids=position_ids.unsqueeze(0), cache=self.cache,
                                    use_cache=False, logits_to_keep=keep, paged_layout=layout).logits[0]
                if self.time_forward:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    self.forward_time_s += time.perf_counter() - t0
                tokens = self._sample(logits, [reqs[i] for i in samplers])
        finally:
            self._set_attn(config, previous)
            self.cache.layout = None

        token_ids: list[int | None] = [None] * len(reqs)
        stopped = []
        for i, tok in zip(samplers, tokens):
            token_ids[i] = tok
            r = reqs[i]
            state = self._states[r]
            if tok in state.stop_ids:
                stopped.append(r)
            elif state.detok is not None and self._hits_stop_string(r, state, tok):
                stopped.append(r)
        return StepResult(None, token_ids, stopped)

    def release(self, request: Request) -> None:
        """Drop the request's generator and detokenizer (it ended or was evicted)."""
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
