"""The targets a run is held to, and which of them a run missed."""

from __future__ import annotations

#: what a run should show, by the name of the figure (also in the report's header)
TARGETS = {"server_5xx": "= 0", "lost": "= 0 (transport errors + hangs + unaccounted)",
           "probe_429_p99_ms": "<= 50", "health_p99_ms": "<= 50", "kv_usage_max": "<= 1.0",
           "rss_growth_pct": "<= 10", "streams_ended_after_kill_s": "<= 2", "ready_again_after_kill_s": "<= 30"}


def lost(row: dict) -> int:
    """Requests with no answer from the server: transport errors, hangs and planned ones never recorded."""
    return row["transport_errors"] + row["hangs"] + row["unaccounted"]


def overload_misses(row: dict) -> list[str]:
    """The part-A targets this row misses (a figure that was not measured counts as missed, except
    the 429 latency of a controller that refused nothing)."""
    checks = {"server_5xx": row["server_5xx"] == 0, "lost": lost(row) == 0 and not row["load_failures"],
              "probe_429_p99_ms": row["probe_429_p99_ms"] is None or row["probe_429_p99_ms"] <= 50,
              "health_p99_ms": row["health_p99_ms"] is not None and row["health_p99_ms"] <= 50,
              "kv_usage_max": row["kv_usage_max"] is not None and row["kv_usage_max"] <= 1.0,
              "rss_growth_pct": row["rss_growth_pct"] is not None and row["rss_growth_pct"] <= 10}
    return [name for name, ok in checks.items() if not ok]


def kill_misses(out: dict) -> list[str]:
    """The part-B targets this run misses (a figure that was not measured counts as missed)."""
    checks = {"streams_ended_after_kill_s": out["streams_ended_after_kill_s"] is not None
              and out["streams_ended_after_kill_s"] <= 2,
              "ready_again_after_kill_s": out["ready_again_after_kill_s"] is not None
              and out["ready_again_after_kill_s"] <= 30,
              "new_request_completed": bool(out.get("new_request_completed")),
              "all_clients_finished": out["all_clients_finished"]}
    return [name for name, ok in checks.items() if not ok]

