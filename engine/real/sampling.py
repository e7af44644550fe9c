"""SamplingParams: how a request picks its tokens.

Plain data with no torch import, so the server's protocol layer can build and check it without
loading the model stack; ``engine.real.sampler.Sampler`` does the sampling.

The order of the steps on a request's next-token logits is vLLM's (v1): the ``allowed_token_ids``
and ``bad_words_token_ids`` masks, then the ``min_tokens`` mask and ``logit_bias``, then the
repetition, frequency and presence penalties, then (for ``logprobs``) the log-softmax, then
temperature, ``min_p``, ``top_k`` and ``top_p``, then the draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidegate.engine.real.structured import StructuredOutput

#: the most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (OpenAI's limit, vLLM's default)
MAX_LOGPROBS = 20
#: the most token ids ``logprob_token_ids`` may name: each is one entry of every token's logprobs (vLLM's bound)
MAX_LOGPROB_TOKEN_IDS = 128
#: the largest ``logit_bias`` magnitude (OpenAI's range)
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How a request picks its tokens (``max_tokens`` lives on the Request).

    :param temperature: 0 (or below 1e-5) is greedy; otherwise logits are divided by it before sampling.
    :param top_p: nucleus sampling: keep the smallest set of tokens with this much probability.
    :param top_k: keep the k most likely tokens; 0 keeps all.
    :param seed: seeds the request's own generator, so its samples reproduce (also across an
        eviction: the generator keeps its state while the request recomputes its KV); None uses
        the executor's generator.
    :param stop_token_ids: token ids that end the request (finish reason ``stop``); the token is
        kept in the token ids, its text is not shown (unless ``include_stop_str_in_output``).
    :param stop: strings that end the request once the output text contains one; the text is cut
        before it (unless ``include_stop_str_in_output``).
    :param ignore_eos: keep generating past EOS (up to ``max_tokens``); EOS is then an ordinary token.
    :param presence_penalty: in [-2, 2]; subtracted once from the logit of every token the request
        has generated so far (OpenAI semantics).
    :param frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the request
        has generated it so far (OpenAI semantics).
    :param repetition_penalty: in [0.01, 100]; the logits of tokens in the prompt or the output so far are
        divided by it where positive and multiplied by it where negative (vLLM and HF semantics);
        1 is off, above 1 discourages repeats.
    :param logit_bias: token id -> a value in [-100, 100] added to that token's logit; ids must be
        in the model's vocabulary (checked by :meth:`verify`).
    :param min_p: in [0, 1]; after temperature, tokens whose probability is below ``min_p`` times
        the most likely token's are dropped (1 keeps only the most likely).
    :param min_tokens: the request generates at least this many tokens before it may stop: EOS and
        ``stop_token_ids`` are masked out until then, and a stop string only counts when the token
        that completes it comes after them.
    :param include_stop_str_in_output: keep the stop string (or the stop token's text) in the text.
    :param allowed_token_ids: None: any token; otherwise a non-empty list of the only token ids the
        request may generate (every other logit is -inf from the first step of the logits
        processing on); ids must be in the model's vocabulary (checked by :meth:`verify`).
    :param bad_words_token_ids: token id sequences the output must never contain (vLLM's
        ``bad_words``, tokenized by :func:`bad_words_token_ids`): a one-token sequence bans its token
        at every step; a longer one bans its last token at the steps where the output so far ends
        with the rest of it. Only output tokens count, as in vLLM: a sequence that begins in the
        prompt is not banned. The sequences must be non-empty, their ids in the model's vocabulary
        (checked by :meth:`verify`), and they must not ban every id of ``allowed_token_ids``. At a
        step where the masks together leave no token (say a longer bad word, or ``min_tokens``,
        bans the rest of ``allowed_token_ids``), they are lifted for that step.
    :param logprobs: None: none; k in [0, 20]: for every generated token, its log-probability and the
        k most likely tokens with theirs (``Request.logprobs``). The distribution is the one the token
        was drawn from after the ``allowed_token_ids`` and ``bad_words_token_ids`` masks,
        ``logit_bias``, the ``min_tokens`` mask and the penalties, but before temperature and the
        ``min_p``/``top_k``/``top_p`` truncation (masked tokens have logprob -inf). vLLM's default
        (``--logprobs-mode raw_logprobs``) is before the masks, bias and penalties as well; the two
        agree whenever a request sets none of them.
    :param prompt_logprobs: None: none; k in [0, 20]: the log-probability of each prompt token given
        the ones before it under the model's raw distribution, and the k most likely tokens
        (``Request.prompt_logprobs``; the first prompt token has None).
    :param logprob_token_ids: with ``logprobs``, the alternatives of each token's entry are these ids
        (in this order, at most ``MAX_LOGPROB_TOKEN_IDS``) instead of the most likely ones, as vLLM's
        parameter of that name.
    :param skip_special_tokens: the text leaves out special tokens (BOS, EOS, ...), as vLLM's default;
        False shows them.
    :param structured_outputs: None: free text; otherwise the constraint the output is held to (a JSON
        schema, any JSON object, a regular expression, a choice or a grammar; ``engine.real.structured``). Its
        mask goes on the logits before every other step, and the request ends when the constraint admits no
        more tokens.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    logprob_token_ids: list[int] | None = None
    structured_outputs: StructuredOutput | None = None

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
        self._check_penalties()
        self._check_tokens()
        self._check_masks()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutput):
            raise ValueError(f"structured_outputs must be None or a StructuredOutput, got "
                             f"{type(self.structured_outputs).__name__}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.01 <= self.repetition_penalty <= 100:  # beyond, float32 logits divide to inf or 0
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logit_bias is not None:
            bias = {}
            for token, value in self.logit_bias.items():
                try:
                    token_id = int(token)  # JSON object keys arrive as strings
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}") from None
                if token_id < 0 or (isinstance(token, float) and token != token_id):
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token_id}")
                bias[token_id] = float(value)
            self.logit_bias = bias

    def _check_tokens(self) -> None:
        if type(self.min_tokens) is not int or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value}")
        ids = self.logprob_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not 0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS \
                    or not all(_is_token_id(t) for t in ids):
                raise ValueError(f"logprob_token_ids must be None or a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids "
                                 f"(integers >= 0), got {len(ids) if isinstance(ids, (list, tuple)) else ids!r}")
            if self.logprobs is None:
                raise ValueError("logprob_token_ids needs logprobs")
            self.logprob_token_ids = list(ids)

    def _check_masks(self) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids \
                    or not all(_is_token_id(t) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be None or a non-empty list of token ids (integers >= 0), "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words_token_ids is not None:
            sequences = self.bad_words_token_ids
            if not isinstance(sequences, (list, tuple)) or not all(
                    isinstance(seq, (list, tuple)) and seq and all(_is_token_id(t) for t in seq) for seq in sequences):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids (integers >= 0), "
                                 f"got {sequences!r}")
            self.bad_words_token_ids = [list(seq) for seq in sequences]

    def verify(self, vocab_size: int, max_tokens: int | None = None, eos_token_ids=()) -> None:
        """Check what depends on the model and the request: token ids within the vocabulary,
        ``min_tokens`` no more than ``max_tokens``, and ``allowed_token_ids`` that the single-token bad
        words and ``min_tokens`` do not mask whole (while ``min_tokens`` holds, the tokens that end the
        sequence are masked: a stop id, or one of the model's ``eos_token_ids`` unless the request ignores
        EOS). With nothing left, every logit would be -inf (vLLM would draw from them): refused up front.

        :raises ValueError: one sentence naming the parameter.
        """
        named = (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids),
                 ("allowed_token_ids", self.allowed_token_ids or ()),
                 ("logprob_token_ids", self.logprob_token_ids or ()),
                 ("bad_words (bad_words_token_ids)", [t for seq in self.bad_words_token_ids or () for t in seq]))
        for param, ids in named:
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(f"{param} holds token ids outside the vocabulary of {vocab_size}: {bad[:5]}.")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({max_tokens}), got {self.min_tokens}.")
        if self.allowed_token_ids is not None:
            allowed = set(self.allowed_token_ids)
            banned = {seq[0] for seq in self.bad_words_token_ids or () if len(seq) == 1}
            if allowed <= banned:
                raise ValueError("bad_words bans every token of allowed_token_ids, which leaves nothing to generate.")
            ends = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
            if self.min_tokens and allowed <= ends | banned:
                raise ValueError("min_tokens masks every token of allowed_token_ids (each ends the sequence"
                                 + (" or is a bad word" if banned & allowed else "")
                                 + "), which leaves nothing to generate.")

    @property
    def greedy(self) -> bool:
        # Below this temperature logits / temperature overflows to inf: the limit is argmax anyway.
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any of the repetition, frequency and presence penalties is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token id sequences of vLLM's ``bad_words``, as its ``SamplingParams.update_from_tokenizer``
    builds them, for ``SamplingParams.bad_words_token_ids``.

    Each word is tokenized without special tokens twice, stripped of leading whitespace: as it is,
    and after a space, since most tokenizers give a word in mid-text (after a space) other tokens
    than at the start. The second is kept only where it is a different word token of the same
    length: same length, and a first id unlike the first's.

    :param tokenizer: has ``encode(text, add_special_tokens=...)`` (a Hugging Face tokenizer or the
        tiny model's ``ByteTokenizer``).
    :param words: the bad words; a lone string is one word.
    :raises ValueError: for a word with no tokens (empty or only whitespace), naming ``bad_words``.
    """
    if isinstance(words, str):
        words = [words]
    sequences: list[list[int]] = []
    for word in words:
        plain = [int(t) for t in tokenizer.encode(word.lstrip(), add_special_tokens=False)]
        if not plain:
            raise ValueError(f"bad_words must hold words with at least one token, got {word!r}")
        sequences.append(plain)
        spaced = [int(t) for t in tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)]
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
