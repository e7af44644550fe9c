"""Synthetic workloads: request classes described in YAML (or a mapping), sampled into `Arrival`s.

Each class is an arrival stream (Poisson, gamma with a given burstiness, or deterministic) with
prompt and output length distributions; `load_synthetic` documents the format. The reading is in
steps, each its own function: open and check the top level (`_open`), the arrival process
(`_arrival_process`), the duration (`_duration`), the classes (`_class_streams`, one
`_class_stream` each, lengths by `_Checker.lengths`), then sampling (`_sample`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
import yaml

from tidegate.engine.workloads.arrivals import (DEFAULT_MAX_TOKENS, Arrival, WorkloadError, check_options, is_int,
                                                scale_token_array, scale_tokens)

__all__ = ["load_synthetic"]

_PROCESSES = ("poisson", "gamma", "deterministic")
_DISTRIBUTIONS = {  # name -> its keys (required, optional)
    "fixed": (("value",), ()),
    "uniform": (("low", "high"), ()),
    "geometric": (("mean",), ()),
    "lognormal": (("mean", "sigma"), ()),
    "choice": (("values",), ("weights",)),
}
_TOP_KEYS = ("name", "description", "arrival", "duration_s", "seed", "max_tokens", "classes")
_CLASS_KEYS = ("name", "rate_rps", "prompt_tokens", "output_tokens", "max_tokens", "shared_prefix_tokens",
               "turns", "think_time_s")
#: prompt tokens per content id of a synthetic prompt (``Arrival.prefix_ids``)
CONTENT_TOKENS = 16

Sampler = Callable[[np.random.Generator, int], np.ndarray]


class _Stream(NamedTuple):
    """One checked request class: its arrival rate, length samplers and ``max_tokens``."""

    rate_rps: float
    prompt_tokens: Sampler
    output_tokens: Sampler
    max_tokens: int
    shared_prefix_tokens: int
    turns: Sampler | None
    think_time_s: float


def load_synthetic(
    path_or_mapping: str | Path | Mapping[str, Any],
    *,
    seed: int | None = None,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
    length_scale: float = 1.0,
    max_tokens_cap: int | None = None,
) -> list[Arrival]:
    """Generate arrivals from a synthetic workload description.

    The description (a YAML file or the same mapping) has ``arrival: {process: poisson}``
    (or ``gamma`` with ``burstiness``, the coefficient of variation of the inter-arrival
    times, or ``deterministic``), ``duration_s``, optional ``seed`` and ``max_tokens``, and a
    list of ``classes``, each with ``rate_rps``, ``prompt_tokens``, ``output_tokens`` and an
    optional ``name`` and ``max_tokens``. A length is an integer or one of
    ``{dist: fixed, value}``, ``{dist: uniform, low, high}`` (inclusive),
    ``{dist: geometric, mean}``, ``{dist: lognormal, mean, sigma}`` (``mean`` is the mean of the
    lengths, ``sigma`` that of the underlying normal) and
    ``{dist: choice, values, weights}``; samples are rounded to integers of at least 1.

    Each class is its own arrival stream over ``[0, duration_s)``; the streams are merged by
    time and ``class_id`` is the class's index.

    Prompts that share a prefix, for the prefix cache (each arrival's ``prefix_ids`` say which
    content it shares, one id per `CONTENT_TOKENS` tokens):

    - ``shared_prefix_tokens: N``: every prompt of the class starts with the same N tokens (a system
      prompt) before its own ``prompt_tokens``;
    - ``turns: <length>`` and ``think_time_s: T``: each arrival starts a conversation of that many
      turns. A later turn arrives an exponential time of mean T after the one before (whether or
      not that one has been answered: the stream stays open-loop) and resends the history, every
      earlier prompt and answer, before its own ``prompt_tokens``.

    :param path_or_mapping: a YAML file or an already loaded mapping.
    :param seed: random seed; when None, the file's ``seed``, else 0.
    :param duration_s: length of the workload in seconds; overrides the file's ``duration_s``.
    :param rate_scale: multiply every class's rate by this (> 0), over the same duration.
    :param length_scale: multiply prompt and output lengths by this (rounded, at least 1).
    :param max_tokens_cap: upper bound on every class's ``max_tokens``; outputs are cut to it.
    :return: arrivals sorted by time.
    """
    check_options(rate_scale, length_scale, max_tokens_cap)
    check, spec = _open(path_or_mapping)
    process, burstiness = _arrival_process(spec, check)
    duration_s = _duration(spec, duration_s, check)
    if seed is None:
        seed = check.integer(spec.get("seed", 0), "seed", minimum=0)
    default_max_tokens = check.integer(spec.get("max_tokens", DEFAULT_MAX_TOKENS), "max_tokens")
    streams = _class_streams(spec, check, default_max_tokens, rate_scale, max_tokens_cap)
    return _sample(streams, np.random.default_rng(seed), process, burstiness, duration_s, length_scale)


def _open(path_or_mapping: str | Path | Mapping[str, Any]) -> tuple[_Checker, Mapping[str, Any]]:
    """The checker naming the source, and the description once its top level is a mapping of
    known keys."""
    if isinstance(path_or_mapping, Mapping):
        source, spec = "workload", path_or_mapping
    else:
        source, spec = str(path_or_mapping), _load_yaml(Path(path_or_mapping))
    check = _Checker(source)
    if not isinstance(spec, Mapping):
        check.fail("", f"the top level is a {type(spec).__name__}", "a mapping of workload keys (a trace file goes "
                                                                   "to --trace)")
    check.keys(spec, "", _TOP_KEYS)
    return check, spec


def _arrival_process(spec: Mapping[str, Any], check: _Checker) -> tuple[str, float]:
    """The ``arrival`` entry as (process, burstiness); burstiness is 1 unless the process is gamma."""
    arrival = spec.get("arrival", {"process": "poisson"})
    if not isinstance(arrival, Mapping):
        check.fail("arrival", f"{arrival!r} is not a mapping", "{process: poisson | gamma | "
                   "deterministic}")
    check.keys(arrival, "arrival", ("process", "burstiness"))
    process = arrival.get("process", "poisson")
    if process not in _PROCESSES:
        check.fail("arrival.process", f"unknown process {process!r}",
                   f"one of {', '.join(_PROCESSES)}")
    burstiness = 1.0
    if process == "gamma":
        if "burstiness" not in arrival:
            check.fail("arrival.burstiness", "missing for the gamma process",
                       "the coefficient of variation of inter-arrival times (1 is Poisson)")
        burstiness = check.number(arrival["burstiness"], "arrival.burstiness", positive=True)
    elif "burstiness" in arrival:
        check.fail("arrival.burstiness", f"given for the {process} process",
                   "burstiness only with process: gamma")
    return process, burstiness


def _duration(spec: Mapping[str, Any], duration_s: float | None, check: _Checker) -> float:
    """The ``duration_s`` option, else the file's."""
    if duration_s is None:
        if "duration_s" not in spec:
            check.fail("duration_s", "missing", "a positive number of seconds (in the file or "
                       "as the duration_s option)")
        duration_s = spec["duration_s"]
    return check.number(duration_s, "duration_s", positive=True)


def _class_streams(spec: Mapping[str, Any], check: _Checker, default_max_tokens: int, rate_scale: float,
                   max_tokens_cap: int | None) -> list[_Stream]:
    """The ``classes`` list, each class checked in turn."""
    classes = spec.get("classes")
    if not isinstance(classes, list) or not classes:
        check.fail("classes", "missing or empty" if not classes else f"{classes!r} is not a list",
                   "a list of request classes")
    return [_class_stream(cls, f"classes[{i}]", check, default_max_tokens, rate_scale, max_tokens_cap)
            for i, cls in enumerate(classes)]


def _class_stream(cls: Any, where: str, check: _Checker, default_max_tokens: int, rate_scale: float,
                  max_tokens_cap: int | None) -> _Stream:
    """One class: its rate times ``rate_scale``, its length samplers and its capped ``max_tokens``."""
    if not isinstance(cls, Mapping):
        check.fail(where, f"{cls!r} is not a mapping",
                   "a class with rate_rps, prompt_tokens and output_tokens")
    check.keys(cls, where, _CLASS_KEYS)
    for key in ("rate_rps", "prompt_tokens", "output_tokens"):
        if key not in cls:
            check.fail(f"{where}.{key}", "missing", "a value for every class")
    if not isinstance(cls.get("name", ""), str):
        check.fail(f"{where}.name", f"{cls['name']!r} is not a string", "a class name")
    rate_rps = check.number(cls["rate_rps"], f"{where}.rate_rps", positive=True)
    max_tokens = check.integer(cls.get("max_tokens", default_max_tokens), f"{where}.max_tokens")
    if max_tokens_cap is not None:
        max_tokens = min(max_tokens, max_tokens_cap)
    shared = check.integer(cls.get("shared_prefix_tokens", 0), f"{where}.shared_prefix_tokens", minimum=0)
    turns = check.lengths(cls["turns"], f"{where}.turns") if "turns" in cls else None
    if "think_time_s" in cls and turns is None:
        check.fail(f"{where}.think_time_s", "given without turns", "think_time_s only with turns")
    think_time_s = check.number(cls.get("think_time_s", 0.0), f"{where}.think_time_s")
    return _Stream(rate_rps * rate_scale,
                   check.lengths(cls["prompt_tokens"], f"{where}.prompt_tokens"),
                   check.lengths(cls["output_tokens"], f"{where}.output_tokens"),
                   max_tokens, shared, turns, think_time_s)


def _sample(streams: list[_Stream], rng: np.random.Generator, process: str, burstiness: float,
            duration_s: float, length_scale: float) -> list[Arrival]:
    """Sample every stream over ``[0, duration_s)`` and merge them by time; ``class_id`` is the
    stream's index. Streams without shared prefixes sample exactly as before they had any."""
    arrivals: list[Arrival] = []
    ids = _ContentIds()
    for class_id, stream in enumerate(streams):
        t = _arrival_times(rng, process, stream.rate_rps, burstiness, duration_s)
        n = len(t)
        prompts = scale_token_array(stream.prompt_tokens(rng, n), length_scale).tolist()
        outputs = np.minimum(scale_token_array(stream.output_tokens(rng, n), length_scale),
                             stream.max_tokens).tolist()
        times = t.tolist()
        if stream.turns is None and not stream.shared_prefix_tokens:
            arrivals += [Arrival(a, p, o, stream.max_tokens, class_id) for a, p, o in zip(times, prompts, outputs)]
            continue
        system_tokens = scale_tokens(stream.shared_prefix_tokens, length_scale) if stream.shared_prefix_tokens else 0
        system = (ids.fresh(system_tokens // CONTENT_TOKENS), system_tokens)
        if stream.turns is None:
            for a, p, o in zip(times, prompts, outputs):
                arrivals.append(_sharing(a, system, p, o, stream.max_tokens, class_id, ids))
            continue
        arrivals += _conversations(rng, stream, class_id, times, prompts, outputs, system, length_scale, ids)
    arrivals.sort(key=lambda a: a.arrival_time_s)  # stable: a class's order stays within a tie
    return arrivals


class _ContentIds:
    """Content ids, each new one unused before: equal ids mean the same tokens after the same prefix."""

    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> tuple[int, ...]:
        first = self.next
        self.next += n
        return tuple(range(first, first + n))


def _sharing(t: float, history: tuple[tuple[int, ...], int], own: int, output: int, max_tokens: int,
             class_id: int, ids: _ContentIds) -> Arrival:
    """An arrival whose prompt is ``history`` (the content ids of its full runs, and its tokens) then
    ``own`` tokens of its own."""
    shared, history_tokens = history
    prompt = history_tokens + own
    content = shared + ids.fresh(-(-prompt // CONTENT_TOKENS) - len(shared))
    return Arrival(t, prompt, output, max_tokens, class_id, prefix_ids=content,
                   prefix_block_tokens=float(CONTENT_TOKENS))


def _conversations(rng: np.random.Generator, stream: _Stream, class_id: int, starts: list[float],
                   prompts: list[int], outputs: list[int], system: tuple[tuple[int, ...], int],
                   length_scale: float, ids: _ContentIds) -> list[Arrival]:
    """The turns of a conversation starting at each of ``starts``: its first turn takes that start's
    lengths, later ones their own; each resends the history (``system`` first) before its prompt."""
    n_turns = stream.turns(rng, len(starts)).tolist() if stream.turns is not None else [1] * len(starts)
    extra = int(sum(n_turns)) - len(starts)
    more_prompts = scale_token_array(stream.prompt_tokens(rng, extra), length_scale).tolist()
    more_outputs = np.minimum(scale_token_array(stream.output_tokens(rng, extra), length_scale),
                              stream.max_tokens).tolist()
    gaps = rng.exponential(stream.think_time_s, extra).tolist() if stream.think_time_s > 0 else [0.0] * extra
    arrivals = []
    k = 0
    for start, own, output, turns in zip(starts, prompts, outputs, n_turns):
        t, history = start, system
        for turn in range(int(turns)):
            if turn:
                t, own, output = t + gaps[k], more_prompts[k], more_outputs[k]
                k += 1
            a = _sharing(t, history, own, output, stream.max_tokens, class_id, ids)
            arrivals.append(a)
            # the next turn resends this prompt and its answer: the runs this prompt filled stay, the
            # run it left partial and those of the answer are new content
            full = a.prompt_tokens // CONTENT_TOKENS
            sent = a.prompt_tokens + output
            history = (a.prefix_ids[:full] + ids.fresh(sent // CONTENT_TOKENS - full), sent)
    return arrivals


def _load_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the file ({e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise WorkloadError(f"{where}: {problem}, expected a YAML workload description") from None


def _arrival_times(rng: np.random.Generator, process: str, rate_rps: float, burstiness: float,
                   duration_s: float) -> np.ndarray:
    """Arrival times of one stream in ``[0, duration_s)``."""
    expected = rate_rps * duration_s
    if process == "deterministic":
        times = np.arange(1, math.ceil(expected) + 1) / rate_rps
        return times[times < duration_s]
    shape = 1.0 / burstiness**2  # gamma with cv=1 is the exponential, i.e. Poisson arrivals
    chunk = int(expected + 6 * burstiness * math.sqrt(expected) + 16)
    gaps = np.empty(0)
    while gaps.sum() < duration_s:  # rarely more than one round
        if process == "poisson":
            more = rng.exponential(1.0 / rate_rps, chunk)
        else:
            more = rng.gamma(shape, 1.0 / (rate_rps * shape), chunk)
        gaps = np.concatenate([gaps, more])
    times = np.cumsum(gaps)
    return times[times < duration_s]


class _Checker:
    """Validates a workload mapping; every failure names the source and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str, expected: str) -> NoReturn:
        prefix = f"{self.source}: {where}: " if where else f"{self.source}: "
        raise WorkloadError(f"{prefix}{problem}, expected {expected}")

    def keys(self, mapping: Mapping[str, Any], where: str, allowed: tuple[str, ...]) -> None:
        for key in mapping:
            if key not in allowed:
                self.fail(f"{where}.{key}" if where else str(key), f"unknown key {key!r}",
                          f"one of {', '.join(allowed)}")

    def number(self, value: Any, where: str, *, positive: bool = False) -> float:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
        if not ok or value < 0 or (positive and value == 0):
            hint = ""
            if isinstance(value, str):
                try:
                    float(value)
                    hint = " (YAML reads a number with an exponent and no dot, as 1e12, as text: write 1.0e+12)"
                except ValueError:
                    pass
            self.fail(where, f"{value!r} is not allowed",
                      ("a positive number" if positive else "a number of at least 0") + hint)
        return float(value)

    def integer(self, value: Any, where: str, *, minimum: int = 1) -> int:
        if not is_int(value) or value < minimum:
            self.fail(where, f"{value!r} is not allowed", f"an integer of at least {minimum}")
        return int(value)

    def lengths(self, spec: Any, where: str) -> Sampler:
        """A sampler of token counts (integers >= 1) from an int or a distribution mapping."""
        if not isinstance(spec, Mapping):
            value = self.integer(spec, where)
            return lambda rng, n: np.full(n, value, dtype=np.int64)
        dist = spec.get("dist")
        if dist not in _DISTRIBUTIONS:
            self.fail(where, f"unknown distribution {dist!r}",
                      f"one of {', '.join(_DISTRIBUTIONS)}")
        required, optional = _DISTRIBUTIONS[dist]
        self.keys(spec, where, ("dist", *required, *optional))
        for key in required:
            if key not in spec:
                self.fail(f"{where}.{key}", "missing", f"{', '.join(required)} for dist: {dist}")
        if dist == "fixed":
            return self.lengths(spec["value"], f"{where}.value")
        if dist == "uniform":
            low = self.integer(spec["low"], f"{where}.low")
            high = self.integer(spec["high"], f"{where}.high", minimum=low)
            return lambda rng, n: rng.integers(low, high + 1, n)
        if dist == "geometric":
            mean = self.number(spec["mean"], f"{where}.mean")
            if mean < 1:
                self.fail(f"{where}.mean", f"{mean!r} is below 1", "a mean of at least 1 token")
            return lambda rng, n: rng.geometric(1.0 / mean, n)  # support 1, 2, ...; mean 1/p
        if dist == "lognormal":
            mean = self.number(spec["mean"], f"{where}.mean", positive=True)
            sigma = self.number(spec["sigma"], f"{where}.sigma")
            mu = math.log(mean) - sigma**2 / 2  # so that the lengths' mean is `mean`
            return lambda rng, n: _at_least_one(rng.lognormal(mu, sigma, n))
        return self._choice(spec, where)

    def _choice(self, spec: Mapping[str, Any], where: str) -> Sampler:
        """``{dist: choice, values, weights}``: token counts drawn from ``values``, uniformly or by
        ``weights``."""
        values = spec["values"]
        if not isinstance(values, list) or not values:
            self.fail(f"{where}.values", f"{values!r} is not a non-empty list", "token counts")
        values = np.array([self.integer(v, f"{where}.values[{i}]") for i, v in enumerate(values)])
        weights = spec.get("weights")
        if weights is None:
            p = None
        else:
            if not isinstance(weights, list) or len(weights) != len(values):
                self.fail(f"{where}.weights", f"{weights!r} does not match values",
                          f"a list of {len(values)} weights")
            p = np.array([self.number(w, f"{where}.weights[{i}]") for i, w in enumerate(weights)])
            if p.sum() <= 0:
                self.fail(f"{where}.weights", "all weights are 0", "at least one positive weight")
            p = p / p.sum()
        return lambda rng, n: rng.choice(values, size=n, p=p)


def _at_least_one(samples: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(samples)).astype(np.int64)
