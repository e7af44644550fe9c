"""Small helpers the benchmark scripts share: a table printed and written, a percentile's relative
error, a column of a results CSV, and bad input told in one sentence.

No torch and no engine imports: numpy only, so any script (or a notebook) can take them.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np

__all__ = ["csv_column", "emit", "rel_error", "usage_error"]


def emit(lines: Sequence[str] | str, out: Path | None = None) -> None:
    """Print a table (its lines, or the table as one string), and write it to ``out`` too when
    given, with a final newline."""
    table = lines if isinstance(lines, str) else "\n".join(lines)
    print(table)
    if out:
        out.write_text(table + "\n")


def rel_error(sim: np.ndarray, real: np.ndarray, q: float) -> float:
    """The relative error of the simulated ``q``-th percentile against the real one
    (``sim_q / real_q - 1``; +0.05 is 5% too slow)."""
    return float(np.percentile(sim, q) / np.percentile(real, q) - 1.0)


def csv_column(path: Path, key: str, keep: Callable[[dict[str, str]], bool] | None = None) -> np.ndarray:
    """The values of column ``key`` of the CSV file ``path`` as floats, in file order, leaving out
    empty and ``nan`` cells and, with ``keep``, the rows for which it is false."""
    with open(path) as f:
        return np.array([float(r[key]) for r in csv.DictReader(f)
                         if r[key] not in ("", "nan") and (keep is None or keep(r))])


def usage_error(sentence: str, prog: str = "error") -> NoReturn:
    """Bad input, as the project's commands answer it: ``prog: sentence`` on stderr and exit status 2."""
    print(f"{prog}: {sentence}", file=sys.stderr)
    raise SystemExit(2)
