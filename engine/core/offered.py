"""The sizes of the offered requests, estimated from the completed ones without admission's bias.

A controller judging whether a replica is offered more than it can serve needs the mean size of
what arrives. Only completed requests show their output length, and admission decides which
complete: refusing by predicted delay refuses the longest prompts first, so the completed ones
are smaller than the offered ones and a bound estimated from them runs high (3-13% at 1.2 x
lambda_max on summarisation lengths), which hides the overload it should show.

:class:`OfferedSizes` weights each completed request by the inverse of the share admitted among
the arrivals of its prompt's size (a power-of-two bin of the prompt length): inverse probability
weighting, unbiased when admission depends on the prompt and the engine's state, never on the
unknown output. Where nothing is refused every weight is 1, and the estimates are the completed
requests' exponentially weighted means.
"""

from __future__ import annotations

import math

#: prompt bins: [2^k, 2^(k+1)) tokens, the last one open
PROMPT_BINS = 24


class OfferedSizes:
    """Exponentially weighted means (weight ``alpha`` a completion, start-corrected) of the
    offered requests' output length and lifetime KV workload W = P D + D (D + 1) / 2, with the
    standard error of the W mean.

    :param alpha: the means' weight of one completion; the admitted shares forget at the same
        rate per arrival.
    """

    __slots__ = ("alpha", "_offered", "_admitted", "_stamp", "_arrivals", "_w", "_wd", "_ww", "_www", "_w2",
                 "_wp", "_wpp", "_bin_n", "_bin_d")

    def __init__(self, alpha: float = 0.01) -> None:
        self.alpha = alpha
        self._offered = [0.0] * PROMPT_BINS  # decayed arrival counts per prompt bin
        self._admitted = [0.0] * PROMPT_BINS
        self._stamp = [0] * PROMPT_BINS  # the arrival count at a bin's last update
        self._arrivals = 0
        self._w = 0.0  # sum of decayed weights
        self._wd = 0.0  # ... times D
        self._ww = 0.0  # ... times W
        self._www = 0.0  # ... times W^2
        self._w2 = 0.0  # sum of squared decayed weights (for the effective sample size)
        self._wp = 0.0  # ... times the prompt P
        self._wpp = 0.0  # ... times P^2
        self._bin_n = [0.0] * PROMPT_BINS  # completions per prompt bin, decayed per completion of the bin
        self._bin_d = [0.0] * PROMPT_BINS  # ... times their output

    @staticmethod
    def _bin(prompt_tokens: int) -> int:
        return min(max(int(prompt_tokens), 1).bit_length() - 1, PROMPT_BINS - 1)

    def _decayed(self, k: int) -> None:
        age = self._arrivals - self._stamp[k]
        if age:
            keep = (1.0 - self.alpha) ** age
            self._offered[k] *= keep
            self._admitted[k] *= keep
            self._stamp[k] = self._arrivals

    def arrived(self, prompt_tokens: int, admitted: bool) -> None:
        """One servable arrival, admitted or refused."""
        self._arrivals += 1
        k = self._bin(prompt_tokens)
        self._decayed(k)
        self._offered[k] += 1.0
        if admitted:
            self._admitted[k] += 1.0

    def weight(self, prompt_tokens: int) -> float:
        """Arrivals per admission among recent prompts of this size: 1 where nothing was refused,
        at most the bin's recent arrivals (one admission is always counted)."""
        k = self._bin(prompt_tokens)
        self._decayed(k)
        offered = self._offered[k]
        return offered / max(self._admitted[k], 1.0) if offered > self._admitted[k] else 1.0

    def completed(self, prompt_tokens: int, output_tokens: int) -> None:
        """One completed request, weighted by :meth:`weight`."""
        keep = 1.0 - self.alpha
        w = self.weight(prompt_tokens)
        work = prompt_tokens * output_tokens + output_tokens * (output_tokens + 1) / 2
        k = self._bin(prompt_tokens)
        self._bin_n[k] = self._bin_n[k] * keep + 1.0
        self._bin_d[k] = self._bin_d[k] * keep + output_tokens
        self._w = self._w * keep + w
        self._wd = self._wd * keep + w * output_tokens
        self._ww = self._ww * keep + w * work
        self._www = self._www * keep + w * work * work
        self._w2 = self._w2 * keep * keep + w * w
        self._wp = self._wp * keep + w * prompt_tokens
        self._wpp = self._wpp * keep + w * prompt_tokens * prompt_tokens

    @property
    def output_tokens(self) -> float:
        """Mean output length of the offered requests (0 before any completion)."""
        return self._wd / self._w if self._w > 0 else 0.0

    def output_for(self, prompt_tokens: int, fallback: bool = True) -> float:
        """The output expected of an arrival with this prompt: the mean output of the recent completions of
        its prompt's size (its bin's last hundred or so), else of the offered requests (0 before any
        completion; with ``fallback`` False, 0 where none of its size completed). Within a bin admission
        does not depend on the output, so the bin's completions are its arrivals' sample."""
        k = self._bin(prompt_tokens)
        n = self._bin_n[k]
        if n > 0:
            return self._bin_d[k] / n
        return self.output_tokens if fallback else 0.0

    @property
    def kv_workload(self) -> float:
        """Mean lifetime KV workload W of the offered requests (0 before any completion)."""
        return self._ww / self._w if self._w > 0 else 0.0

    @property
    def kv_workload_se(self) -> float:
        """The standard error of :attr:`kv_workload`: the weighted standard deviation over the
        square root of the effective number of completions less one (``(sum w)^2 / sum w^2``, the
        unbiased weighted variance); 0 before the effective number reaches 1.5."""
        return self._se(self._ww, self._www)

    @property
    def prompt_se(self) -> float:
        """The standard error of the offered requests' mean prompt, from the completed ones weighted alike (as
        :attr:`kv_workload_se` of W)."""
        return self._se(self._wp, self._wpp)

    def _se(self, first: float, second: float) -> float:
        if not self._w > 0:
            return 0.0
        effective = self._w * self._w / self._w2
        if effective < 1.5:
            return 0.0
        mean = first / self._w
        return math.sqrt(max(second / self._w - mean * mean, 0.0) / (effective - 1.0))
