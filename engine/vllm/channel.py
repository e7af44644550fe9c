"""The shared records between vLLM's engine process and its API process: no waiting on either side.

Two small memory-mapped files, named after the API process's pid (vLLM's engine process is its
child) in ``/dev/shm`` (or the temporary folder), or at the ``channel`` setting's path:

- ``<channel>.obs``, written by the engine after every step (:class:`EngineRecordWriter`), read by
  the API process at each arrival (:class:`EngineRecordReader`): the replica's limits, the latest
  Observation (every field of ``Observation.FIELDS``, rates settled, and its ``leading_outputs``), the
  controller's ``admission_state()``, the arrivals the engine has seen, the engine's counters (decisions,
  decision times, shield interventions, fallbacks by cause, guard switches, step-model refits) and
  the step model last refitted from the replica's steps (``engine.sim.online``). A seqlock guards it:
  the writer makes the sequence number odd, writes, makes it even again; a reader that sees it odd
  or changed across its read reads again, so it never takes a torn record.
- ``<channel>.refusals``, written by the API process at each 429 (:class:`RefusalWriter`), read by
  the engine at each step (:class:`RefusalReader`): the prompt lengths of the refused arrivals, a
  ring behind a count, so that the engine's arrival rate counts them as tidegate's own engine does.

Each file has one writer. The numbers are plain structs; only the admission state, the fallback
causes and the refitted profile, which change rarely, are pickled, and only when they change.
"""

from __future__ import annotations

import bisect
import mmap
import os
import pickle
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidegate.ctrl.base import LEADING_OUTPUTS, Observation
from tidegate.engine.vllm.config import ReplicaLimits

#: the upper bounds of the decision-time histogram's buckets, seconds (tidegate serve's)
DECISION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2)
_MAGIC = b"TGVLLM03"
_SEQ = struct.Struct("<Q")
_FIELDS = Observation.FIELDS
# the fields an Observation holds as ints (the record holds every field as a double: exact below 2**53)
_INT_FIELDS = frozenset(name for name in _FIELDS if isinstance(getattr(Observation(), name), int))
# the Observation's scalars, then its ``leading_outputs`` (a count and LEADING_OUTPUTS slots), then the blob's length
_FIXED = struct.Struct("<4qdqqd" + "q" * (len(DECISION_BUCKETS) + 1) + "5q" + "d" * len(_FIELDS)
                       + "q" * (LEADING_OUTPUTS + 1) + "I")
_NO_LEADING = (0,) * LEADING_OUTPUTS
_FIXED_AT = 16
_BLOB_AT = _FIXED_AT + _FIXED.size
_BLOB_MAX = 16384
RECORD_BYTES = _BLOB_AT + _BLOB_MAX
#: refused arrivals the ring holds; an engine further behind counts the older ones at the mean size
RING = 4096
_RING_AT = 16
_ENTRY = struct.Struct("<q")
RING_BYTES = _RING_AT + RING * _ENTRY.size


def default_channel(api_pid: int) -> str:
    """The channel's path prefix for the vLLM server whose API process has pid ``api_pid``."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"tidegate-vllm-{os.getuid()}-{api_pid}")


def remove_stale_channels(channel: str) -> None:
    """Remove the records of default channels whose API process is gone (a server killed before it
    could remove its own), beside ``channel``."""
    folder, name = os.path.split(channel)
    prefix = f"tidegate-vllm-{os.getuid()}-"
    if not name.startswith(prefix):
        return
    for entry in os.listdir(folder):
        pid = entry[len(prefix):].partition(".")[0]
        if entry.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            Path(folder, entry).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _create(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _open(path: str, size: int, writable: bool = False) -> mmap.mmap | None:
    """The file mapped, or None while it is missing, too short or not yet marked as ours."""
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size < size:
            return None
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)
    if mm[:8] != _MAGIC:
        mm.close()
        return None
    return mm


@dataclass
class EngineCounters:
    """What the engine counts for ``/metrics``: steps decided, their decision times, the shield's
    interventions, fallbacks by cause, the guard's switches, the step model's refits (and the last
    refitted profile, None before the first)."""

    decisions: int = 0
    decide_s_sum: float = 0.0
    decide_buckets: list[int] = field(default_factory=lambda: [0] * (len(DECISION_BUCKETS) + 1))
    interventions: int = 0
    guard_switches: int = 0
    guarded: bool = False
    degraded: bool = False
    fallbacks: dict[str, int] = field(default_factory=dict)
    profile_fits: int = 0
    fitted: Any = None

    def decided(self, seconds: float) -> None:
        self.decisions += 1
        self.decide_s_sum += seconds
        self.decide_buckets[bisect.bisect_left(DECISION_BUCKETS, seconds)] += 1


@dataclass
class EngineRecord:
    """One read of the engine's record."""

    limits: ReplicaLimits
    published_wall_s: float
    arrivals: int
    observation: Observation
    admission_state: Any
    counters: EngineCounters

    @property
    def age_s(self) -> float:
        return time.time() - self.published_wall_s


class EngineRecordWriter:
    """The engine's side of ``<channel>.obs``; made at start-up, written after every step."""

    def __init__(self, channel: str, limits: ReplicaLimits) -> None:
        self.path = channel + ".obs"
        self._mm = _create(self.path, RECORD_BYTES)
        self._limits = (limits.kv_capacity_tokens, limits.block_size, limits.max_num_seqs,
                        limits.max_num_batched_tokens)
        self._seq = 0
        self._blob_len = 0
        self._blob_key: Any = object()
        self._mm[:8] = _MAGIC

    def publish(self, obs: Observation, admission_state: Any, arrivals: int, counters: EngineCounters) -> None:
        """Write the record (reading ``obs``'s rates settles them)."""
        mm, seq = self._mm, self._seq
        values = [getattr(obs, name) for name in _FIELDS]
        leading = obs.leading_outputs[:LEADING_OUTPUTS]
        fallbacks = counters.fallbacks
        key = (admission_state, sum(fallbacks.values()), len(fallbacks), counters.profile_fits)
        blob = None
        if key != self._blob_key:
            blob = pickle.dumps((admission_state, dict(fallbacks), counters.fitted), protocol=pickle.HIGHEST_PROTOCOL)
            if len(blob) > _BLOB_MAX:  # causes are few and short; never more than the record holds
                blob = pickle.dumps((admission_state, {}, counters.fitted), protocol=pickle.HIGHEST_PROTOCOL)
            self._blob_key = key
        _SEQ.pack_into(mm, 8, seq + 1)
        if blob is not None:
            mm[_BLOB_AT:_BLOB_AT + len(blob)] = blob
            self._blob_len = len(blob)
        _FIXED.pack_into(mm, _FIXED_AT, *self._limits, time.time(), arrivals, counters.decisions,
                         counters.decide_s_sum, *counters.decide_buckets, counters.interventions,
                         counters.guard_switches, counters.guarded, counters.degraded, counters.profile_fits,
                         *values, len(leading), *leading, *_NO_LEADING[len(leading):], self._blob_len)
        self._seq = seq + 2
        _SEQ.pack_into(mm, 8, seq + 2)

    def close(self, remove: bool = True) -> None:
        self._mm.close()
        if remove:
            Path(self.path).unlink(missing_ok=True)


class EngineRecordReader:
    """The API process's side of ``<channel>.obs``: :meth:`read` never waits for the engine."""

    def __init__(self, channel: str) -> None:
        self.path = channel + ".obs"
        self._mm: mmap.mmap | None = None
        self._blob = b""
        self._blob_value: tuple[Any, dict[str, int], Any] = (None, {}, None)

    def read(self) -> EngineRecord | None:
        """The latest whole record; None before the engine published one (or if it is being
        rewritten faster than it can be read, which a step's pace never does)."""
        mm = self._mm
        if mm is None:
            mm = self._mm = _open(self.path, RECORD_BYTES)
            if mm is None:
                return None
        for _ in range(1000):
            (seq,) = _SEQ.unpack_from(mm, 8)
            if seq == 0:
                return None
            if seq & 1:
                continue
            fixed = _FIXED.unpack_from(mm, _FIXED_AT)
            blob = mm[_BLOB_AT:_BLOB_AT + fixed[-1]]
            if _SEQ.unpack_from(mm, 8)[0] == seq:
                return self._record(fixed, blob)
        return None

    def _record(self, fixed: tuple, blob: bytes) -> EngineRecord:
        nb = len(DECISION_BUCKETS) + 1
        limits = ReplicaLimits(*fixed[:4])
        wall, arrivals, decisions, decide_sum = fixed[4:8]
        buckets = list(fixed[8:8 + nb])
        interventions, switches, guarded, degraded, fits = fixed[8 + nb:13 + nb]
        obs = Observation()
        at = 13 + nb + len(_FIELDS)
        for name, value in zip(_FIELDS, fixed[13 + nb:at]):
            setattr(obs, name, int(value) if name in _INT_FIELDS else value)
        obs.leading_outputs = tuple(fixed[at + 1:at + 1 + fixed[at]])
        if blob != self._blob:
            self._blob, self._blob_value = blob, pickle.loads(blob)
        state, fallbacks, fitted = self._blob_value
        counters = EngineCounters(decisions, decide_sum, buckets, interventions, switches, bool(guarded),
                                  bool(degraded), dict(fallbacks), fits, fitted)
        return EngineRecord(limits, wall, arrivals, obs, state, counters)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class RefusalWriter:
    """The API process's side of ``<channel>.refusals``: one entry per refused arrival."""

    def __init__(self, channel: str) -> None:
        self.path = channel + ".refusals"
        self._mm = _create(self.path, RING_BYTES)
        self._count = 0
        self._mm[:8] = _MAGIC

    def refused(self, prompt_tokens: int) -> None:
        mm, n = self._mm, self._count
        _ENTRY.pack_into(mm, _RING_AT + (n % RING) * _ENTRY.size, prompt_tokens)
        self._count = n + 1
        _SEQ.pack_into(mm, 8, n + 1)  # the entry first, then the count that makes it visible

    def close(self, remove: bool = True) -> None:
        self._mm.close()
        if remove:
            Path(self.path).unlink(missing_ok=True)


class RefusalReader:
    """The engine's side of ``<channel>.refusals``: the prompt lengths refused since the last read."""

    def __init__(self, channel: str) -> None:
        self.path = channel + ".refusals"
        self._mm: mmap.mmap | None = None
        self._seen = 0
        self._calls = 0

    def new(self) -> list[int]:
        mm = self._mm
        if mm is None:
            # the API process makes the file at its first refusal; look for it every 64 steps (a failed
            # open costs microseconds), and take every refusal it holds once it is there
            self._calls += 1
            if self._calls % 64 != 1:
                return []
            mm = self._mm = _open(self.path, RING_BYTES)
            if mm is None:
                return []
        (count,) = _SEQ.unpack_from(mm, 8)
        seen = self._seen
        if count == seen:
            return []
        if count < seen:  # the API process started again: a new ring
            seen = 0
        first = max(seen, count - RING)
        sizes = [_ENTRY.unpack_from(mm, _RING_AT + (i % RING) * _ENTRY.size)[0] for i in range(first, count)]
        if first > seen and sizes:  # lapped: the older ones at the mean size of those kept
            sizes += [sum(sizes) // len(sizes)] * (first - seen)
        self._seen = count
        return sizes
