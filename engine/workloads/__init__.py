"""Workloads: real request traces and synthetic arrivals, turned into one list of `Arrival`s.

Map of the package (each module imports only those above it):

- ``arrivals``  -- `Arrival` (one request before the engine sees it), `WorkloadError` (a bad
  workload file or option, one line naming it), `trace_stats`, and the option checks and length
  rescaling the readers share.
- ``traces``    -- `read_trace`: Vidur/Splitwise, Azure 2023 and BurstGPT CSV and Mooncake JSONL,
  recognised by their first line; time window, first N, rate and length scaling, output cap.
- ``synthetic`` -- `load_synthetic`: YAML request classes (Poisson, gamma or deterministic
  arrivals; fixed, uniform, geometric, lognormal or choice lengths).
- ``registry``  -- `DATA_DIR` and the workloads shipped in ``data/``; `resolve_trace` (a shipped
  name or a path to a file) and `load_workload` (any of them, trace or synthetic).
- ``splits``    -- the train/eval split of the traces (`TRAIN_FRACTION`, `split_segments`,
  `Segment`, `augment_segments`) shared by the Gymnasium env and the evaluation.

Nothing downstream knows which file a workload came from: every reader returns arrivals sorted
by time, with ``output_tokens <= max_tokens``. Import from the package
(``from engine.workloads import read_trace``); the modules are the map, not the API.
"""

from tidegate.engine.workloads.arrivals import DEFAULT_MAX_TOKENS, Arrival, WorkloadError, trace_stats
from tidegate.engine.workloads.traces import read_trace
from tidegate.engine.workloads.synthetic import load_synthetic
from tidegate.engine.workloads.registry import DATA_DIR, load_workload, resolve_trace
from tidegate.engine.workloads.splits import TRAIN_FRACTION, Segment, augment_segments, split_segments

__all__ = [
    "DATA_DIR",
    "DEFAULT_MAX_TOKENS",
    "TRAIN_FRACTION",
    "Arrival",
    "Segment",
    "WorkloadError",
    "augment_segments",
    "load_synthetic",
    "load_workload",
    "read_trace",
    "resolve_trace",
    "split_segments",
    "trace_stats",
]
