"""A hardware profile: the step-time model, the KV capacity and the serving defaults of one replica.

The simulator's step duration is linear in the work of the step::

    t = base_s + per_token_s * P + per_decode_token_s * D + per_kv_token_s * K + per_prefill_s * C
        + per_prefill_pair_s * Q + per_first_decode_s * F + per_after_prefill_s * A
        + per_after_prefill_token_s * B + per_prefill_alone_s * L

where P is the number of prefill tokens the step processes, D the number of decoding requests
(one new token each), K the number of KV tokens its attention reads (the sum over the batch of
each request's context length, cached tokens plus the new ones) and C the number of prefill
chunks (requests prefilling in the step; ``per_prefill_s`` is each one's fixed cost, 0 unless
fitted) and Q the query-key pairs of their attention (a chunk of n tokens after c cached ones
has n c + n (n + 1) / 2: prefill attention grows with the square of the prompt; 0 unless fitted)
and F the decodes that are a request's first after its prefill (0 unless fitted). A is what the
steps before left behind: the sum of ``after_prefill_decay ** k`` over the earlier steps that
prefilled, k the steps that ran in between (on a CPU, a prefill evicts the caches the decodes
that follow work from, and they run slow for a few steps; 0 unless fitted), and B the same sum
with each of those steps weighted by its prefill tokens (a longer prefill evicts more, and the
steps after it pay longer; 0 unless fitted), and L is 1 for a step that prefills and runs no
decodes, 0 otherwise (on a CPU such a step is nearly always the first after the engine idled,
and it runs slower than the same prefill beside running decodes; 0 unless fitted). A profile without
``per_decode_token_s`` charges decode tokens ``per_token_s`` too (``base_s + per_token_s * T +
per_kv_token_s * K`` with T = P + D, the older one-cost model). A step with no tokens takes
``idle_s``, the simulator's tick while nothing can run.

``noise_sigma`` > 0 makes step times random: the simulator multiplies each by a seeded
log-normal factor ``exp(noise_sigma * Z)`` with median 1 (``StepNoise``), so the linear model
is the median step and the mean is ``exp(noise_sigma^2 / 2)`` times it, as the right-skewed
steps of a real engine are. With ``noise_corr`` > 0 the Z of successive steps form an AR(1)
series with that lag-one correlation (a machine's speed wanders over many steps); each Z is
still standard normal. With ``noise_white`` = w > 0, Z = sqrt(1 - w) A + sqrt(w) E, A that AR(1)
series and E drawn afresh at every step: a step's own jitter on top of the machine's wander, so
the noise averages out over a few steps faster than the AR(1) series alone would. With
``noise_sigma_below`` the factor is ``exp(noise_sigma_below * Z)`` when Z < 0: a real step
rarely runs much faster than its median, while slow ones run far slower. With ``noise_knee_s`` >
0 the noise depends on the step's length: a step whose median t is longer than the knee has its
sigmas times ``noise_scale(t)`` = sqrt(f^2 + (1 - f^2) (knee / t)^2), f = ``noise_floor``: part
of the jitter is a fixed number of seconds that a long step amortises (on a CPU, single-token
decodes of about 1 ms vary by 12-20%, 10-40 ms prefills by 3-6%), and part grows with the step.

The model has a core that any engine's steps can be fitted to (``base_s``, ``per_token_s``,
``per_kv_token_s``, ``per_decode_token_s``, ``per_prefill_s`` and ``noise_sigma``) and an optional
part, :class:`StepExtras` held as ``Profile.extras`` (None: none of them, every term 0): the terms
Q, F, A, B and L above and the noise's shape (``noise_corr``, ``noise_white``,
``noise_sigma_below``, ``noise_knee_s``, ``noise_floor``), each measured on one machine's
serving steps and added by a fit only where the data support it (``engine.sim.fit`` reports
which it took and why). ``Profile`` still takes each optional term as a keyword argument and
reads it as an attribute (``profile.noise_corr``), so ``dataclasses.replace(profile,
noise_corr=...)`` works too; docs/PROFILES.md has the evidence for each term.

Profiles live in JSON or YAML files (read and checked by ``profile_file``); the shipped ones are in
``engine/core/profiles/``. The file format and the derivation of the shipped numbers are in
docs/PROFILES.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tidegate.engine.core.profile_file import (
    FILE_KEY,
    PROFILE_SUFFIXES,
    Invalid,
    ProfileError,
    check_text,
    checked_values,
    checked_terms,
    fields_from_file,
    profile_to_dict,
    read_profile_file,
    show,
)

__all__ = ["EXTRA_TERMS", "PROFILES_DIR", "Profile", "ProfileError", "StepExtras", "after_prefill_weights",
           "load_profile", "shipped_profiles"]

PROFILES_DIR = Path(__file__).with_name("profiles")

#: the optional terms (``StepExtras``' fields, in its order): a profile without them has the core model
EXTRA_TERMS = ("per_prefill_pair_s", "per_first_decode_s", "per_after_prefill_s", "after_prefill_decay",
               "per_after_prefill_token_s", "per_prefill_alone_s", "noise_corr", "noise_white", "noise_sigma_below",
               "noise_knee_s", "noise_floor")

class _Keep:
    """The default of ``Profile``'s keyword arguments for the optional terms: what ``extras`` says."""

    def __repr__(self) -> str:
        return "<from extras>"


_KEEP: Final = _Keep()


@dataclass(frozen=True)
class StepExtras:
    """The optional, machine-specific part of the step model: terms measured on one machine's serving
    steps (a CPU's, see docs/PROFILES.md), that a fit adds only where its data support them. Every
    default leaves the term out: ``StepExtras()`` is the core model.

    :param per_prefill_pair_s: seconds per query-key pair of the prefills' attention (Q).
    :param per_first_decode_s: seconds per decode that is a request's first after its prefill (F).
    :param per_after_prefill_s: seconds a step takes more for each prefill step before it, weighted
        by ``after_prefill_decay`` to the power of the steps in between (A, ``after_prefill_weights``).
    :param after_prefill_decay: how much of a prefill's after-cost is left one step later, in [0, 1).
    :param per_after_prefill_token_s: seconds a step takes more for each prefill token of the
        steps before it, weighted as ``per_after_prefill_s``'s steps are (B, the same decay).
    :param per_prefill_alone_s: seconds a step takes more when it prefills and runs no decodes (L).
    :param noise_corr: lag-one correlation of the noise's normal draws from step to step (0:
        independent steps).
    :param noise_white: the share of the noise's normal draws' variance drawn afresh at every step,
        in [0, 1]; the rest follows the AR(1) series of ``noise_corr``. Set to 0 when ``noise_corr``
        is 0 (independent steps either way).
    :param noise_sigma_below: sigma of the factor's log below the median (None: ``noise_sigma``).
    :param noise_knee_s: the median step length up to which the noise has its whole sigma; longer
        steps get less (``Profile.noise_scale``). 0: every step the same sigma.
    :param noise_floor: the share of the sigma that very long steps keep, in [0, 1] (with a knee).
    :raises ProfileError: a value out of range, the field named in one sentence.
    """

    per_prefill_pair_s: float = 0.0
    per_first_decode_s: float = 0.0
    per_after_prefill_s: float = 0.0
    after_prefill_decay: float = 0.0
    per_after_prefill_token_s: float = 0.0
    per_prefill_alone_s: float = 0.0
    noise_corr: float = 0.0
    noise_white: float = 0.0
    noise_sigma_below: float | None = None
    noise_knee_s: float = 0.0
    noise_floor: float = 0.0

    def __reduce__(self) -> tuple[type[StepExtras], tuple[Any, ...]]:
        """Pickled and copied by its fields, built (and checked) again, as ``Profile`` is."""
        return type(self), tuple(getattr(self, f) for f in EXTRA_TERMS)

    def __post_init__(self) -> None:
        try:
            values = checked_terms({f: getattr(self, f) for f in EXTRA_TERMS}, key_of=lambda f: f)
        except Invalid as e:
            raise ProfileError(f"step extras: {e}.") from None
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if not self.noise_corr:  # without a wander, every draw is fresh already: one way to say it
            object.__setattr__(self, "noise_white", 0.0)

    def terms(self) -> dict[str, float | None]:
        """The terms this sets (those not at their default, which leaves the term out), by field name."""
        return {f: v for f, v in ((f, getattr(self, f)) for f in EXTRA_TERMS)
                if v != _EXTRA_DEFAULTS[f]}


#: the default of every optional term (what a file that leaves a key out means)
_EXTRA_DEFAULTS: dict[str, Any] = {f: StepExtras.__dataclass_fields__[f].default for f in EXTRA_TERMS}
#: the core's numeric fields, checked and normalised by ``_checked``
_CORE_NUMBERS = tuple(f for f in FILE_KEY if f not in _EXTRA_DEFAULTS)


@dataclass(frozen=True, init=False)
class Profile:
    """Step-time coefficients, KV capacity, SLOs and batch limits of one engine replica.

    The step model's core is the first fields; the machine-specific terms are in ``extras``
    (:class:`StepExtras`, None when there are none). Each of those may be given here by its own
    keyword (``Profile(..., noise_corr=0.5)``), which overrides what ``extras`` says, and is read
    as an attribute of the profile (``profile.noise_corr``, 0 or None without it).

    :param name: short identifier, e.g. ``a100-llama2-7b``.
    :param description: one line saying what hardware and model this stands for.
    :param base_s: fixed cost of every non-empty step in seconds (overhead plus streaming the weights).
    :param per_token_s: seconds per prefill token processed in the step (and per decode token
        when ``per_decode_token_s`` is None).
    :param per_kv_token_s: seconds per KV token read by the step's attention.
    :param kv_capacity_tokens: KV cache capacity M in tokens.
    :param block_size: tokens per KV block.
    :param ttft_slo_s: time-to-first-token service level objective in seconds.
    :param tpot_slo_s: time-per-output-token service level objective in seconds.
    :param idle_s: duration of a step with no tokens; None means ``base_s``.
    :param max_num_batched_tokens: default token budget of one step on this hardware.
    :param max_num_seqs: default cap on running requests.
    :param per_decode_token_s: seconds per decoding request's new token; None: ``per_token_s``.
    :param noise_sigma: sigma of the log-normal, median-1 factor on every step's time in the
        simulator (0: deterministic steps).
    :param source: how the numbers were obtained (roofline, fitted, paper).
    :param extra: anything else worth keeping with the numbers (roofline inputs, fit report).
    :param per_prefill_s: seconds per prefill chunk in the step (a prefilling request's fixed cost).
    :param extras: the optional terms (:class:`StepExtras`); None, or all of them at their
        defaults, is the core model (kept as None).
    :param per_prefill_pair_s, per_first_decode_s, per_after_prefill_s, after_prefill_decay,
        per_after_prefill_token_s, per_prefill_alone_s, noise_corr, noise_white, noise_sigma_below,
        noise_knee_s, noise_floor: keyword only, each optional term on its own (``StepExtras``
        says what it is); given, it replaces that of ``extras``.
    """

    name: str
    description: str
    base_s: float
    per_token_s: float
    per_kv_token_s: float
    kv_capacity_tokens: int
    block_size: int = 16
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    idle_s: float | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    per_decode_token_s: float | None = None
    noise_sigma: float = 0.0
    source: str = ""
    extra: dict = field(default_factory=dict)
    per_prefill_s: float = 0.0
    extras: StepExtras | None = None

    def __init__(self, name: str, description: str, base_s: float, per_token_s: float, per_kv_token_s: float,
                 kv_capacity_tokens: int, block_size: int = 16, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.1,
                 idle_s: float | None = None, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 per_decode_token_s: float | None = None, noise_sigma: float = 0.0, source: str = "",
                 extra: dict | _Keep = _KEEP, per_prefill_s: float = 0.0, extras: StepExtras | None = None, *,
                 per_prefill_pair_s: float | _Keep = _KEEP, per_first_decode_s: float | _Keep = _KEEP,
                 per_after_prefill_s: float | _Keep = _KEEP, after_prefill_decay: float | _Keep = _KEEP,
                 per_after_prefill_token_s: float | _Keep = _KEEP, per_prefill_alone_s: float | _Keep = _KEEP,
                 noise_corr: float | _Keep = _KEEP, noise_white: float | _Keep = _KEEP,
                 noise_sigma_below: float | None | _Keep = _KEEP, noise_knee_s: float | _Keep = _KEEP,
                 noise_floor: float | _Keep = _KEEP) -> None:
        if extras is not None and not isinstance(extras, StepExtras):
            raise ProfileError(f"profile {name!r}: extras must be a StepExtras or nothing (None), got "
                               f"{show(extras)}.")
        terms: dict[str, Any] = dict(_EXTRA_DEFAULTS) if extras is None else {
            f: getattr(extras, f) for f in EXTRA_TERMS}
        for f, v in (("per_prefill_pair_s", per_prefill_pair_s), ("per_first_decode_s", per_first_decode_s),
                     ("per_after_prefill_s", per_after_prefill_s), ("after_prefill_decay", after_prefill_decay),
                     ("per_after_prefill_token_s", per_after_prefill_token_s),
                     ("per_prefill_alone_s", per_prefill_alone_s), ("noise_corr", noise_corr),
                     ("noise_white", noise_white), ("noise_sigma_below", noise_sigma_below),
                     ("noise_knee_s", noise_knee_s), ("noise_floor", noise_floor)):
            if not isinstance(v, _Keep):
                terms[f] = v
        extra_map: Any = {} if isinstance(extra, _Keep) else extra
        values = {"base_s": base_s, "per_token_s": per_token_s, "per_kv_token_s": per_kv_token_s,
                  "per_decode_token_s": per_decode_token_s, "noise_sigma": noise_sigma,
                  "per_prefill_s": per_prefill_s, "idle_s": idle_s, "kv_capacity_tokens": kv_capacity_tokens,
                  "block_size": block_size, "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s,
                  "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs, **terms}
        try:
            checked = checked_values(values, key_of=lambda f: f)
            check_text(name, description, source, extra_map, key_of=lambda f: f)
        except Invalid as e:
            raise ProfileError(f"profile {name!r}: {e}.") from None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "description", description)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "extra", extra_map)
        for f in _CORE_NUMBERS:
            object.__setattr__(self, f, checked[f])
        kept = StepExtras(**{f: checked[f] for f in EXTRA_TERMS})
        object.__setattr__(self, "extras", None if kept == _NO_EXTRAS else kept)

    def __reduce__(self) -> tuple[type[Profile], tuple[Any, ...]]:
        """Pickled and copied by its fields, built (and checked) again: compiled
        (``tidegate compile``), a frozen dataclass's default would set them one by one."""
        return type(self), tuple(getattr(self, f) for f in self.__dataclass_fields__)

    # The optional terms, read as before: each is its ``extras``' (0, or None, without them).
    @property
    def per_prefill_pair_s(self) -> float:
        """``extras.per_prefill_pair_s`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.per_prefill_pair_s

    @property
    def per_first_decode_s(self) -> float:
        """``extras.per_first_decode_s`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.per_first_decode_s

    @property
    def per_after_prefill_s(self) -> float:
        """``extras.per_after_prefill_s`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.per_after_prefill_s

    @property
    def after_prefill_decay(self) -> float:
        """``extras.after_prefill_decay`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.after_prefill_decay

    @property
    def per_after_prefill_token_s(self) -> float:
        """``extras.per_after_prefill_token_s`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.per_after_prefill_token_s

    @property
    def per_prefill_alone_s(self) -> float:
        """``extras.per_prefill_alone_s`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.per_prefill_alone_s

    @property
    def noise_corr(self) -> float:
        """``extras.noise_corr`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.noise_corr

    @property
    def noise_white(self) -> float:
        """``extras.noise_white`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.noise_white

    @property
    def noise_sigma_below(self) -> float | None:
        """``extras.noise_sigma_below`` (None, ``noise_sigma`` below the median too, without extras)."""
        x = self.extras
        return None if x is None else x.noise_sigma_below

    @property
    def noise_knee_s(self) -> float:
        """``extras.noise_knee_s`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.noise_knee_s

    @property
    def noise_floor(self) -> float:
        """``extras.noise_floor`` (0 without extras)."""
        x = self.extras
        return 0.0 if x is None else x.noise_floor

    @property
    def decode_token_s(self) -> float:
        """Seconds per decode token: ``per_decode_token_s``, or ``per_token_s`` when not split."""
        return self.per_token_s if self.per_decode_token_s is None else self.per_decode_token_s

    def step_time_s(self, num_tokens: int, kv_tokens_read: int, num_decodes: int = 0, num_prefills: int = 0,
                    prefill_pairs: int = 0, first_decodes: int = 0, after_prefill: float = 0.0,
                    after_prefill_tokens: float = 0.0) -> float:
        """Median duration of one engine step in seconds (the noise, if any, is the simulator's).

        :param num_tokens: new tokens processed in the step (T = P + D); 0 for an idle tick.
        :param kv_tokens_read: KV tokens read by the step's attention (K).
        :param num_decodes: how many of the T tokens are decodes (D, one per decoding request).
        :param num_prefills: prefill chunks among the step's work (C, at most P).
        :param prefill_pairs: query-key pairs of the prefill chunks' attention (Q).
        :param first_decodes: decodes that are a request's first after its prefill (F, at most D).
        :param after_prefill: the weight A of the prefill steps before this one
            (``after_prefill_weights``; the simulator's executor keeps it).
        :param after_prefill_tokens: the weight B of the prefill tokens of the steps before
            (``after_prefill_weights`` of their prefill token counts).
        :return: ``base_s + per_token_s * P + decode_token_s * D + per_kv_token_s * K +
            per_prefill_s * C + per_prefill_pair_s * Q + per_first_decode_s * F + per_after_prefill_s * A
            + per_after_prefill_token_s * B + per_prefill_alone_s * L`` (L: 1 when C > 0 and D is 0), or
            the idle tick when T is 0.
        """
        if (num_tokens < 0 or kv_tokens_read < 0 or not 0 <= num_decodes <= num_tokens
                or not 0 <= num_prefills <= num_tokens - num_decodes or prefill_pairs < 0
                or not 0 <= first_decodes <= num_decodes or not after_prefill >= 0.0
                or not after_prefill_tokens >= 0.0):
            raise ValueError(
                f"step token counts must be non-negative with decodes and prefill chunks among the tokens, got "
                f"{num_tokens} tokens, {num_decodes} decodes ({first_decodes} of them first), {num_prefills} prefill "
                f"chunks with {prefill_pairs} pairs, {kv_tokens_read} KV tokens read and after-prefill weights of "
                f"{after_prefill} (steps) and {after_prefill_tokens} (tokens)")
        return self.median_step_s(num_tokens, kv_tokens_read, num_decodes, num_prefills, prefill_pairs, first_decodes,
                                  after_prefill, after_prefill_tokens)

    def median_step_s(self, num_tokens: int, kv_tokens_read: int, num_decodes: int = 0, num_prefills: int = 0,
                      prefill_pairs: int = 0, first_decodes: int = 0, after_prefill: float = 0.0,
                      after_prefill_tokens: float = 0.0) -> float:
        """``step_time_s`` without its check of the counts, for a caller whose counts hold by
        construction (the simulator's executor, at every step)."""
        if num_tokens == 0:
            return self.base_s if self.idle_s is None else self.idle_s
        t = self.base_s + self.per_token_s * num_tokens + self.per_kv_token_s * kv_tokens_read
        if self.per_decode_token_s is not None:
            t += (self.per_decode_token_s - self.per_token_s) * num_decodes
        if self.per_prefill_s:
            t += self.per_prefill_s * num_prefills
        x = self.extras
        if x is None:  # the core model
            return t
        if x.per_prefill_alone_s and num_prefills and not num_decodes:
            t += x.per_prefill_alone_s
        if x.per_prefill_pair_s:
            t += x.per_prefill_pair_s * prefill_pairs
        if x.per_first_decode_s:
            t += x.per_first_decode_s * first_decodes
        if x.per_after_prefill_s:
            t += x.per_after_prefill_s * after_prefill
        if x.per_after_prefill_token_s:
            t += x.per_after_prefill_token_s * after_prefill_tokens
        return t

    def predict_steps(self, steps) -> list[float]:
        """The median time of each of a run's non-empty steps, in the order they ran, the weights A
        and B of the prefill steps before each built from the run itself (:func:`after_prefill_weights`).

        :param steps: ``(new tokens, KV tokens read, decodes, prefill chunks, prefill pairs, first
            decodes)`` per step; the last three may be left out (0).
        """
        counts = [[int(x) for x in step] + [0] * (6 - len(step)) for step in steps]
        after = after_prefill_weights([c[0] > c[2] for c in counts], self.after_prefill_decay)
        after_tokens = after_prefill_weights([c[0] - c[2] for c in counts], self.after_prefill_decay)
        return [self.step_time_s(t, k, d, c, q, f, a, b)
                for (t, k, d, c, q, f), a, b in zip(counts, after, after_tokens)]

    def noise_scale(self, median_s: float) -> float:
        """What the noise's sigmas are multiplied by for a step whose median is ``median_s``: 1 up
        to ``noise_knee_s``, then ``sqrt(f^2 + (1 - f^2) (knee / t)^2)`` (f = ``noise_floor``)."""
        x = self.extras
        if x is None:
            return 1.0
        knee = x.noise_knee_s
        if not knee or median_s <= knee:
            return 1.0
        r = knee / median_s
        floor2 = x.noise_floor * x.noise_floor
        return math.sqrt(floor2 + (1.0 - floor2) * r * r)

    def to_dict(self) -> dict:
        """The profile in file format (the structure :func:`load_profile` reads)."""
        return profile_to_dict(self)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (indent 2) to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

def after_prefill_weights(prefilled, decay: float) -> list[float]:
    """The weight A of ``Profile.step_time_s`` for each of a run's non-empty steps, in the order they
    ran: the sum of ``decay ** k`` over the earlier steps that prefilled (``prefilled``, one truth
    value per step), k the steps in between (0 for the step right before). Given each step's
    prefill token count instead of a truth value, the sum weighs each step by it: the weight B."""
    weights = []
    a = 0.0
    for p in prefilled:
        weights.append(a)
        a = decay * a + float(p)
    return weights

def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in ``engine/core/profiles/``, sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a shipped profile by name or a profile file by path.

    :param name_or_path: a shipped name (see :func:`shipped_profiles`) or a path to a
        ``.json``, ``.yaml`` or ``.yml`` file.
    :raises ProfileError: the name is unknown or the file is missing or invalid.
    """
    text = str(name_or_path)
    looks_like_path = (isinstance(name_or_path, Path) or "/" in text or "\\" in text
                       or text.lower().endswith(PROFILE_SUFFIXES))
    if not looks_like_path:
        shipped = shipped_profiles()
        if text not in shipped:
            raise ProfileError(
                f"unknown profile {text!r}: expected one of {', '.join(shipped)} "
                f"or a path to a .json, .yaml or .yml file.")
        return _load_file(PROFILES_DIR / f"{text}.json")
    return _load_file(Path(name_or_path))

def _load_file(path: Path) -> Profile:
    data = read_profile_file(path)
    defaults = {**{f: Profile.__dataclass_fields__[f].default for f in FILE_KEY if f not in _EXTRA_DEFAULTS},
                **_EXTRA_DEFAULTS}
    try:
        return Profile(**fields_from_file(data, defaults))
    except Invalid as e:
        raise ProfileError(f"profile file {str(path)!r}: {e}.") from None


#: the core model (made here, once its checks are defined): no optional term (a profile keeps None instead)
_NO_EXTRAS: Final = StepExtras()
