"""Request traces: one reader per recorded format, all returning the same `Arrival`s.

Formats are recognised by their first line, not their extension:

- Vidur/Splitwise CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (seconds),
- Azure 2023 CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (``2023-11-16 18:15:46.6805900``),
- BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (seconds; rows with 0 response tokens are failed requests and are skipped),
- Mooncake JSONL, one ``{"timestamp": ms, "input_length": n, "output_length": n, ...}`` a line,
  with the prompt's content as ``hash_ids`` (one id per 512 tokens) when it has them.

`read_trace` is the entry point; it detects the format (`_read_rows`), reads rows of
(trace time in seconds, prompt, output), then windows, re-bases, rescales and caps them.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tidegate.engine.workloads.arrivals import DEFAULT_MAX_TOKENS, Arrival, WorkloadError, check_options, scale_tokens

__all__ = ["read_trace", "write_trace"]

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
#: prompt tokens per Mooncake ``hash_ids`` entry (the trace release's block size)
MOONCAKE_BLOCK_TOKENS = 512
_ACCEPTED = ("expected one of the headers "
             + ", ".join(f"'{fmt[0]}'" for fmt in _CSV_FORMATS.values())
             + " or Mooncake JSON lines with timestamp, input_length and output_length")

# (time on the trace's own clock in seconds, prompt, output, the prompt's content ids or ())
Row = tuple[float, int, int, tuple[int, ...]]


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
    :return: arrivals sorted by time, class 0; a Mooncake trace's ``hash_ids`` become their
        ``prefix_ids`` (scaled with the lengths).
    """
    check_options(rate_scale, length_scale, max_tokens_cap)
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
    per_id = MOONCAKE_BLOCK_TOKENS * length_scale
    return [
        Arrival((t - t0) / rate_scale, scale_tokens(p, length_scale),
                min(scale_tokens(o, length_scale), max_tokens), max_tokens, 0, ids, per_id if ids else 0.0)
        for t, p, o, ids in rows
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


def _csv_format(header: list[str], first_line: str, source: str) -> str:
    """The first format in `_CSV_FORMATS` whose three columns the header has."""
    for fmt, (_, time_col, prompt_col, output_col) in _CSV_FORMATS.items():
        if {time_col, prompt_col, output_col} <= set(header):
            return fmt
    hint = " (a synthetic workload YAML goes to --workload)" if first_line.lstrip().startswith("#") else ""
    raise WorkloadError(f"{source}:1: unknown header '{first_line.strip()}', {_ACCEPTED}{hint}")


def _read_csv(first_line: str, f: Iterable[str], source: str) -> list[Row]:
    header = [name.strip() for name in next(csv.reader([first_line]))]
    fmt = _csv_format(header, first_line, source)
    _, time_col, prompt_col, output_col = _CSV_FORMATS[fmt]
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
        rows.append((t, p, o, ()))
    if fmt == "azure" and rows:
        t0 = min(row[0] for row in rows)
        rows = [(t - t0, p, o, ids) for t, p, o, ids in rows]
    return rows


def _diagnose(fields: list[str], indices: tuple[int, int, int], columns: tuple[str, str, str],
              to_seconds: Callable[[str], float], source: str, line: int) -> tuple[float, int, int]:
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
        rows.append((t_ms / 1000.0, p, o, _hash_ids(record.get("hash_ids"), where)))
    return rows


def _hash_ids(value: Any, where: str) -> tuple[int, ...]:
    """A Mooncake record's ``hash_ids``: a list of integers, or absent."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise WorkloadError(f"{where}: hash_ids is {str(value)[:40]!r}, expected a list of integers")
    return tuple(value)


def _json_number(value: Any) -> float:
    """A JSON number as a float (NaN for anything else; infinity for an integer past a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _json_count(value: Any, key: str, where: str) -> int:
    number = _json_number(value)
    if not (math.isfinite(number) and number == int(number) and number >= 1):
        raise WorkloadError(f"{where}: {key} is {value!r}, expected a token count of at least 1")
    return int(number)


def write_trace(arrivals: Iterable[Arrival], path: str | Path) -> Path:
    """Write arrivals as a Vidur/Splitwise CSV (``arrived_at,num_prefill_tokens,num_decode_tokens``),
    which `read_trace` reads back to the same times and lengths. A prompt's content ids (Mooncake
    ``hash_ids``) and classes are not kept.

    :return: the path written
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(_CSV_FORMATS["vidur"][0] + "\n")
        for a in arrivals:
            f.write(f"{float(a.arrival_time_s)!r},{int(a.prompt_tokens)},{int(a.output_tokens)}\n")
    return path
