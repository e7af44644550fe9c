"""Workload families: ranges of traffic from which each episode draws one concrete workload.

A family is a YAML file in this folder (`FAMILIES_DIR`), a YAML file elsewhere, or the same
mapping in memory; `load_family` reads one and `shipped_families` reads them all. Each episode,
`Family.sample` first draws the family's parameters -- a number is fixed, a range ``[lo, hi]`` is
drawn log-uniformly (``windows`` uniformly among the integers lo..hi) -- then the requests.

A synthetic family::

    name: chat                       # optional in a file (default: the file's stem)
    description: one line
    max_tokens: 2048                 # optional; outputs are cut to it (default DEFAULT_MAX_TOKENS)
    max_prompt_tokens: 32768         # optional; prompts are cut to it
    arrival: {process: poisson}      # optional, this is the default
    classes:                         # each request picks a class with probability weight / sum
      - name: chat                   # optional, default class<index>; unique
        weight: 1                    # optional, default 1
        prompt: {mean: [200, 3000], sigma: [0.5, 1.2]}
        output: {mean: [100, 1000], sigma: [0.5, 1.0]}

Lengths are lognormal with that ``mean`` (of the lengths, in tokens) and ``sigma`` (of the
underlying normal; 0 gives fixed lengths), rounded to integers of at least 1. The arrival
processes, all with long-run mean rate ``rate_rps`` and time measured in mean inter-arrival times
where a parameter counts requests:

- ``{process: poisson}``;
- ``{process: gamma, cv: [0.5, 8]}``: gamma inter-arrival times with that coefficient of
  variation (1 is Poisson, above 1 bursty);
- ``{process: diurnal, period_requests: [200, 2000], amplitude: [0.3, 0.9]}``: Poisson at rate
  ``rate_rps * (1 + amplitude * sin(2 pi t / period + phase))``, the period lasting
  ``period_requests`` mean inter-arrival times, the phase uniform per episode; amplitude in [0, 1];
- ``{process: flash_crowd, peak: [3, 10], crowd_fraction: [0.05, 0.2], windows: [1, 3]}``:
  Poisson with ``windows`` (default 1) non-overlapping windows at random places, together
  ``crowd_fraction`` of the episode's expected span, where the rate is ``peak`` times the
  background's; the background is lowered so the mean rate stays ``rate_rps``.

A trace family replays a window of a recorded trace instead (``arrival`` and ``classes`` are then
not allowed)::

    name: conv-trace
    trace: splitwise_conv            # a shipped trace (engine.workloads.registry) or a path

It takes ``n_requests`` consecutive requests from a uniformly drawn start (wrapping around to the
trace's start), rescaling the recorded times so the mean rate of the window is ``rate_rps``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidegate.engine.core.profile import Profile
from tidegate.engine.workloads.arrivals import DEFAULT_MAX_TOKENS, Arrival, WorkloadError, is_int
from tidegate.engine.workloads.registry import resolve_trace
from tidegate.engine.workloads.splits import Segment, _segment
from tidegate.engine.workloads.synthetic import _at_least_one, _Checker, _load_yaml
from tidegate.engine.workloads.traces import read_trace

__all__ = ["DEFAULT_MAX_PROMPT_TOKENS", "FAMILIES_DIR", "ArrivalProcess", "Family", "Lengths", "RequestClass",
           "family_segment", "load_family", "perturbed_profile", "shipped_families"]

#: the folder of the shipped families
FAMILIES_DIR = Path(__file__).parent
#: every family's prompt cap unless it sets ``max_prompt_tokens``
DEFAULT_MAX_PROMPT_TOKENS = 32768

Range = tuple[float, float]  # (lo, hi); lo == hi for a fixed value

_TOP_KEYS = ("name", "description", "max_tokens", "max_prompt_tokens", "arrival", "classes", "trace")
_CLASS_KEYS = ("name", "weight", "prompt", "output")
_LENGTH_KEYS = ("mean", "sigma")
_PROCESS_KEYS = {  # process -> its parameters, in the order they are drawn
    "poisson": (),
    "gamma": ("cv",),
    "diurnal": ("period_requests", "amplitude"),
    "flash_crowd": ("peak", "crowd_fraction", "windows"),
}
_OPTIONAL: dict[str, Range] = {"windows": (1.0, 1.0), "weight": (1.0, 1.0)}
_BOUNDS: dict[str, tuple[Callable[[float], bool], str]] = {  # parameter -> (test, what a value must be)
    "mean": (lambda v: v > 0, "a positive number of tokens"),
    "sigma": (lambda v: v >= 0, "a number of at least 0"),
    "weight": (lambda v: v > 0, "a positive number"),
    "cv": (lambda v: v > 0, "a positive coefficient of variation"),
    "period_requests": (lambda v: v >= 1, "a number of requests of at least 1"),
    "amplitude": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "peak": (lambda v: v >= 1, "a rate multiplier of at least 1"),
    "crowd_fraction": (lambda v: 0 < v < 1, "a fraction strictly between 0 and 1"),
    "windows": (lambda v: v >= 1 and v == int(v), "a whole number of at least 1"),
}
_GRID_PER_PERIOD = 64  # points per diurnal period of the tabulated cumulative intensity


@dataclass(frozen=True)
class Lengths:
    """Lognormal token counts: ``mean`` of the lengths and ``sigma`` of the underlying normal."""

    mean: Range
    sigma: Range


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a synthetic family; ``weight`` sets how often it is picked."""

    name: str
    weight: Range
    prompt: Lengths
    output: Lengths


@dataclass(frozen=True)
class ArrivalProcess:
    """An arrival process (a key of ``_PROCESS_KEYS``) and the ranges of its parameters."""

    process: str
    params: dict[str, Range] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """A family of workloads: synthetic (``arrival`` and ``classes``) or a trace (``trace``).

    :param name: the family's name, e.g. ``chat``.
    :param description: one line saying what traffic this stands for.
    :param path: the file it was read from; None for a mapping.
    :param max_tokens: every request's ``max_tokens``; outputs are cut to it.
    :param max_prompt_tokens: prompts are cut to this.
    :param arrival: the arrival process of a synthetic family.
    :param classes: the request classes of a synthetic family.
    :param trace: the trace file of a trace family.
    """

    name: str
    description: str
    path: Path | None
    max_tokens: int
    max_prompt_tokens: int
    arrival: ArrivalProcess | None = None
    classes: tuple[RequestClass, ...] = ()
    trace: Path | None = None

    def sample(self, rng: np.random.Generator, n_requests: int, rate_rps: float = 1.0) -> list[Arrival]:
        """One episode's workload: draw the family's parameters, then ``n_requests`` arrivals.

        :param rng: the only source of randomness; the same state gives the same workload.
        :param n_requests: how many requests (>= 1).
        :param rate_rps: the long-run mean arrival rate in requests per second (> 0).
        :return: arrivals sorted by time, the first at t >= 0; ``class_id`` is the class's index.
        """
        if not (is_int(n_requests) and n_requests >= 1):
            raise ValueError(f"n_requests must be an integer of at least 1, got {n_requests!r}")
        if not (isinstance(rate_rps, (int, float)) and 0 < rate_rps < math.inf):
            raise ValueError(f"rate_rps must be a positive number, got {rate_rps!r}")
        if self.trace is not None:
            times, prompts, outputs = _trace_window(self.trace, self.max_tokens, rng, n_requests, rate_rps)
            class_ids = np.zeros(n_requests, dtype=np.int64)
        else:
            assert self.arrival is not None
            times = _arrival_times(self.arrival, rng, n_requests) / rate_rps
            class_ids, prompts, outputs = _class_lengths(self.classes, rng, n_requests, self.max_prompt_tokens,
                                                         self.max_tokens)
        prompts = np.minimum(prompts, self.max_prompt_tokens)
        outputs = np.minimum(outputs, self.max_tokens)
        return [Arrival(t, p, o, self.max_tokens, c) for t, p, o, c in
                zip(times.tolist(), prompts.tolist(), outputs.tolist(), class_ids.tolist())]

    def describe(self) -> dict[str, Any]:
        """The family's ranges as plain data (a range as ``[lo, hi]``, a fixed value as a number)."""
        head = {"name": self.name, "description": self.description, "max_tokens": self.max_tokens,
                "max_prompt_tokens": self.max_prompt_tokens}
        if self.trace is not None:
            return {**head, "trace": self.trace.stem}
        assert self.arrival is not None
        return {**head,
                "arrival": {"process": self.arrival.process,
                            **{key: _shown(r) for key, r in self.arrival.params.items()}},
                "classes": {c.name: {"weight": _shown(c.weight),
                                     "prompt_mean": _shown(c.prompt.mean), "prompt_sigma": _shown(c.prompt.sigma),
                                     "output_mean": _shown(c.output.mean), "output_sigma": _shown(c.output.sigma)}
                            for c in self.classes}}


def shipped_families() -> dict[str, Family]:
    """Every family shipped in `FAMILIES_DIR`, by name, sorted by name."""
    families = [load_family(path) for path in FAMILIES_DIR.glob("*.yaml")]
    return {f.name: f for f in sorted(families, key=lambda f: f.name)}


def load_family(source: str | Path | Mapping[str, Any]) -> Family:
    """Read a family.

    :param source: a shipped name (``chat``), a path to a YAML file, or the mapping such a file holds.
    :raises WorkloadError: the name is unknown, or the file or mapping is not a valid family.
    """
    if isinstance(source, Mapping):
        name = source.get("name")
        return _parse(source, None, _Checker(f"family {name!r}" if isinstance(name, str) else "family"))
    text = str(source)
    if isinstance(source, str) and Path(text).name == text and not text.endswith((".yaml", ".yml")):
        path = FAMILIES_DIR / f"{text}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in FAMILIES_DIR.glob("*.yaml"))
            raise WorkloadError(f"unknown family {text!r}, expected one of {', '.join(names)} "
                                f"or a path to a .yaml file")
    else:
        path = Path(source)
    return _parse(_load_yaml(path), path, _Checker(str(path)))


def family_segment(family: Family, profile: Profile, rng: np.random.Generator, n_requests: int = 2000) -> Segment:
    """One episode of ``family`` (at 1 request/s) as a `Segment` named after the family, with its
    fluid capacity on ``profile``."""
    return _segment(family.name, family.sample(rng, n_requests), profile)


def perturbed_profile(profile: Profile, rng: np.random.Generator, spread: float = 0.3) -> Profile:
    """A copy of ``profile`` with ``base_s``, ``per_token_s``, ``per_kv_token_s`` and
    ``kv_capacity_tokens`` each times its own factor uniform in ``[1 - spread, 1 + spread]``
    (the capacity rounded, at least one block; a separate decode cost moves with ``per_token_s``),
    named ``<name>~p``.

    :param spread: in [0, 1).
    """
    if not (isinstance(spread, (int, float)) and 0 <= spread < 1):
        raise ValueError(f"spread must be a number in [0, 1), got {spread!r}")
    base, per_token, per_kv, kv = rng.uniform(1 - spread, 1 + spread, 4)
    return dataclasses.replace(
        profile, name=f"{profile.name}~p", base_s=profile.base_s * base, per_token_s=profile.per_token_s * per_token,
        per_kv_token_s=profile.per_kv_token_s * per_kv,
        per_decode_token_s=None if profile.per_decode_token_s is None else profile.per_decode_token_s * per_token,
        kv_capacity_tokens=max(profile.block_size, round(profile.kv_capacity_tokens * kv)))


# ---------------------------------------------------------------------------------------------
# Reading

def _parse(spec: Any, path: Path | None, check: _Checker) -> Family:
    """A family from its parsed YAML; ``path`` is the file it came from, if any."""
    if not isinstance(spec, Mapping):
        check.fail("", f"the top level is a {type(spec).__name__}", "a mapping of family keys")
    check.keys(spec, "", _TOP_KEYS)
    name = spec.get("name", None if path is None else path.stem)
    if not isinstance(name, str) or not name.strip():
        check.fail("name", "missing" if name is None else f"{name!r} is not allowed", "a non-empty string")
    description = spec.get("description", "")
    if not isinstance(description, str):
        check.fail("description", f"{description!r} is not a string", "one line of text")
    common: dict[str, Any] = {
        "name": name, "description": description, "path": path,
        "max_tokens": check.integer(spec.get("max_tokens", DEFAULT_MAX_TOKENS), "max_tokens"),
        "max_prompt_tokens": check.integer(spec.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS),
                                           "max_prompt_tokens"),
    }
    if "trace" in spec:
        for key in ("arrival", "classes"):
            if key in spec:
                check.fail(key, "given together with trace", "either trace or arrival and classes")
        return Family(**common, trace=_trace_file(spec["trace"], path, check))
    return Family(**common, arrival=_arrival(spec.get("arrival", {"process": "poisson"}), check),
                  classes=_classes(spec.get("classes"), check))


def _trace_file(raw: Any, path: Path | None, check: _Checker) -> Path:
    """The trace behind ``trace``: a shipped name, or a path (relative to the family's file)."""
    if not isinstance(raw, str) or not raw:
        check.fail("trace", f"{raw!r} is not a name", "a shipped trace name or a path to a trace file")
    relative = path is not None and Path(raw).name != raw and not Path(raw).is_absolute()
    try:
        trace = resolve_trace(path.parent / raw if relative and path is not None else raw)
    except WorkloadError:
        check.fail("trace", f"{raw!r} is neither a shipped trace nor a file",
                   "a shipped trace such as splitwise_conv or a path to a trace file")
    if trace.suffix in (".yaml", ".yml"):
        check.fail("trace", f"{raw!r} is a synthetic workload", "a recorded trace (.csv or .jsonl)")
    return trace


def _arrival(raw: Any, check: _Checker) -> ArrivalProcess:
    if not isinstance(raw, Mapping):
        check.fail("arrival", f"{raw!r} is not a mapping", f"{{process: {' | '.join(_PROCESS_KEYS)}, ...}}")
    process = raw.get("process")
    if process not in _PROCESS_KEYS:
        check.fail("arrival.process", f"unknown process {process!r}", f"one of {', '.join(_PROCESS_KEYS)}")
    keys = _PROCESS_KEYS[process]
    check.keys(raw, "arrival", ("process", *keys))
    params = {}
    for key in keys:
        if key in raw:
            params[key] = _range(raw[key], f"arrival.{key}", key, check)
        elif key in _OPTIONAL:
            params[key] = _OPTIONAL[key]
        else:
            check.fail(f"arrival.{key}", "missing", f"{', '.join(keys)} for process: {process}")
    return ArrivalProcess(process, params)


def _classes(raw: Any, check: _Checker) -> tuple[RequestClass, ...]:
    if not isinstance(raw, list) or not raw:
        check.fail("classes", "missing" if raw is None else f"{raw!r} is not a non-empty list",
                   "a list of request classes (or a trace)")
    classes = tuple(_request_class(cls, i, check) for i, cls in enumerate(raw))
    names = [c.name for c in classes]
    for i, name in enumerate(names):
        if name in names[:i]:
            check.fail(f"classes[{i}].name", f"{name!r} is used twice", "a unique name per class")
    return classes


def _request_class(cls: Any, index: int, check: _Checker) -> RequestClass:
    where = f"classes[{index}]"
    if not isinstance(cls, Mapping):
        check.fail(where, f"{cls!r} is not a mapping", "a class with prompt and output")
    check.keys(cls, where, _CLASS_KEYS)
    name = cls.get("name", f"class{index}")
    if not isinstance(name, str) or not name:
        check.fail(f"{where}.name", f"{name!r} is not allowed", "a non-empty string")
    weight = _range(cls["weight"], f"{where}.weight", "weight", check) if "weight" in cls else _OPTIONAL["weight"]
    return RequestClass(name, weight, _lengths(cls, f"{where}.prompt", "prompt", check),
                        _lengths(cls, f"{where}.output", "output", check))


def _lengths(cls: Mapping[str, Any], where: str, key: str, check: _Checker) -> Lengths:
    raw = cls.get(key)
    if not isinstance(raw, Mapping):
        check.fail(where, "missing" if raw is None else f"{raw!r} is not a mapping", "{mean: ..., sigma: ...}")
    check.keys(raw, where, _LENGTH_KEYS)
    for part in _LENGTH_KEYS:
        if part not in raw:
            check.fail(f"{where}.{part}", "missing", "mean and sigma of the lengths")
    return Lengths(_range(raw["mean"], f"{where}.mean", "mean", check),
                   _range(raw["sigma"], f"{where}.sigma", "sigma", check))


def _range(raw: Any, where: str, key: str, check: _Checker) -> Range:
    """A parameter's number, or its ``[lo, hi]`` with positive ends (drawn log-uniformly)."""
    if not isinstance(raw, list):
        value = _value(raw, where, key, check)
        return value, value
    if len(raw) != 2:
        check.fail(where, f"{raw!r} is not a pair", "a number or a range [lo, hi]")
    lo, hi = (_value(v, where, key, check) for v in raw)
    if lo > hi:
        check.fail(where, f"{raw!r} has lo above hi", "a range [lo, hi] with lo <= hi")
    if lo <= 0:
        check.fail(where, f"{raw!r} starts at {lo:g}", "a range of positive numbers (drawn log-uniformly)")
    return lo, hi


def _value(raw: Any, where: str, key: str, check: _Checker) -> float:
    test, expected = _BOUNDS[key]
    if not (isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw) and test(raw)):
        check.fail(where, f"{raw!r} is not allowed", expected)
    return float(raw)


def _shown(r: Range) -> float | list[float]:
    lo, hi = (int(v) if v.is_integer() else v for v in r)
    return lo if lo == hi else [lo, hi]


# ---------------------------------------------------------------------------------------------
# Sampling

def _drawn(rng: np.random.Generator, r: Range, *, integer: bool = False) -> float:
    """A range's value this episode: log-uniform, or uniform among the integers when ``integer``."""
    lo, hi = r
    if integer:
        return float(rng.integers(int(lo), int(hi) + 1))
    return lo if lo == hi else float(np.exp(rng.uniform(math.log(lo), math.log(hi))))


def _arrival_times(arrival: ArrivalProcess, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` sorted arrival times at a long-run mean rate of 1 (in mean inter-arrival times)."""
    p = {key: _drawn(rng, r, integer=key == "windows") for key, r in arrival.params.items()}
    if arrival.process == "gamma":
        shape = 1.0 / p["cv"] ** 2  # gamma with cv 1 is the exponential, i.e. Poisson arrivals
        return np.cumsum(rng.gamma(shape, 1.0 / shape, n))
    # Unit-rate Poisson points are the cumulative intensity at each arrival; invert it for the times.
    unit = np.cumsum(rng.exponential(1.0, n))
    if arrival.process == "diurnal":
        return _diurnal_times(unit, rng, p["period_requests"], p["amplitude"])
    if arrival.process == "flash_crowd":
        return _flash_crowd_times(unit, rng, p["peak"], p["crowd_fraction"], int(p["windows"]))
    return unit


def _diurnal_times(unit: np.ndarray, rng: np.random.Generator, period: float, amplitude: float) -> np.ndarray:
    """Intensity ``1 + A sin(2 pi t / P + phase)``, whose integral over t is tabulated and inverted."""
    phase = rng.uniform(0.0, 2 * math.pi)
    end = float(unit[-1]) + period  # the integral falls at most A P / pi behind t
    t = np.linspace(0.0, end, int(_GRID_PER_PERIOD * end / period) + 2)
    cumulative = t + amplitude * period / (2 * math.pi) * (math.cos(phase) - np.cos(2 * math.pi * t / period + phase))
    return np.interp(unit, cumulative, t)


def _flash_crowd_times(unit: np.ndarray, rng: np.random.Generator, peak: float, fraction: float,
                       windows: int) -> np.ndarray:
    """Piecewise constant intensity: ``windows`` crowds at ``peak`` x the background over ``fraction`` of
    the expected span ``n``, the background ``1 / (1 + fraction (peak - 1))`` so the mean stays 1."""
    n = len(unit)
    background = 1.0 / (1.0 + fraction * (peak - 1.0))
    width = fraction * n / windows
    starts = np.sort(rng.uniform(0.0, n - windows * width, windows)) + width * np.arange(windows)
    tail = n + max(0.0, float(unit[-1]) - n) / background + 1.0  # past the last arrival
    edges = np.concatenate([[0.0], np.column_stack([starts, starts + width]).ravel(), [tail]])
    rates = np.where(np.arange(2 * windows + 1) % 2 == 1, peak * background, background)
    cumulative = np.concatenate([[0.0], np.cumsum(np.diff(edges) * rates)])
    return np.interp(unit, cumulative, edges)


def _class_lengths(classes: tuple[RequestClass, ...], rng: np.random.Generator, n: int, max_prompt_tokens: int,
                   max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class ids, prompt lengths, output lengths) of ``n`` requests, the classes' parameters drawn first."""
    weights = np.array([_drawn(rng, c.weight) for c in classes])
    params = np.array([[_drawn(rng, r) for r in (c.prompt.mean, c.prompt.sigma, c.output.mean, c.output.sigma)]
                       for c in classes])
    if len(classes) == 1:
        class_ids = np.zeros(n, dtype=np.int64)
    else:
        class_ids = rng.choice(len(classes), size=n, p=weights / weights.sum())
    per_request = params[class_ids]
    prompts = _lognormal(rng, per_request[:, 0], per_request[:, 1], max_prompt_tokens)
    outputs = _lognormal(rng, per_request[:, 2], per_request[:, 3], max_tokens)
    return class_ids, prompts, outputs


def _lognormal(rng: np.random.Generator, mean: np.ndarray, sigma: np.ndarray, cap: int) -> np.ndarray:
    """Token counts with these means and sigmas of the underlying normal, in [1, cap]."""
    mu = np.log(mean) - sigma**2 / 2  # so that the lengths' mean is `mean`
    return _at_least_one(np.minimum(rng.lognormal(mu, sigma), cap))


@functools.lru_cache(maxsize=8)
def _trace_columns(path: Path, max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A trace's times, prompts and outputs (cut to ``max_tokens``), read once."""
    arrivals = read_trace(path, max_tokens_cap=max_tokens)
    columns = (np.array([a.arrival_time_s for a in arrivals]), np.array([a.prompt_tokens for a in arrivals]),
               np.array([a.output_tokens for a in arrivals]))
    for column in columns:
        column.setflags(write=False)
    return columns


def _trace_window(path: Path, max_tokens: int, rng: np.random.Generator, n: int,
                  rate_rps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` consecutive requests of the trace from a random start, the times rescaled to ``rate_rps``."""
    t, prompts, outputs = _trace_columns(path, max_tokens)
    total = len(t)
    position = int(rng.integers(total)) + np.arange(n)
    span = float(t[-1] - t[0])
    lap_s = span + span / (total - 1) if total > 1 and span > 0 else 1.0  # one mean gap before the replay
    index = position % total
    times = t[index] + (position // total) * lap_s
    times -= times[0]
    if times[-1] > 0:
        times *= (n - 1) / (rate_rps * times[-1])
    return times, prompts[index], outputs[index]
