"""The learned controller's actions from another process: the Gymnasium env driving vLLM's engine.

``ServingEnv(backend="vllm")`` trains or evaluates a policy on a real vLLM server. Inside vLLM's
scheduler the plugin runs ``learned`` as it always does (its shield, its slo-flow prior, its time
budget and fallbacks, ``ObservationFeatures`` every ``control_interval`` steps); only the policy it
calls is :class:`ChannelPolicy`, which asks the env instead of a network. They share one small file,
``<action_channel>.actions``, with one writer per half:

- the engine's half (:class:`ChannelPolicy`): the number of the policy call and the features it was
  called with, written at the start of every control interval;
- the env's half (:class:`ActionWriter`): an action and the number of the call it answers.

Call ``k`` publishes the features ``x_k`` and waits (at most ``wait_s``) for the answer to ``k``; the
env returns ``x_k`` from ``step`` and writes the agent's next action as the answer to ``k``. So an
action acts on the interval whose features it answers, as in the simulator. An answer too late for
the learned controller's time budget is one the deployed controller would have missed too: the
interval keeps the last answer's residuals or the prior's (``LearnedController``), and the next call
is answered afresh. Each half is guarded by a seqlock, as the observation record is (``channel``).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

import numpy as np

from tidegate.ctrl.learned import ACTION_DIM, OBS_DIM

_MAGIC = b"TGACTS01"
_SEQ = struct.Struct("<Q")
#: the env's half: the call it answers, how many answers it wrote, the action
_ANSWER = struct.Struct("<qq" + "d" * ACTION_DIM)
_ANSWER_SEQ_AT = 16
_ANSWER_AT = 24
#: the engine's half: the call's number, its wall time, the features
_CALL = struct.Struct("<qd" + "d" * OBS_DIM)
_CALL_SEQ_AT = 128
_CALL_AT = 136
ACTIONS_BYTES = _CALL_AT + _CALL.size
#: how long a waiting side sleeps between two looks at the other half
POLL_S = 2e-4


def actions_path(channel: str) -> str:
    """The file of the action channel ``channel`` (a path prefix, as the observation channel's)."""
    return channel + ".actions"


def _map(path: str, create: bool) -> mmap.mmap | None:
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        return None
    try:
        if create:
            os.ftruncate(fd, ACTIONS_BYTES)
        elif os.fstat(fd).st_size < ACTIONS_BYTES:
            return None
        mm = mmap.mmap(fd, ACTIONS_BYTES)
    finally:
        os.close(fd)
    if create:
        mm[:8] = _MAGIC
    elif mm[:8] != _MAGIC:
        mm.close()
        return None
    return mm


def _read(mm: mmap.mmap, seq_at: int, layout: struct.Struct, at: int) -> tuple | None:
    """One whole half (None before its first write)."""
    for _ in range(1000):
        (seq,) = _SEQ.unpack_from(mm, seq_at)
        if seq == 0:
            return None
        if seq & 1:
            continue
        values = layout.unpack_from(mm, at)
        if _SEQ.unpack_from(mm, seq_at)[0] == seq:
            return values
    return None


class _Half:
    """The writing side of one half: seqlocked writes."""

    def __init__(self, mm: mmap.mmap, seq_at: int, layout: struct.Struct, at: int) -> None:
        self._mm, self._seq_at, self._layout, self._at = mm, seq_at, layout, at
        self._seq = _SEQ.unpack_from(mm, seq_at)[0] & ~1

    def write(self, *values) -> None:
        mm, seq = self._mm, self._seq
        _SEQ.pack_into(mm, self._seq_at, seq + 1)
        self._layout.pack_into(mm, self._at, *values)
        self._seq = seq + 2
        _SEQ.pack_into(mm, self._seq_at, seq + 2)


class ActionWriter:
    """The env's side: creates the file, answers the engine's calls, reads its latest call.

    :param channel: the path prefix; the file is ``<channel>.actions`` (created, or emptied).
    """

    def __init__(self, channel: str) -> None:
        self.path = actions_path(channel)
        mm = _map(self.path, create=True)
        assert mm is not None  # created
        self._mm = mm
        self._answers = _Half(mm, _ANSWER_SEQ_AT, _ANSWER, _ANSWER_AT)
        self._count = 0

    def answer(self, call: int, action) -> None:
        """The action for the engine's policy call number ``call`` (also before that call is made)."""
        self._count += 1
        self._answers.write(int(call), self._count, *(float(a) for a in action))

    def latest_call(self) -> tuple[int, float, np.ndarray | None]:
        """The engine's latest policy call: (its number, its wall time, its features); (0, 0, None)
        before the first."""
        values = _read(self._mm, _CALL_SEQ_AT, _CALL, _CALL_AT)
        if values is None:
            return 0, 0.0, None
        return int(values[0]), float(values[1]), np.asarray(values[2:], dtype=np.float32)

    def close(self, remove: bool = True) -> None:
        self._mm.close()
        if remove:
            Path(self.path).unlink(missing_ok=True)


class ChannelPolicy:
    """The engine's side, the policy of a ``LearnedController``: publishes each call's features
    and waits at most ``wait_s`` for the env's answer to it.

    An answer that does not come raises ``TimeoutError`` (a fallback the learned controller counts);
    a missing file raises ``FileNotFoundError`` until the env creates it.

    :param channel: the path prefix the env created ``<channel>.actions`` under.
    :param wait_s: the longest one call waits; past the controller's time budget the controller has
        gone on without it, and this only frees the policy's thread for the next call.
    """

    def __init__(self, channel: str, wait_s: float) -> None:
        self.path = actions_path(channel)
        self.wait_s = float(wait_s)
        self.calls = 0
        self._mm: mmap.mmap | None = None
        self._calls: _Half | None = None

    def __call__(self, x) -> tuple[float, float, float]:
        mm = self._mm
        if mm is None:
            mm = self._mm = _map(self.path, create=False)
            if mm is None:
                raise FileNotFoundError(f"no action channel at {self.path}")
            self._calls = _Half(mm, _CALL_SEQ_AT, _CALL, _CALL_AT)
        assert self._calls is not None
        self.calls += 1
        call = self.calls
        self._calls.write(call, time.time(), *np.asarray(x, dtype=np.float64).reshape(-1)[:OBS_DIM])
        deadline = time.perf_counter() + self.wait_s
        while True:
            values = _read(mm, _ANSWER_SEQ_AT, _ANSWER, _ANSWER_AT)
            if values is not None and values[0] == call:
                return tuple(float(a) for a in values[2:2 + ACTION_DIM])  # type: ignore[return-value]
            if time.perf_counter() >= deadline:
                raise TimeoutError(f"no action for policy call {call} within {self.wait_s:g} s")
            time.sleep(POLL_S)
