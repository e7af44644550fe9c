"""Rows of an earlier run taken into this one (``--reuse``), so a change to one arm is measured without
running the others again.

Only a run with the same arrivals is comparable: the same model and its seed, the same seeded Poisson
arrivals (seed, duration, prompt and output lengths), the same SLOs, server arguments, KV space and probe.
The capacity the earlier run measured (or was given) is this run's too, so every load offers the same rate.
"""

from __future__ import annotations

import json
from pathlib import Path

#: the settings two runs must share for their rows to be compared
SAME = ("model", "model_seed", "seed", "prompt_tokens", "max_tokens", "duration_s", "drain_s", "ttft_slo_s",
        "tpot_slo_s", "vllm_args", "kv_cache_gib", "probe_period_s", "load_processes")


class ReuseError(ValueError):
    """The earlier run cannot be read or was not the same experiment; the message is one sentence."""


def load_result(path: Path) -> dict:
    """The ``vllm_overload.json`` at ``path`` (or in the folder ``path``)."""
    file = path / "vllm_overload.json" if path.is_dir() else path
    try:
        result = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ReuseError(f"--reuse {path}: cannot read {file} ({exc}).") from None
    if not (isinstance(result, dict) and isinstance(result.get("rows"), list)
            and isinstance(result.get("settings"), dict)):
        raise ReuseError(f"--reuse {path}: {file} is not a vllm_overload.json (no rows and settings).")
    return result


def reused_rows(result: dict, settings: dict, running: set[str], loads: tuple[float, ...],
                source: str) -> tuple[dict[str, list[dict]], dict]:
    """The earlier run's rows of the arms not in ``running``, at ``loads``, each marked ``reused_from`` =
    ``source``; and its capacity.

    :param settings: this run's settings (``vars(args)``, paths as strings).
    :raises ReuseError: a setting in ``SAME`` differs, the earlier run has no capacity, or it has no row
        this run does not measure again.
    """
    before = result["settings"]
    for key in SAME:
        if before.get(key) != settings.get(key):
            raise ReuseError(f"--reuse {source}: the earlier run had {key} = {before.get(key)!r} and this one "
                             f"{settings.get(key)!r}; only runs of the same arrivals, model and servers compare.")
    capacity = result.get("capacity") or {}
    if not capacity.get("capacity_rps"):
        raise ReuseError(f"--reuse {source}: the earlier run has no capacity, so its loads are not known.")
    rows: dict[str, list[dict]] = {}
    for row in result["rows"]:
        if row.get("arm") in running or row.get("load") not in loads or "goodput_rps" not in row:
            continue
        rows.setdefault(row["arm"], []).append({**row, "reused_from": source})
    if not rows:
        raise ReuseError(f"--reuse {source}: it has no measured row of an arm this run does not run at "
                         f"{', '.join(f'{x:g}x' for x in loads)}.")
    return rows, {**capacity, "reused_from": source}
