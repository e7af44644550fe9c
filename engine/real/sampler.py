"""Sampler: picks one token per row of a step's logits, each row with its request's ``SamplingParams``.

The order of the steps is vLLM's (see ``engine.real.sampling``): a structured output's grammar, the
``allowed_token_ids`` and
``bad_words_token_ids`` masks, the ``min_tokens`` mask and ``logit_bias``, the repetition, frequency
and presence penalties, the logprobs, then temperature, ``min_p``, ``top_k`` and ``top_p`` over the
drawn rows at once, and each request's draw. A batch of plain greedy requests is one argmax over the
raw logits.
"""

from __future__ import annotations

import numpy as np
import torch
from llguidance import LLMatcher

from tidegate.engine.core.request import Request
from tidegate.engine.real.paged_cache import _long
from tidegate.engine.real.sampling import SamplingParams


class RequestSampling:
    """A running request's sampling state: its generator and the device tensors its logits
    processing needs (built once, at its first step).

    :param r: the request (its prompt tokens count for the repetition penalty).
    :param sampling: its sampling parameters.
    :param stop_ids: the ids that end it; masked out until it has ``min_tokens`` tokens.
    :param device: torch device of the logits.
    :param vocab_size: columns of the logits; ids at or past it are left out.
    :param grammar: the request's matcher at the start of its ``structured_outputs`` and the size of its masks
        (None: it has none).
    """

    __slots__ = ("params", "generator", "mask_ids", "bias_ids", "bias_values", "counts", "seen", "counted",
                 "banned", "bad_words", "masked", "plain", "grammar")

    def __init__(self, r: Request, sampling: SamplingParams, stop_ids: frozenset[int], device,
                 vocab_size: int, grammar: tuple[LLMatcher, int] | None = None) -> None:
        self.params = sampling
        self.grammar = None if grammar is None else GrammarState(grammar[0], vocab_size, grammar[1])
        self.generator = None
        if sampling.seed is not None and not sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed)
        # Ids outside the logits (the request checks reject them; a direct caller may not) are left out.
        bias = {t: v for t, v in (sampling.logit_bias or {}).items() if t < vocab_size}
        self.bias_ids = _long(list(bias), device) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), device=device) if bias else None
        masked = [t for t in stop_ids if t < vocab_size] if sampling.min_tokens else []
        self.mask_ids = _long(masked, device) if masked else None
        self._build_bans(sampling, device, vocab_size)
        self.counts = self.seen = None  # output token counts; tokens of the prompt or the output
        self.counted = 0
        if sampling.penalized:
            self.counts = torch.zeros(vocab_size, device=device)
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[_long([t for t in r.prompt_token_ids if t < vocab_size], device)] = True
        # A plain request is one greedy argmax over the raw logits: the fast path of a step.
        self.plain = (sampling.greedy and self.bias_ids is None and self.mask_ids is None and self.counts is None
                      and not self.masked and self.grammar is None and sampling.logprobs is None)

    def _build_bans(self, sampling: SamplingParams, device, vocab_size: int) -> None:
        """The bans that ``allowed_token_ids`` and ``bad_words_token_ids`` put on the logits:
        ``banned``, a bool mask over the vocabulary of the tokens banned at every step (the ones
        outside ``allowed_token_ids`` and the one-token bad words), or None; ``bad_words``, the
        longer bad words as {the last token of a prefix: [(the prefix, the token it bans)]}, so a
        step only compares the prefixes that end with the request's last output token; ``masked``,
        whether there is either."""
        sequences = [seq for seq in sampling.bad_words_token_ids or () if max(seq) < vocab_size]
        always = [seq[0] for seq in sequences if len(seq) == 1]
        self.banned = None
        if sampling.allowed_token_ids is not None:
            self.banned = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self.banned[_long([t for t in sampling.allowed_token_ids if t < vocab_size], device)] = False
        if always:
            if self.banned is None:
                self.banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.banned[_long(always, device)] = True
        self.bad_words: dict[int, list[tuple[list[int], int]]] = {}
        for seq in sequences:
            if len(seq) > 1:
                self.bad_words.setdefault(seq[-2], []).append((seq[:-1], seq[-1]))
        self.masked = self.banned is not None or bool(self.bad_words)

    def banned_now(self, r: Request) -> list[int]:
        """The last tokens of the longer bad words whose prefix the output ends with: banned this step
        (vLLM's rule: only output tokens count, not the prompt's)."""
        out = r.output_token_ids
        if not out:
            return []
        return [token for prefix, token in self.bad_words.get(out[-1], ()) if out[-len(prefix):] == prefix]

    def ban(self, row: torch.Tensor, r: Request, early: bool, grammar: torch.Tensor | None = None) -> None:
        """Set the logits of the banned tokens of ``row`` (the request's float32 logits) to -inf: those
        of :meth:`banned_now` and the ``banned`` mask, and with ``early`` the ``min_tokens`` mask.

        :param grammar: the tokens the request's grammar bans now (already -inf in ``row``).

        Where the request's parameters leave nothing at this step (say ``allowed_token_ids`` of a bad
        word's last token and its prefix), these bans are lifted for the step (the grammar's stay: it always
        allows a token): softmax over no token is NaN, and the draw would fail. That check is on the
        device, without a sync. (Parameters that leave nothing at any step are refused before:
        ``SamplingParams.verify``.)"""
        now = self.banned_now(r) if self.bad_words else []
        if self.banned is None and grammar is None:  # a few bad words' tokens, never every token of the vocabulary
            if now:
                row[now] = float("-inf")
            if early:
                row[self.mask_ids] = float("-inf")
            return
        banned = self.banned if self.banned is not None else torch.zeros_like(grammar)
        if now or early:
            banned = banned.clone()
            if now:
                banned[now] = True
            if early:
                banned[self.mask_ids] = True
        if grammar is not None:
            held = banned | grammar
            banned = torch.where(held.all(), grammar, held)
        row.masked_fill_(banned & ~banned.all(), float("-inf"))

    def sync_counts(self, r: Request, device) -> None:
        """Add the output tokens committed since the last step to the penalty counts."""
        new = r.output_token_ids[self.counted:]
        if new:
            ids = _long(new, device)
            self.counts.index_add_(0, ids, torch.ones(len(new), device=device))
            self.seen[ids] = True
            self.counted = len(r.output_token_ids)


class GrammarState:
    """One sequence's place in its grammar.

    :param matcher: an llguidance matcher at the start of the sequence's grammar (its own: it advances).
    :param vocab_size: columns of the logits.
    :param mask_size: tokens in the matcher's masks (its tokenizer's vocabulary: at least ``vocab_size``).
    """

    __slots__ = ("matcher", "words")

    def __init__(self, matcher: LLMatcher, vocab_size: int, mask_size: int) -> None:
        self.matcher = matcher
        #: 32-bit words of the matcher's masks
        self.words = (max(mask_size, vocab_size) + 31) // 32

    def advance(self, token: int) -> str | None:
        """Take the sampled ``token``; the matcher's error where it failed (say a limit of its parser), else None."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
        if not self.matcher.is_error():
            return None
        lines = (self.matcher.get_error() or "").strip().splitlines()  # then its state and its whole grammar
        return lines[0][:300] if lines else "the matcher failed"

    @property
    def whole(self) -> bool:
        """The output is whole: the grammar admits nothing more."""
        return self.matcher.is_stopped() and not self.matcher.is_error()


def grammar_bans(grammars: list[GrammarState], vocab_size: int, device) -> torch.Tensor:
    """The tokens each grammar bans now, ``[len(grammars), vocab_size]`` (EOS alone is allowed once an output is
    whole): each matcher writes its mask into one buffer, unpacked for all at once."""
    bits = np.zeros((len(grammars), max(g.words for g in grammars)), dtype=np.int32)
    for k, g in enumerate(grammars):
        g.matcher.unsafe_compute_mask_ptr(bits[k].ctypes.data, g.words * 4)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(allowed == 0).to(device)


class Sampler:
    """Turns a step's logits into tokens (and logprobs) for the requests that sample.

    :param device: torch device of the logits.
    :param seed: seeds the generator shared by the requests without a ``seed`` of their own.
    """

    def __init__(self, device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, reqs: list[Request], states: list[RequestSampling]) -> list[int]:
        """One token per row of ``logits`` (``[len(reqs), vocab]``); the requests that ask for
        logprobs get this token's entry."""
        if not reqs:
            return []
        if all(s.plain for s in states):
            return logits.argmax(-1).tolist()
        logits = self._process(logits, reqs, states)
        tokens = logits.argmax(-1)
        drawn = [i for i, s in enumerate(states) if not s.params.greedy]
        if drawn:
            self._draw(logits, tokens, drawn, states)
        out = tokens.tolist()
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if wanted:
            _sample_logprobs(logits, tokens, out, wanted, reqs, states)
        return out

    def _process(self, logits: torch.Tensor, reqs: list[Request], states: list[RequestSampling]) -> torch.Tensor:
        """The logits after the ``allowed_token_ids``, ``bad_words_token_ids`` and ``min_tokens``
        masks, ``logit_bias`` and the penalties (float32, a copy when anything changes them); only
        the rows that need a step take part in it."""
        copied = False
        penalized = []
        ruled = [i for i, s in enumerate(states) if s.grammar is not None]
        bans: dict[int, torch.Tensor] = {}
        if ruled:  # the grammars first, as vLLM applies its bitmask before its sampler; all rows at once
            logits, copied = logits.to(torch.float32, copy=True), True
            banned = grammar_bans([states[i].grammar for i in ruled], logits.shape[-1], logits.device)
            rows = _long(ruled, logits.device)
            logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
            bans = dict(zip(ruled, banned))
        for i, (r, s) in enumerate(zip(reqs, states)):
            early = s.mask_ids is not None and len(r.output_token_ids) < s.params.min_tokens
            if s.plain or not (early or s.masked or s.bias_ids is not None or s.counts is not None):
                continue
            if not copied:
                logits, copied = logits.to(torch.float32, copy=True), True
            # The masks before the bias and penalties, as in vLLM: -inf stays -inf through both.
            if s.masked or (early and i in bans):
                s.ban(logits[i], r, early, bans.get(i))
            elif early:
                logits[i, s.mask_ids] = float("-inf")
            if s.bias_ids is not None:
                logits[i].index_add_(0, s.bias_ids, s.bias_values)
            if s.counts is not None:
                s.sync_counts(r, self.device)
                penalized.append(i)
        if penalized:
            dev = self.device
            params = [states[i].params for i in penalized]
            rows = _long(penalized, dev)
            counts = torch.stack([states[i].counts for i in penalized])
            seen = torch.stack([states[i].seen for i in penalized])
            rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
            presence = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
            x = logits[rows]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            logits[rows] = x - freq * counts - presence * (counts > 0)
        return logits if copied else logits.float()

    def _draw(self, logits: torch.Tensor, tokens: torch.Tensor, drawn: list[int],
              states: list[RequestSampling]) -> None:
        """Sample the rows ``drawn`` (in place in ``tokens``): temperature, then ``min_p``, ``top_k``
        and ``top_p`` over the rows at once, then each request's draw from its own generator."""
        dev = self.device
        params = [states[i].params for i in drawn]
        rows = _long(drawn, dev)
        x = logits[rows] / torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        if any(p.min_p for p in params):
            probs = torch.softmax(x, -1)
            floor = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1) * probs.amax(-1, keepdim=True)
            x = x.masked_fill(probs < floor, float("-inf"))
        k_max = min(max(p.top_k for p in params), x.shape[-1])
        if k_max:
            k = _long([min(p.top_k, k_max) or k_max for p in params], dev).unsqueeze(1)
            kth = x.topk(k_max, -1).values.gather(1, k - 1)
            unlimited = torch.tensor([not p.top_k for p in params], device=dev).unsqueeze(1)
            x = x.masked_fill((x < kth) & ~unlimited, float("-inf"))
        probs = torch.softmax(x, -1)
        if any(p.top_p < 1 for p in params):
            sorted_p, order = probs.sort(-1, descending=True)
            top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
            drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the token that crosses top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        shared = [j for j, i in enumerate(drawn) if states[i].generator is None]
        if shared:
            picks = torch.multinomial(probs[_long(shared, dev)], 1, generator=self.generator).squeeze(1)
            tokens[_long([drawn[j] for j in shared], dev)] = picks
        for j, i in enumerate(drawn):
            gen = states[i].generator
            if gen is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]


def _sample_logprobs(logits: torch.Tensor, tokens: torch.Tensor, out: list[int], wanted: list[int],
                     reqs: list[Request], states: list[RequestSampling]) -> None:
    """Append each wanted request's entry for its new token: its logprob under ``logits`` (after
    bias and penalties, before temperature and truncation) and the k most likely tokens (or the
    request's ``logprob_token_ids``)."""
    rows = _long(wanted, logits.device)
    logprobs = torch.log_softmax(logits[rows], -1)
    chosen = logprobs.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
    k_max = max(states[i].params.logprobs for i in wanted)
    top = logprobs.topk(k_max, -1) if k_max else None
    top_values = top.values.tolist() if top is not None else None
    top_ids = top.indices.tolist() if top is not None else None
    for j, i in enumerate(wanted):
        r, k, named = reqs[i], states[i].params.logprobs, states[i].params.logprob_token_ids
        if named:  # vLLM's logprob_token_ids: these ids, in place of the most likely ones
            alternatives = list(zip(named, logprobs[j, _long(named, logits.device)].tolist()))
        else:
            alternatives = list(zip(top_ids[j][:k], top_values[j][:k])) if top_ids is not None else []
        entries = r.logprobs if r.logprobs is not None else []
        del entries[len(r.output_token_ids):]  # one entry per output token, whatever happened before
        entries.append((out[i], chosen[j], alternatives))
        r.logprobs = entries


def prompt_logprobs(logits: torch.Tensor, targets: list[tuple[Request, int]]) -> None:
    """Append prompt logprobs from the raw logits of the positions before each target prompt token
    (row j of ``logits`` gives ``targets[j]``, a request and the position of its prompt token): entries
    ``(token, logprob, alternatives, rank)``, the rank of the token among the whole vocabulary (1: the likeliest)."""
    chunk = 256  # rows at a time: a long prompt's float32 log-softmax over a large vocabulary is big
    for start in range(0, len(targets), chunk):
        part = targets[start:start + chunk]
        logprobs = torch.log_softmax(logits[start:start + len(part)].float(), -1)
        ids = _long([r.prompt_token_ids[t] for r, t in part], logits.device)
        chosen_t = logprobs.gather(1, ids.unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()  # the token's rank in the whole vocabulary
        chosen = chosen_t.squeeze(1).tolist()
        k_max = max(r.sampling.prompt_logprobs for r, _ in part)
        top = logprobs.topk(k_max, -1) if k_max else None
        top_values = top.values.tolist() if top is not None else None
        top_ids = top.indices.tolist() if top is not None else None
        for j, (r, t) in enumerate(part):
            if t != len(r.prompt_logprobs):
                continue
            k = r.sampling.prompt_logprobs
            alternatives = list(zip(top_ids[j][:k], top_values[j][:k])) if top_ids is not None else []
            r.prompt_logprobs.append((r.prompt_token_ids[t], chosen[j], alternatives, ranks[j]))
