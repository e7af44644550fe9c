"""The server under overload and under an engine kill, measured from outside it.

``benchmarks/overload.py`` is the command line; the pieces live here, one concept per module:

- ``clients``: streaming completions from asyncio clients (open loop, closed loop, burst) in load processes
- ``probe``: the idle probe process, timing the server's answers with nothing else to do
- ``server``: ``tidegate serve`` as a subprocess, its ``/metrics`` and memory sampler
- ``phases``: part A's capacity run and overload run
- ``recovery``: part B, watching streams end and a new engine come up after the kill
- ``stats`` and ``targets``: the figures of a run and the targets they are held to
- ``report``: ``overload.json``, ``overload.md`` and ``overload.png``
"""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    """One line of progress on stderr, with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
