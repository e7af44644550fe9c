"""The workloads shipped in ``engine/workloads/data`` and loading any workload by name or path.

`resolve_trace` turns a shipped name (``splitwise_conv``, ``splitwise_code.csv``,
``paper_sec41``) or a path into a file; `load_workload` reads it as a trace or, for
``.yaml``/``.yml``, as a synthetic workload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tidegate.engine.workloads.arrivals import Arrival, WorkloadError
from tidegate.engine.workloads.synthetic import load_synthetic
from tidegate.engine.workloads.traces import read_trace

__all__ = ["DATA_DIR", "load_workload", "resolve_trace"]

#: the folder of the shipped traces and synthetic workloads (see its README.md)
DATA_DIR = Path(__file__).parent / "data"
_SHIPPED_SUFFIXES = (".csv", ".jsonl", ".yaml", ".yml")


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
    """Shipped workload name (the file's stem) -> file."""
    return {p.stem: p for p in sorted(DATA_DIR.iterdir()) if p.suffix in _SHIPPED_SUFFIXES}


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
