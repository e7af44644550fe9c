"""Workloads: real request traces and synthetic arrivals, turned into one list of `Arrival`s.

Trace formats are recognised by their first line, not their extension:

- Vidur/Splitwise CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (seconds),
- Azure 2023 CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (``2023-11-16 18:15:46.6805900``),
- BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (seconds; rows with 0 response tokens are failed requests and are skipped),
- Mooncake JSONL, one ``{"timestamp": ms, "input_length": n, "output_length": n, ...}`` a line.

Synthetic workloads are YAML files (or mappings) of request classes, each an arrival stream
(Poisson, gamma with a given burstiness, or deterministic) with prompt and output length
distributions; see `load_synthetic`.

Nothing downstream knows which file a workload came from: every reader returns arrivals sorted
by time, with ``output_tokens <= max_tokens``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import yaml

DEFAULT_MAX_TOKENS = 2048
DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload, before the engine turns it into a `Request`.

    :param arrival_time_s: seconds from the workload's start (traces start at 0; a synthetic
        workload's first request arrives at its own, random time).
    :param prompt_tokens: prompt length in tokens (>= 1).
    :param output_tokens: the output length the request really produced (>= 1), already capped
        at ``max_tokens``.
    :param max_tokens: the request's ``max_tokens`` (>= ``output_tokens``).
    :param class_id: workload class: the class's index in a synthetic workload, 0 for traces.
    """

    arrival_time_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    class_id: int = 0

    def __post_init__(self) -> None:
        if not (self.arrival_time_s >= 0 and self.prompt_tokens >= 1
                and 1 <= self.output_tokens <= self.max_tokens):
            raise ValueError(f"invalid arrival {self}: expected arrival_time_s >= 0, "
                             f"prompt_tokens >= 1 and 1 <= output_tokens <= max_tokens")


class WorkloadError(ValueError):
    """A workload file or option the user got wrong; the message is one line naming it."""


# ---------------------------------------------------------------------------------------------
# Traces

# format name -> (header shown to users, time column, prompt column, output column)
_CSV_FORMATS = {
    "vidur": ("arrived_at,num_prefill_tokens,num_decode_tokens",
              "arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "azure": ("TIMESTAMP,ContextTokens,GeneratedTokens",
              "TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                 "Timestamp", "Request tokens", "Response tokens"),
}
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_ACCEPTED = ("expected one of the headers "
             + ", ".join(f"'{fmt[0]}'" for fmt in _CSV_FORMATS.values())
             + " or Mooncake JSON lines with timestamp, input_length and output_length")

Row = tuple[float, int, int]  # (time on the trace's own clock in seconds, prompt, output)


def read_trace(
    path: str | Path,
    *,
    rate_scale: float = 1.0,
    first_n: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    length_scale: float = 1.0,
    max_tokens_cap: int | None = None,
) -> list[Arrival]:
    """Read a request trace in any of the four supported formats.

    Steps, in order: sort by time (stable); keep requests with ``start_s <= t < end_s``, where
    ``t`` is the trace's own clock in seconds (the ``arrived_at``/``Timestamp`` column, Mooncake
    ``timestamp / 1000``, or seconds since the earliest Azure ``TIMESTAMP``); keep the first
    ``first_n``; re-base times so the first kept request arrives at 0; divide times by
    ``rate_scale``; scale lengths; cap outputs at ``max_tokens``.

    :param path: the trace file.
    :param rate_scale: replay at this many times the recorded speed (> 0).
    :param first_n: keep only the first N requests (after the time window).
    :param start_s: drop requests before this trace time, in seconds.
    :param end_s: drop requests at or after this trace time, in seconds.
    :param length_scale: multiply prompt and output lengths by this (rounded, at least 1), so a
        trace fits a small model.
    :param max_tokens_cap: every request's ``max_tokens`` (default `DEFAULT_MAX_TOKENS`); longer
        recorded outputs are cut to it.
    :return: arrivals sorted by time, class 0.
    """
    _check_options(rate_scale, length_scale, max_tokens_cap)
    if first_n is not None and first_n < 1:
        raise WorkloadError(f"first_n must be at least 1, got {first_n}")
    if start_s is not None and end_s is not None and end_s <= start_s:
        raise WorkloadError(f"end_s ({end_s}) must be after start_s ({start_s})")
    source = str(path)
    rows = _read_rows(Path(path), source)
    rows.sort(key=lambda row: row[0])
    if start_s is not None or end_s is not None:
        lo = -math.inf if start_s is None else start_s
        hi = math.inf if end_s is None else end_s
        rows = [row for row in rows if lo <= row[0] < hi]
        if not rows:
            raise WorkloadError(
                f"{source}: no requests between start_s={start_s} and end_s={end_s}")
    if first_n is not None:
        rows = rows[:first_n]
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens_cap is None else max_tokens_cap
    t0 = rows[0][0]
    return [
        Arrival((t - t0) / rate_scale, _scale(p, length_scale),
                min(_scale(o, length_scale), max_tokens), max_tokens)
        for t, p, o in rows
    ]


def _read_rows(path: Path, source: str) -> list[Row]:
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            first = f.readline()
            if not first.strip():
                raise WorkloadError(f"{source}: the file is empty, {_ACCEPTED}")
            if first.lstrip().startswith("{"):
                rows = _read_mooncake(first, f, source)
            else:
                rows = _read_csv(first, f, source)
    except FileNotFoundError:
        raise WorkloadError(f"{source}: no such file") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{source}: not a UTF-8 text file, {_ACCEPTED}") from None
    except OSError as e:
        raise WorkloadError(f"{source}: cannot read the file ({e.strerror})") from None
    if not rows:
        raise WorkloadError(f"{source}: no requests in the file, expected at least one row")
    return rows


def _read_csv(first_line: str, f: Iterable[str], source: str) -> list[Row]:
    header = [name.strip() for name in next(csv.reader([first_line]))]
    for fmt, (_, time_col, prompt_col, output_col) in _CSV_FORMATS.items():
        if {time_col, prompt_col, output_col} <= set(header):
            break
    else:
        raise WorkloadError(f"{source}:1: unknown header '{first_line.strip()}', {_ACCEPTED}")
    columns = (time_col, prompt_col, output_col)
    ti, pi, oi = (header.index(name) for name in columns)
    width = max(ti, pi, oi) + 1
    skip_failed = fmt == "burstgpt"  # BurstGPT logs failed requests with 0 response tokens
    to_seconds = _azure_seconds if fmt == "azure" else float
    rows: list[Row] = []
    reader = csv.reader(f)
    for fields in reader:
        if not fields:
            continue
        try:
            t, p, o = to_seconds(fields[ti]), int(fields[pi]), int(fields[oi])
            ok = t >= 0 and p >= 1 and o >= 1 and t < math.inf
        except (ValueError, IndexError):
            ok = False
        if not ok:
            if skip_failed and len(fields) >= width and fields[oi].strip() == "0":
                continue
            t, p, o = _diagnose(fields, (ti, pi, oi), columns, to_seconds, source,
                                reader.line_num + 1)
        rows.append((t, p, o))
    if fmt == "azure" and rows:
        t0 = min(row[0] for row in rows)
        rows = [(t - t0, p, o) for t, p, o in rows]
    return rows


def _diagnose(fields: list[str], indices: tuple[int, int, int], columns: tuple[str, str, str],
              to_seconds: Callable[[str], float], source: str, line: int) -> Row:
    """Parse one row field by field, raising a `WorkloadError` for the first bad one."""
    values = []
    for index, column in zip(indices, columns):
        where = f"{source}:{line}"
        if index >= len(fields):
            raise WorkloadError(f"{where}: column '{column}' is missing, expected "
                                f"{max(indices) + 1} or more comma-separated fields")
        values.append(_field(fields[index], column, column == columns[0], to_seconds, where))
    return values[0], values[1], values[2]


def _field(text: str, column: str, is_time: bool, to_seconds: Callable[[str], float],
           where: str) -> Any:
    """One time or token-count field, or a `WorkloadError` naming it."""
    if is_time:
        try:
            value = to_seconds(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise WorkloadError(f"{where}: {column} is {text.strip()!r}, expected a time of at "
                                f"least 0")
        return value
    try:
        value = float(text)
    except (ValueError, TypeError):
        value = math.nan
    if not (math.isfinite(value) and value == int(value) and value >= 1):
        raise WorkloadError(f"{where}: {column} is {str(text).strip()!r}, expected a token count "
                            f"of at least 1")
    return int(value)


def _azure_seconds(text: str) -> float:
    """``2023-11-16 18:15:46.6805900`` as seconds since the epoch (UTC when no zone is given)."""
    text = text.strip()
    head, dot, tail = text.partition(".")
    if dot:  # Azure writes 7 fractional digits; datetime takes at most 6
        digits = len(tail) - len(tail.lstrip("0123456789"))
        tail = tail[:min(digits, 6)] + tail[digits:]
        text = f"{head}.{tail}"
    stamp = datetime.fromisoformat(text)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _read_mooncake(first_line: str, f: Iterable[str], source: str) -> list[Row]:
    rows: list[Row] = []
    time_key, prompt_key, output_key = _MOONCAKE_KEYS
    for line_no, line in enumerate([first_line, *f], start=1):
        if not line.strip():
            continue
        where = f"{source}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: bad JSON ({e.msg}), expected one JSON object a "
                                f"line") from None
        if not isinstance(record, dict):
            raise WorkloadError(f"{where}: a JSON {type(record).__name__}, expected a JSON "
                                f"object with {', '.join(_MOONCAKE_KEYS)}")
        for key in _MOONCAKE_KEYS:
            if key not in record:
                raise WorkloadError(f"{where}: key '{key}' is missing, expected "
                                    f"{', '.join(_MOONCAKE_KEYS)}")
        t_ms = _json_number(record[time_key])
        if not (math.isfinite(t_ms) and t_ms >= 0):
            raise WorkloadError(f"{where}: {time_key} is {record[time_key]!r}, expected "
                                f"milliseconds of at least 0")
        p = _json_count(record[prompt_key], prompt_key, where)
        o = _json_count(record[output_key], output_key, where)
        rows.append((t_ms / 1000.0, p, o))
    return rows


def _json_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _json_count(value: Any, key: str, where: str) -> int:
    number = _json_number(value)
    if not (math.isfinite(number) and number == int(number) and number >= 1):
        raise WorkloadError(f"{where}: {key} is {value!r}, expected a token count of at least 1")
    return int(number)


def _check_options(rate_scale: float, length_scale: float, max_tokens_cap: int | None) -> None:
    if not (isinstance(rate_scale, (int, float)) and 0 < rate_scale < math.inf):
        raise WorkloadError(f"rate_scale must be a positive number, got {rate_scale!r}")
    if not (isinstance(length_scale, (int, float)) and 0 < length_scale < math.inf):
        raise WorkloadError(f"length_scale must be a positive number, got {length_scale!r}")
    if max_tokens_cap is not None and not (_is_int(max_tokens_cap) and max_tokens_cap >= 1):
        raise WorkloadError(f"max_tokens_cap must be an integer of at least 1, "
                            f"got {max_tokens_cap!r}")


def _scale(tokens: int, length_scale: float) -> int:
    if length_scale == 1.0:
        return tokens
    return max(1, round(tokens * length_scale))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# Synthetic workloads

_PROCESSES = ("poisson", "gamma", "deterministic")
_DISTRIBUTIONS = {  # name -> its keys (required, optional)
    "fixed": (("value",), ()),
    "uniform": (("low", "high"), ()),
    "geometric": (("mean",), ()),
    "lognormal": (("mean", "sigma"), ()),
    "choice": (("values",), ("weights",)),
}
_TOP_KEYS = ("name", "description", "arrival", "duration_s", "seed", "max_tokens", "classes")
_CLASS_KEYS = ("name", "rate_rps", "prompt_tokens", "output_tokens", "max_tokens")

Sampler = Callable[[np.random.Generator, int], np.ndarray]


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

    :param path_or_mapping: a YAML file or an already loaded mapping.
    :param seed: random seed; when None, the file's ``seed``, else 0.
    :param duration_s: length of the workload in seconds; overrides the file's ``duration_s``.
    :param rate_scale: multiply every class's rate by this (> 0), over the same duration.
    :param length_scale: multiply prompt and output lengths by this (rounded, at least 1).
    :param max_tokens_cap: upper bound on every class's ``max_tokens``; outputs are cut to it.
    :return: arrivals sorted by time.
    """
    _check_options(rate_scale, length_scale, max_tokens_cap)
    if isinstance(path_or_mapping, Mapping):
        source, spec = "workload", path_or_mapping
    else:
        source, spec = str(path_or_mapping), _load_yaml(Path(path_or_mapping))
    check = _Checker(source)
    if not isinstance(spec, Mapping):
        check.fail("", f"the top level is a {type(spec).__name__}", "a mapping of workload keys")
    check.keys(spec, "", _TOP_KEYS)

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

    if duration_s is None:
        if "duration_s" not in spec:
            check.fail("duration_s", "missing", "a positive number of seconds (in the file or "
                       "as the duration_s option)")
        duration_s = spec["duration_s"]
    duration_s = check.number(duration_s, "duration_s", positive=True)
    if seed is None:
        seed = check.integer(spec.get("seed", 0), "seed", minimum=0)
    default_max_tokens = check.integer(spec.get("max_tokens", DEFAULT_MAX_TOKENS), "max_tokens")

    classes = spec.get("classes")
    if not isinstance(classes, list) or not classes:
        check.fail("classes", "missing or empty" if not classes else f"{classes!r} is not a list",
                   "a list of request classes")
    streams = []
    for i, cls in enumerate(classes):
        where = f"classes[{i}]"
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
        streams.append((rate_rps * rate_scale,
                        check.lengths(cls["prompt_tokens"], f"{where}.prompt_tokens"),
                        check.lengths(cls["output_tokens"], f"{where}.output_tokens"),
                        max_tokens))

    rng = np.random.default_rng(seed)
    times, prompts, outputs, max_tokens_all, class_ids = [], [], [], [], []
    for class_id, (rate_rps, prompt_sampler, output_sampler, max_tokens) in enumerate(streams):
        t = _arrival_times(rng, process, rate_rps, burstiness, duration_s)
        n = len(t)
        times.append(t)
        prompts.append(_scale_array(prompt_sampler(rng, n), length_scale))
        outputs.append(np.minimum(_scale_array(output_sampler(rng, n), length_scale), max_tokens))
        max_tokens_all.append(np.full(n, max_tokens))
        class_ids.append(np.full(n, class_id))
    t = np.concatenate(times)
    order = np.argsort(t, kind="stable")
    columns = [t[order].tolist()] + [np.concatenate(c)[order].tolist()
                                     for c in (prompts, outputs, max_tokens_all, class_ids)]
    return [Arrival(*row) for row in zip(*columns)]


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


def _scale_array(tokens: np.ndarray, length_scale: float) -> np.ndarray:
    if length_scale == 1.0:
        return tokens
    return np.maximum(1, np.rint(tokens * length_scale)).astype(np.int64)


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
            self.fail(where, f"{value!r} is not allowed",
                      "a positive number" if positive else "a number of at least 0")
        return float(value)

    def integer(self, value: Any, where: str, *, minimum: int = 1) -> int:
        if not _is_int(value) or value < minimum:
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


# ---------------------------------------------------------------------------------------------
# Any workload

def resolve_trace(name_or_path: str | Path) -> Path:
    """The file behind a shipped workload name, or the path itself.

    A bare name such as ``splitwise_conv`` or ``splitwise_code.csv`` (no directory part) names
    a file shipped in ``engine/workloads/data``; write ``./splitwise_conv.csv`` for a local file of the
    same name.

    :param name_or_path: a shipped name, with or without its extension, or a path.
    :return: the file to read.
    """
    text = str(name_or_path)
    shipped = _shipped()
    if Path(text).name == text:
        name = Path(text).stem
        if text in shipped:
            return shipped[text]
        if name in shipped and shipped[name].name == text:
            return shipped[name]
    path = Path(text)
    if path.exists():
        return path
    raise WorkloadError(f"{text}: no such file or shipped workload, expected a path or one of "
                        f"{', '.join(sorted(shipped))}")


def _shipped() -> dict[str, Path]:
    return {p.stem: p for p in sorted(DATA_DIR.iterdir())
            if p.suffix in (".csv", ".jsonl", ".yaml", ".yml")}


def load_workload(path: str | Path, *, seed: int | None = None, **options: Any) -> list[Arrival]:
    """Load a trace or a synthetic workload; ``.yaml``/``.yml`` files are synthetic.

    :param path: a file, or the name of a shipped workload (see `resolve_trace`).
    :param seed: random seed for synthetic workloads (see `load_synthetic`); unused by traces.
    :param options: passed on to `load_synthetic` or `read_trace`.
    :return: arrivals sorted by time.
    """
    resolved = resolve_trace(path)
    if resolved.suffix in (".yaml", ".yml"):
        return load_synthetic(resolved, seed=seed, **options)
    return read_trace(resolved, **options)


def trace_stats(arrivals: list[Arrival]) -> dict[str, float]:
    """Summary numbers of a workload, including the lifetime-KV figures of the fluid bound.

    ``mean_tokens_per_request`` is S = E[P] + E[D] and ``lifetime_kv_workload`` is
    W = E[P·D] + E[D(D+1)]/2 (token-steps of KV a request holds over its life), with P the
    prompt and D the output length.

    :param arrivals: a non-empty workload.
    :return: requests, span_s, mean_rate_rps, prompt and output mean and max, S and W.
    """
    if not arrivals:
        raise ValueError("trace_stats needs at least one arrival")
    t = np.array([a.arrival_time_s for a in arrivals])
    p = np.array([a.prompt_tokens for a in arrivals], dtype=np.float64)
    d = np.array([a.output_tokens for a in arrivals], dtype=np.float64)
    span_s = float(t.max() - t.min())
    return {
        "requests": len(arrivals),
        "span_s": span_s,
        "mean_rate_rps": len(arrivals) / span_s if span_s > 0 else 0.0,
        "prompt_tokens_mean": float(p.mean()),
        "prompt_tokens_max": int(p.max()),
        "output_tokens_mean": float(d.mean()),
        "output_tokens_max": int(d.max()),
        "mean_tokens_per_request": float(p.mean() + d.mean()),
        "lifetime_kv_workload": float((p * d).mean() + (d * (d + 1)).mean() / 2),
    }
