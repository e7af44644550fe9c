"""Run a sweep's independent tasks in parallel: the seeds of a training run, the trials of a
hyper-parameter search, the cells of the evaluation matrix.

``run_tasks(fn, tasks)`` calls ``fn(**task)`` for every task and returns the results in task order,
whichever backend runs them:

- ``ray``: one Ray task per item, each requesting one CPU. Without an address Ray starts on this
  machine's cores (``workers`` of them if given); with one it joins that cluster, which decides how
  many run at once::

      run_tasks(train, [{"seed": seed} for seed in range(8)], address="ray://head-node:10001")
      run_tasks(evaluate, cells, address="auto")    # on a node of the cluster, or with RAY_ADDRESS set

  The cluster's nodes need tidegate installed, since the workers import ``fn`` by its module name.
- ``process``: a pool of local processes (``spawn``), ``workers`` of them or one per core. As with
  any spawn pool, a script that calls ``run_tasks`` needs the ``if __name__ == "__main__":`` guard.
- ``serial``: one after the other in this process; what ``process`` does for one worker or one task.
- ``auto`` (the default): ``ray`` when an address is given, local processes otherwise. Starting Ray
  costs seconds and, on one machine, gains nothing over a process pool, so Ray runs when asked for.

Ray is the optional ``ray`` extra (``pip install 'tidegate[ray]'``); without it the same calls, and
the same ``--backend``/``--address``/``--workers`` options (``add_backend_options``), run in local
processes.
"""

from __future__ import annotations

import multiprocessing
import os
import reprlib
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

import click
from tqdm import tqdm

from tidegate.engine.sim import compiled

BACKENDS = ("auto", "ray", "process", "serial")

_task_repr = reprlib.Repr()  # keyword arguments only from Python 3.12
_task_repr.maxdict, _task_repr.maxlist, _task_repr.maxstring, _task_repr.maxother = 6, 4, 40, 40


class TaskError(RuntimeError):
    """A task of a sweep raised; the message names the task (index and kwargs) and the original error.

    :ivar index: the task's position in ``tasks``.
    :ivar task: the task's kwargs.
    """

    def __init__(self, index: int, task: dict, error: BaseException):
        self.index = index
        self.task = task
        super().__init__(f"task {index} {_task_repr.repr(task)} failed: {type(error).__name__}: {error}")


def run_tasks(fn: Callable, tasks: list[dict], *, backend: str = "auto", address: str | None = None,
              workers: int | None = None, desc: str | None = None, progress: bool = True) -> list:
    """Call ``fn(**task)`` for every task, in parallel, and return the results in task order.

    :param fn: a module-level function, so that other processes can import it.
    :param tasks: the kwargs of each call.
    :param backend: ``auto``, ``ray``, ``process`` or ``serial`` (see the module docstring).
    :param address: a Ray cluster to run on (``ray://host:10001``, ``auto``); only with ``ray`` or ``auto``.
    :param workers: how many tasks run at once on this machine; default one per core.
    :param desc: the label of the progress bar.
    :param progress: show a progress bar over completed tasks.
    :raises TaskError: a task raised; the tasks not yet started are cancelled.
    :raises ValueError: an unknown backend, an address without Ray, or fewer than one worker.
    """
    backend = _resolve_backend(backend, address, workers, len(tasks))
    if not tasks:
        return []
    with tqdm(total=len(tasks), desc=desc, disable=not progress) as bar:
        if backend == "ray":
            return _run_ray(fn, tasks, address, workers, bar)
        if backend == "process":
            return _run_processes(fn, tasks, workers, bar)
        return _run_serial(fn, tasks, bar)


def add_backend_options(f: Callable) -> Callable:
    """Add ``--backend``, ``--address`` and ``--workers`` to a click command, passed as the keyword
    arguments ``backend``, ``address`` and ``workers`` (the parameters of ``run_tasks``)."""
    f = click.option("--workers", type=click.IntRange(min=1), default=None, show_default="one per core",
                     help="Tasks run at once on this machine.")(f)
    f = click.option("--address", default=None,
                     help="Ray cluster to run on, e.g. ray://head-node:10001 or auto; implies --backend ray.")(f)
    return click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                        help="auto: Ray when --address is given, local processes otherwise.")(f)


def _resolve_backend(backend: str, address: str | None, workers: int | None, n_tasks: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not known: expected one of {', '.join(BACKENDS)}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers {workers} is not valid: expected at least 1")
    if address is not None and backend not in ("auto", "ray"):
        raise ValueError(f"address {address!r} is a Ray cluster, so it needs backend 'ray' or 'auto', not {backend!r}")
    if backend == "ray" or (backend == "auto" and address is not None):
        _import_ray()
        return "ray"
    if backend == "serial" or workers == 1 or n_tasks <= 1:
        return "serial"
    return "process"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("the ray backend needs Ray: pip install 'tidegate[ray]'") from None
    return ray


def _run_serial(fn: Callable, tasks: list[dict], bar: tqdm) -> list:
    results = []
    for index, task in enumerate(tasks):
        try:
            results.append(fn(**task))
        except Exception as error:
            raise TaskError(index, task, error) from error
        bar.update()
    return results


def _run_processes(fn: Callable, tasks: list[dict], workers: int | None, bar: tqdm) -> list:
    results: list = [None] * len(tasks)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count(), mp_context=context) as pool:
        futures = {pool.submit(fn, **task): index for index, task in enumerate(tasks)}
        for future in as_completed(futures):
            index = futures[future]
            try:
                results[index] = future.result()
            except Exception as error:
                # the tasks already running finish before the pool closes; the queued ones never start
                pool.shutdown(cancel_futures=True)
                raise TaskError(index, tasks[index], error) from error
            bar.update()
    return results


def _run_ray(fn: Callable, tasks: list[dict], address: str | None, workers: int | None, bar: tqdm) -> list:
    ray = _import_ray()
    if compiled.active():
        # Ray puts the driver's working directory, or a node's own install, ahead of PYTHONPATH
        bar.write("note: Ray's workers run the interpreted source, not the compiled copy: the same results, "
                  "without its speed (--backend process keeps it)", file=sys.stderr)
    started_here = not ray.is_initialized()
    if started_here:
        # "local" rather than None: without an address Ray would join RAY_ADDRESS or the last cluster
        # started on this machine, where --workers cannot apply
        ray.init(address=address or "local", num_cpus=workers if address is None else None,
                 include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        remote_fn = ray.remote(num_cpus=1)(fn)
        refs = {remote_fn.remote(**task): index for index, task in enumerate(tasks)}
        results: list = [None] * len(tasks)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            index = refs[done[0]]
            try:
                results[index] = ray.get(done[0])
            except Exception as error:
                for ref in pending:
                    ray.cancel(ref)
                cause = getattr(error, "cause", None) or error
                raise TaskError(index, tasks[index], cause) from error
            bar.update()
        return results
    finally:
        if started_here:
            ray.shutdown()
