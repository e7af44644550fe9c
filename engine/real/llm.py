"""LLM: offline generation and streaming on the real engine.

The same ``EngineCore`` as the simulator, with a ``TorchExecutor`` and a ``WallClock``::

    llm = LLM("tiny", kv_capacity_tokens=8192)
    outs = llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0.8, seed=1), max_tokens=32)
    for delta in llm.stream("Hello", max_tokens=16):
        print(delta, end="")

For a server: ``add_request(..., on_delta=callback)`` then call ``step()`` in the serving loop;
``callback(request, delta_text, finished)`` receives each newly completed piece of text.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from tidegate.ctrl import build_controller
from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.builder import build_engine
from tidegate.engine.core.clock import WallClock
from tidegate.engine.core.engine_core import ASK
from tidegate.engine.core.profile import Profile, load_profile
from tidegate.engine.core.request import Request, unservable_reason
from tidegate.engine.real.executor import TorchExecutor
from tidegate.engine.real.model import (IncrementalDetokenizer, default_batch_limits, load_model, resolve_device,
                                        resolve_dtype)
from tidegate.engine.real.paged_cache import kv_bytes_per_token
from tidegate.engine.real.sampling import SamplingParams

DeltaCallback = Callable[[Request, str, bool], None]

#: the KV cache's memory on a CPU by default, as vLLM's CPU build is commonly run (``VLLM_CPU_KVCACHE_SPACE=1``)
CPU_KV_BYTES = 1 << 30
#: ... and at most this share of the memory available at start-up, so that a small machine keeps room to run
CPU_KV_MEMORY_SHARE = 0.25
#: the smallest KV cache a default gives, in tokens
MIN_KV_TOKENS = 1024


def available_memory_bytes() -> int:
    """Memory the system can give without swapping: Linux's ``MemAvailable``, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return CPU_KV_BYTES


@dataclass
class RequestOutput:
    """A request's result.

    :param request_id: the request's id.
    :param prompt_token_ids: the prompt as token ids.
    :param token_ids: the generated token ids (a stop or EOS token included).
    :param text: the generated text, cut before a stop string.
    :param finish_reason: ``length``, ``stop``, ``cancelled``, or why it was rejected or failed.
    :param state: the terminal state: finished, rejected, cancelled, expired or failed.
    :param logprobs: with ``SamplingParams.logprobs``, one ``(token_id, logprob, [(alt_id, alt_logprob),
        ...])`` per generated token, alternatives most likely first; else None.
    :param prompt_logprobs: with ``SamplingParams.prompt_logprobs``, the same per prompt token (None
        for the first); else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    state: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None


class _Stream:
    """Text streaming state of one request: what was already sent, and stop strings held back.

    A token that ends the request as a stop token (EOS or ``stop_token_ids``) adds no text unless
    ``include_stop_str_in_output``; a stop string counts only where it ends after the text of the
    first ``min_tokens`` tokens.
    """

    __slots__ = ("detok", "callback", "sent", "stops", "stop_ids", "include_stop", "min_tokens", "min_chars",
                 "num_tokens", "scanned", "prefix_ends")

    def __init__(self, tokenizer, callback: DeltaCallback | None, sampling: SamplingParams,
                 stop_ids: frozenset[int]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, sampling.skip_special_tokens)
        self.callback = callback
        self.sent = 0      # characters of text already handed out
        self.stops = list(sampling.stop)
        #: the text's characters searched for a stop string already (the text only grows): a token costs the same
        #: however long the output has grown
        self.scanned = 0
        #: per stop string, the lengths of its proper prefixes by their last character, longest first
        self.prefix_ends = [_prefix_ends(s) for s in self.stops]
        self.include_stop = sampling.include_stop_str_in_output
        self.stop_ids = frozenset() if self.include_stop else stop_ids
        self.min_tokens = sampling.min_tokens
        self.min_chars: int | None = 0 if not sampling.min_tokens else None  # text of the first min_tokens
        self.num_tokens = 0  # tokens handed to the stream

    def push(self, token_id: int | None) -> None:
        self.num_tokens += 1
        if token_id not in self.stop_ids:
            self.detok.push([token_id])
        if self.min_chars is None and self.num_tokens >= self.min_tokens:
            self.min_chars = len(self.detok.text)

    def visible(self) -> tuple[str, bool]:
        """Text that may be shown now, and whether a stop string has been reached."""
        text = self.detok.text
        if self.min_chars is not None:
            # a stop string found now ends in the text added since the last search
            cut = _stop_cut(text, self.stops, max(self.min_chars, self.scanned), self.include_stop)
            if cut is not None:
                return text[:cut], True
            self.scanned = len(text)
        hold = 0  # a suffix that may still grow into a stop string
        if text:
            for s, ends in zip(self.stops, self.prefix_ends):
                for k in ends.get(text[-1], ()):  # only prefixes ending in the last character can end the text
                    if k <= hold:
                        break
                    if k <= len(text) and text.endswith(s[:k]):
                        hold = k
                        break
        return text[:len(text) - hold], False


def _prefix_ends(stop: str) -> dict[str, list[int]]:
    """The lengths ``k`` of ``stop``'s proper prefixes ``stop[:k]``, keyed by their last character, longest first."""
    ends: dict[str, list[int]] = {}
    for k in range(len(stop) - 1, 0, -1):
        ends.setdefault(stop[k - 1], []).append(k)
    return ends


def _stop_cut(text: str, stops: list[str], min_chars: int, include: bool) -> int | None:
    """Where ``text`` is cut for the first stop string that ends after ``min_chars`` characters:
    before it, or after it when ``include``; None when there is none."""
    best = None
    for s in stops:
        at = text.find(s, max(0, min_chars - len(s) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, at + len(s))
    if best is None:
        return None
    return best[1] if include else best[0]


def serving_profile(profile, kv_capacity_tokens: int | None, block_size: int, max_num_batched_tokens: int,
                    max_num_seqs: int):
    """The step-time profile controllers see, with this engine's KV size and batch limits.

    :param profile: a Profile, a profile name or file, or None for the shipped ``tiny-cpu`` fit
        (the only model and machine tidegate ships a fit for; profile your own with
        ``tidegate profile``).
    """
    base = profile if isinstance(profile, Profile) else load_profile(profile or "tiny-cpu")
    changes = dict(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    if kv_capacity_tokens is not None:
        changes["kv_capacity_tokens"] = kv_capacity_tokens
    return dataclasses.replace(base, **changes)


def check_prompt(prompt_token_ids: list[int], max_tokens: int, vocab_size: int, kv_capacity_tokens: int,
                 max_model_len: int | None) -> None:
    """Raise ValueError (one sentence) for a prompt this engine can never run: ids outside the
    vocabulary (this engine's own concern), then the core's one definition of a request that can
    never run (``unservable_reason``). The engine and the server's HTTP side both check with it."""
    if max_tokens >= 1 and any(t < 0 or t >= vocab_size for t in prompt_token_ids):
        raise ValueError(f"the prompt holds token ids outside the vocabulary of {vocab_size}.")
    reason = unservable_reason(len(prompt_token_ids), max_tokens, kv_capacity_tokens, max_model_len)
    if reason is not None:
        raise ValueError(reason)


class LLM:
    """The real engine behind a small offline API.

    :param model: ``"tiny"`` or a local Hugging Face model folder.
    :param kv_capacity_tokens: KV capacity M in tokens (the pool's size); None: on CPU what fits in
        ``CPU_KV_BYTES`` (1 GiB) or a quarter of the available memory if less, on CUDA what fits in 80% of
        the free GPU memory (at least ``MIN_KV_TOKENS`` either way).
    :param block_size: tokens per KV block.
    :param controller: a controller spec (``greedy``, ``flow:budget=2``, ...) or a Controller.
    :param device: torch device; None: CUDA when available, else CPU.
    :param dtype: torch dtype or name; None: the device's fastest (``default_dtype``), or the dtype of a
        model given in ``model_and_tokenizer``.
    :param max_num_batched_tokens: token budget of one step (chunked prefill beyond it); None: vLLM's
        default for the device (``default_batch_limits``: 2,048 on a CPU).
    :param max_num_seqs: most running requests; None: vLLM's default for the device (128 on a CPU).
    :param model_and_tokenizer: an already loaded ``(model, tokenizer)`` to use instead of ``model``.
    :param profile: the step-time profile controllers are given (``serving_profile``).
    :param prefix_caching: a prompt whose leading blocks are cached starts after them (vLLM's
        automatic prefix caching, on by default as in vLLM); the tokens are the same either way.
    """

    def __init__(self, model: str = "tiny", kv_capacity_tokens: int | None = None, block_size: int = 16,
                 controller="greedy", device=None, dtype=None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, model_and_tokenizer=None, record_steps: bool = True,
                 profile=None, prefix_caching: bool = True) -> None:
        spec = controller if isinstance(controller, str) else None
        device = resolve_device(device)
        tokens, seqs = default_batch_limits(device)
        settings = dict(block_size=block_size,
                        max_num_batched_tokens=tokens if max_num_batched_tokens is None else max_num_batched_tokens,
                        max_num_seqs=seqs if max_num_seqs is None else max_num_seqs)
        serving = serving_profile(profile, kv_capacity_tokens, **settings)
        if spec is not None:  # check the cheap inputs before loading anything
            controller = build_controller(spec, serving)
        if dtype is None and model_and_tokenizer is not None:
            dtype = next(model_and_tokenizer[0].parameters()).dtype
        dtype = resolve_dtype(dtype, device)
        if kv_capacity_tokens is not None:
            BlockPool(kv_capacity_tokens, block_size)  # raises ValueError on a bad size
        if model_and_tokenizer is None:
            hf_model, tokenizer = load_model(model, device, dtype)
        else:
            hf_model, tokenizer = model_and_tokenizer
        self.model, self.tokenizer = hf_model, tokenizer
        self.executor = TorchExecutor(hf_model, tokenizer, device=device, dtype=dtype)
        if kv_capacity_tokens is None:
            serving = serving_profile(profile, self._default_capacity(device), **settings)
            if spec is not None:  # the controller should see the real KV size
                controller = build_controller(spec, serving)
        self.profile = serving
        self.core = build_engine(serving, controller, self.executor, WallClock(), record_steps=record_steps,
                                 on_token=self._on_token, on_finish=self._on_finish, prefix_caching=prefix_caching)
        self.executor.attach_pool(self.core.pool)
        self.max_model_len = self.executor.max_model_len
        self._streams: dict[Request, _Stream] = {}
        self._ids = itertools.count()

    def _default_capacity(self, device: torch.device) -> int:
        per_token = kv_bytes_per_token(self.model.config, self.executor.dtype)
        if device.type != "cuda":
            budget = min(CPU_KV_BYTES, int(CPU_KV_MEMORY_SHARE * available_memory_bytes()))
            return max(budget // per_token, MIN_KV_TOKENS)
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(0.8 * free) // per_token, MIN_KV_TOKENS)

    # ------------------------------------------------------------------ requests
    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def check_request(self, prompt_token_ids: list[int], max_tokens: int,
                      sampling: SamplingParams | None = None) -> None:
        """Raise ValueError (one sentence) for a request that can never run.

        :param sampling: also check its token ids against the vocabulary and its ``min_tokens``
            against ``max_tokens`` (``SamplingParams.verify``).
        """
        vocab = self.executor.vocab_size
        check_prompt(prompt_token_ids, max_tokens, vocab, self.core.pool.capacity_tokens, self.max_model_len)
        if sampling is not None:
            sampling.verify(vocab, max_tokens, self.executor.eos_token_ids)
            if sampling.structured_outputs is not None:
                self.executor.check_structured(sampling.structured_outputs)

    def add_request(self, prompt, sampling: SamplingParams | None = None, max_tokens: int = 16,
                    request_id: str | None = None, on_delta: DeltaCallback | None = None,
                    admission=ASK, class_id: int = 0, cache_salt: str | None = None) -> Request:
        """Queue one request; the engine serves it as ``step()`` is called.

        :param prompt: text or token ids.
        :param sampling: sampling parameters (default greedy).
        :param max_tokens: the most tokens to generate.
        :param on_delta: called as ``on_delta(request, text_delta, finished)`` when new text is
            complete and once more (possibly with an empty delta) when the request ends.
        :param admission: the arrival decision if the caller already took it (see
            ``EngineCore.add_request``); by default the controller is asked now.
        :param class_id: the request's class, as per-class controllers see it.
        :param cache_salt: requests with different salts share no cached prefix.
        :return: the Request (its ``state`` says whether the controller rejected it).
        :raises ValueError: the request can never run (too long, empty, bad token ids), or its
            sampling parameters do not fit the model.
        """
        ids = self._tokenize(prompt)
        sampling = sampling or SamplingParams()
        self.check_request(ids, max_tokens, sampling)
        rid = request_id if request_id is not None else str(next(self._ids))
        # prompt logprobs need every prompt token's logits: such a request computes its whole prompt
        r = Request(rid, self.core.clock.now(), len(ids), max_tokens, prompt_token_ids=ids, sampling=sampling,
                    class_id=class_id, skip_reading_prefix_cache=sampling.prompt_logprobs is not None,
                    cache_salt=cache_salt)
        self._streams[r] = _Stream(self.tokenizer, on_delta, sampling, self.executor.stop_token_ids(sampling))
        if self.core.add_request(r, admission) is not None:  # rejected: it ended at once, through _on_finish
            self._streams.pop(r, None)
        return r

    def cancel(self, request: Request) -> None:
        """Cancel a request; its KV blocks are freed at the next step."""
        self.core.cancel(request)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that ended in it."""
        ended = self.core.step()
        outs = [self.output(r) for r in ended]
        for r in ended:
            self._streams.pop(r, None)
        return outs

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def output(self, r: Request) -> RequestOutput:
        """The request's output so far (its final output once it has ended)."""
        stream = self._streams.get(r)
        if stream is not None and stream.num_tokens == len(r.output_token_ids):
            text = _shown_text(stream)
        else:
            text = self._text(r)
        return RequestOutput(r.request_id, list(r.prompt_token_ids), list(r.output_token_ids), text,
                             r.finish_reason, r.state.value, _copy(r.logprobs), _copy(r.prompt_logprobs))

    def _text(self, r: Request) -> str:
        """The text to show, decoded from the tokens (as the stream would have shown it)."""
        sampling = r.sampling or SamplingParams()
        ids = r.output_token_ids
        include = sampling.include_stop_str_in_output
        if ids and not include and ids[-1] in self.executor.stop_token_ids(sampling):
            ids = ids[:-1]
        skip = sampling.skip_special_tokens
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        if sampling.stop:
            min_chars = len(self.tokenizer.decode(ids[:sampling.min_tokens], skip_special_tokens=skip))
            cut = _stop_cut(text, sampling.stop, min_chars, include)
            text = text if cut is None else text[:cut]
        return text

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_tokens: int | Sequence[int] = 16) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        :param prompts: a text, or a list of texts or token-id lists.
        :param sampling: one SamplingParams for all, or one per prompt (default greedy).
        :param max_tokens: one limit for all, or one per prompt.
        :raises ValueError: a prompt can never run; then no request is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        limits = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * n
        if len(samplings) != n or len(limits) != n:
            raise ValueError(f"got {n} prompts but {len(samplings)} sampling settings and {len(limits)} max_tokens.")
        ids = [self._tokenize(p) for p in prompts]
        samplings = [s or SamplingParams() for s in samplings]
        for i, (t, m, s) in enumerate(zip(ids, limits, samplings)):
            try:
                self.check_request(t, m, s)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        reqs = [self.add_request(t, s, m) for t, s, m in zip(ids, samplings, limits)]
        while self.core.has_unfinished and any(not r.state.is_terminal for r in reqs):
            self.core.step()
        outs = [self.output(r) for r in reqs]
        for r in reqs:
            self._streams.pop(r, None)
        return outs

    def stream(self, prompt, sampling: SamplingParams | None = None, max_tokens: int = 16) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as they complete (runs the engine itself)."""
        deltas: list[str] = []
        r = self.add_request(prompt, sampling, max_tokens, on_delta=lambda _r, d, _f: deltas.append(d) if d else None)
        try:
            while not r.state.is_terminal and self.core.has_unfinished:
                self.core.step()
                yield from deltas
                deltas.clear()
            yield from deltas
        finally:
            if not r.state.is_terminal:
                self.core.cancel(r)
            self._streams.pop(r, None)

    # ------------------------------------------------------------------ engine hooks
    def _on_token(self, r: Request, token_id: int | None) -> None:
        stream = self._streams.get(r)
        if stream is None:
            return
        stream.push(token_id)  # each token once: an eviction keeps the tokens already streamed
        if stream.callback is None:
            return
        text = stream.visible()[0] if stream.stops else stream.detok.text
        if len(text) > stream.sent:
            delta = text[stream.sent:]
            stream.sent = len(text)
            stream.callback(r, delta, False)

    def _on_finish(self, r: Request) -> None:
        stream = self._streams.get(r)
        if stream is None:
            return
        stream.detok.finish()
        if stream.callback is None:
            return
        text = _shown_text(stream)
        delta = text[stream.sent:]
        stream.sent = max(stream.sent, len(text))
        stream.callback(r, delta, True)


def _shown_text(stream: _Stream) -> str:
    """The text to show: cut before a stop string; a held-back partial match is shown at the end."""
    if not stream.stops:
        return stream.detok.text
    text, hit = stream.visible()
    return text if hit or not stream.detok.finished else stream.detok.text


def _copy(entries: list | None) -> list | None:
    return list(entries) if entries is not None else None
