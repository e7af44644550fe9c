"""How many torch threads the engine process takes: the cores that are free when it starts.

``free_cores`` counts the cores this process may run on, less the share of them other work kept busy over a short
sample (``/proc/stat``). ``engine_threads`` takes them all on a small machine and keeps one for the HTTP side from
four free cores on: the HTTP side's work (admission, 429s, formatting the streams) is light next to a model step,
and the engine runs at a lower priority (``ServeConfig.engine_nice``), so on two cores keeping one idle for it would
halve the engine's speed to save it little (measured on a 2-core VM: 1.46x the output tokens a second with both
cores, docs/BENCHMARKS.md); from four cores on, keeping one costs the engine at most a quarter, and spares it
steps stalled while the HTTP side holds one of its threads' cores, as vLLM's CPU build keeps a core for its own
server process.
"""

from __future__ import annotations

import os
import time

#: from this many free cores on, one is left to the HTTP side
RESERVE_FROM = 4


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(os.cpu_count() or 1))


def _busy_and_total(cpus: set[int]) -> tuple[dict[int, int], dict[int, int]] | None:
    """Per CPU of ``cpus``, its busy and total jiffies so far (``/proc/stat``); None where unreadable."""
    busy, total = {}, {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu" or (cpu := int(name[3:])) not in cpus:
                    continue
                fields = [int(x) for x in rest.split()]
                idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
                total[cpu] = sum(fields[:8])
                busy[cpu] = total[cpu] - idle
    except (OSError, ValueError, IndexError):
        return None
    return busy, total


def free_cores(sample_s: float = 0.3) -> int:
    """The CPUs this process may use, less the share of them busy over the next ``sample_s`` seconds (at
    least 1); all of them where ``/proc/stat`` cannot be read."""
    cpus = allowed_cpus()
    before = _busy_and_total(set(cpus))
    if before is None:
        return len(cpus)
    time.sleep(sample_s)
    after = _busy_and_total(set(cpus))
    if after is None:
        return len(cpus)
    busy = 0.0
    for cpu in before[1]:
        ticks = after[1].get(cpu, 0) - before[1][cpu]
        if ticks > 0:
            busy += (after[0][cpu] - before[0][cpu]) / ticks
    return max(1, round(len(cpus) - busy))


def engine_threads(free: int) -> int:
    """The engine's torch threads on ``free`` free cores: all of them below ``RESERVE_FROM``, else all but one."""
    return max(1, free - 1) if free >= RESERVE_FROM else max(1, free)
