"""The plugin's step log (:mod:`tidegate.engine.vllm.step_log`), read for the plugin's own time per step.

Only the CSV is read, by its header, so this needs neither vLLM nor the plugin's module.
"""

from __future__ import annotations

import csv
from itertools import islice
from pathlib import Path

from tidegate.engine.bench.overload.stats import pct


def step_overhead(path: Path, first_row: int, end_row: int | None) -> dict:
    """The plugin's added time in rows ``first_row`` to ``end_row`` of the step log (0 is the first row
    after the header): its share of all steps' time, and per step.

    ``plugin_s`` is the plugin's own work in a step (observing, deciding, logging) and ``real_s`` the
    step's whole duration (``schedule()`` to ``update_from_output()``), so their ratio is the share of
    each step the plugin added. A log without those columns gives ``{"step_log": ..., "missing": [...]}``.
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("real_s", "plugin_s") if c not in (reader.fieldnames or [])]
        if missing:
            return {"step_log": str(path), "missing": missing}
        rows = list(islice(reader, first_row, end_row))
    real = [float(r["real_s"] or 0) for r in rows]
    plugin = [float(r["plugin_s"] or 0) for r in rows]
    decide = [float(r.get("decide_s") or 0) for r in rows]
    shares = [p / t for p, t in zip(plugin, real) if t > 0]
    total = sum(real)
    return {"step_log": str(path), "steps": len(rows),
            "step_p50_ms": _ms(pct(real, 50)), "plugin_p50_ms": _ms(pct(plugin, 50)),
            "plugin_p99_ms": _ms(pct(plugin, 99)), "decide_p99_ms": _ms(pct(decide, 99)),
            "plugin_share": sum(plugin) / total if total > 0 else None,
            "plugin_share_p99": pct(shares, 99),
            "fallback_steps": sum(bool(r.get("fallback")) for r in rows)}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0
