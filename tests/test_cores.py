"""The engine process's torch threads: the cores free at its start (engine/serve/cores.py)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from tidegate.engine.serve import cores


def test_all_free_cores_below_four_and_all_but_one_from_four():
    assert [cores.engine_threads(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 2, 3, 3, 7, 63]


def test_an_idle_machine_has_every_allowed_core_free_and_a_busy_core_is_not(monkeypatch):
    allowed = cores.allowed_cpus()
    stats = iter([({c: 100 for c in allowed}, {c: 1000 for c in allowed}),
                  # over the sample, the first CPU was busy all the time, the others idle
                  ({c: 100 + (50 if c == allowed[0] else 0) for c in allowed}, {c: 1050 for c in allowed})])
    monkeypatch.setattr(cores, "_busy_and_total", lambda _cpus: next(stats))
    assert cores.free_cores(sample_s=0) == max(1, len(allowed) - 1)
    monkeypatch.setattr(cores, "_busy_and_total", lambda _cpus: None)  # no /proc/stat: every allowed core
    assert cores.free_cores(sample_s=0) == len(allowed)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(len(cores.allowed_cpus()) < 2, reason="needs two cores")
def test_a_core_kept_busy_by_other_work_is_counted_busy():
    idle = cores.free_cores(sample_s=0.3)
    worker = multiprocessing.get_context("spawn").Process(target=_spin, args=(3.0,))
    worker.start()
    try:
        time.sleep(0.5)  # the worker is spinning
        busy = cores.free_cores(sample_s=0.5)
    finally:
        worker.join()
    assert busy <= idle - 1 or busy == 1
