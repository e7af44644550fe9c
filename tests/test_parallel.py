"""``training.parallel.run_tasks``: the same results, in task order, and the same TaskError from every backend.

Ray starts once for this module, on two local CPUs (Ray 2.60 no longer has ``local_mode``).
"""

import os
import sys

import click
import pytest
from click.testing import CliRunner

from tidegate.training.parallel import TaskError, add_backend_options, run_tasks


def square(x):
    return x * x


def square_unless(x, bad):
    if x == bad:
        raise ValueError(f"{x} is the bad one")
    return x * x


def pid_of(x):
    return os.getpid()


TASKS = [{"x": x} for x in range(6)]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    # pytest imports this file as the top-level module test_parallel, which Ray workers cannot import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("backend", ["serial", "process"])
def test_local_backends_return_results_in_task_order(backend):
    assert run_tasks(square, TASKS, backend=backend, workers=2, progress=False) == [0, 1, 4, 9, 16, 25]


def test_ray_returns_results_in_task_order_and_leaves_the_callers_ray_running(local_ray):
    assert run_tasks(square, TASKS, backend="ray", workers=2, progress=False) == [0, 1, 4, 9, 16, 25]
    assert local_ray.is_initialized()


def test_ray_started_by_run_tasks_is_local_and_shut_down(local_ray, monkeypatch):
    calls = []
    monkeypatch.setattr(local_ray, "is_initialized", lambda: bool(calls) and calls[-1][0] == "init")
    monkeypatch.setattr(local_ray, "init", lambda **kwargs: calls.append(("init", kwargs)))
    monkeypatch.setattr(local_ray, "shutdown", lambda: calls.append(("shutdown", {})))
    assert run_tasks(square, TASKS[:3], backend="ray", workers=2, progress=False) == [0, 1, 4]
    assert calls == [
        ("init", {"address": "local", "num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
                  "ignore_reinit_error": True}),
        ("shutdown", {}),
    ]


@pytest.mark.parametrize("backend", ["serial", "process", "ray"])
def test_a_failing_task_raises_task_error_naming_the_task(backend, request):
    if backend == "ray":
        request.getfixturevalue("local_ray")
    tasks = [{"x": x, "bad": 3} for x in range(5)]
    with pytest.raises(TaskError, match=r"task 3 \{'bad': 3, 'x': 3\} failed: ValueError: 3 is the bad one") as raised:
        run_tasks(square_unless, tasks, backend=backend, workers=2, progress=False)
    assert (raised.value.index, raised.value.task) == (3, {"x": 3, "bad": 3})
    assert isinstance(raised.value, RuntimeError)


def test_serial_stops_at_the_failing_task():
    done = []
    with pytest.raises(TaskError):
        run_tasks(lambda x: done.append(square_unless(x, bad=1)), TASKS, backend="serial", progress=False)
    assert done == [0]


def test_auto_without_an_address_runs_in_local_processes():
    pids = run_tasks(pid_of, TASKS, workers=2, progress=False)
    assert len(pids) == len(TASKS) and os.getpid() not in pids


@pytest.mark.parametrize("options", [{"workers": 1}, {"backend": "process", "workers": 1}, {"backend": "serial"}])
def test_one_worker_or_serial_runs_in_this_process(options):
    assert run_tasks(pid_of, TASKS, progress=False, **options) == [os.getpid()] * len(TASKS)


def test_one_task_runs_in_this_process():
    assert run_tasks(pid_of, TASKS[:1], backend="process", progress=False) == [os.getpid()]


@pytest.mark.parametrize("backend", ["auto", "ray", "process", "serial"])
def test_no_tasks_is_no_results(backend):
    if backend == "ray":
        pytest.importorskip("ray")
    assert run_tasks(square, [], backend=backend, progress=False) == []


def test_progress_bar_counts_completed_tasks(capsys):
    run_tasks(square, TASKS, backend="serial", desc="seeds")
    bar = capsys.readouterr().err
    assert "seeds" in bar and "6/6" in bar
    run_tasks(square, TASKS, backend="serial", desc="seeds", progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("options, message", [
    ({"backend": "gpu"}, r"backend 'gpu' is not known: expected one of auto, ray, process, serial"),
    ({"backend": "process", "address": "auto"}, r"address 'auto' is a Ray cluster, so it needs backend 'ray' or"),
    ({"backend": "serial", "address": "ray://head:10001"}, r"needs backend 'ray' or 'auto', not 'serial'"),
    ({"workers": 0}, r"workers 0 is not valid: expected at least 1"),
])
def test_bad_options_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        run_tasks(square, TASKS, progress=False, **options)


@pytest.mark.parametrize("options", [{"backend": "ray"}, {"address": "ray://head:10001"}])
def test_ray_without_the_extra_says_how_to_install_it(options, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'tidegate\[ray\]'"):
        run_tasks(square, TASKS, progress=False, **options)


@click.command()
@add_backend_options
def sweep(backend, address, workers):
    click.echo(f"{backend} {address} {workers}")


@pytest.mark.parametrize("args, echoed", [
    ([], "auto None None"),
    (["--backend", "ray", "--address", "ray://head:10001", "--workers", "4"], "ray ray://head:10001 4"),
    (["--backend", "serial"], "serial None None"),
])
def test_backend_options_parse(args, echoed):
    result = CliRunner().invoke(sweep, args)
    assert (result.exit_code, result.output.strip()) == (0, echoed)


@pytest.mark.parametrize("args", [["--backend", "gpu"], ["--workers", "0"]])
def test_bad_backend_options_are_usage_errors(args):
    assert CliRunner().invoke(sweep, args).exit_code == 2


def test_backend_options_are_documented():
    help_text = CliRunner().invoke(sweep, ["--help"]).output
    assert "[auto|ray|process|serial]" in help_text and "--address TEXT" in help_text and "--workers" in help_text
