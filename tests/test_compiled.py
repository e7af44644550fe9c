"""The compiled copy of the simulator's core (engine/sim/compiled.py, ``tidegate compile``): it gives
the interpreted source's results to the bit, and refuses to run when missing or stale.

Building it takes mypyc and a C compiler (half a minute); without them these tests skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tidegate.engine.sim import compiled

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(compiled.missing_toolchain() is not None, reason=str(compiled.missing_toolchain()))


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    pytest.importorskip("mypyc")
    # unoptimised C (mypyc's own setting) builds in two thirds of the time; what these tests check, the
    # results to the bit and the refusals, is the same at every optimisation level
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MYPYC_OPT_LEVEL", "0")
        return compiled.build(tmp_path_factory.mktemp("compiled") / "core", log=lambda _: None)


def _env(copy: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", compiled.ENV_VAR)}
    if copy is not None:
        env["PYTHONPATH"] = str(copy)
        env[compiled.ENV_VAR] = str(copy)
    return env


def _probe(copy: Path | None) -> dict:
    done = subprocess.run([sys.executable, str(HERE / "compiled_probe.py"), "400"], env=_env(copy),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_compiled_core_gives_the_interpreted_results_to_the_bit(copy):
    """Every controller (the learned one behind the shield too) on a quiet and on a noisy, tight
    profile, both eviction modes, an interpreted controller and an interpreted executor
    subclassing the compiled bases, a profile file that writes its counts as floats, and an env
    rollout: step traces, every request's end, summaries and observations are identical."""
    interpreted, fast = _probe(None), _probe(copy)
    assert interpreted.pop("compiled") is False
    assert fast.pop("compiled") is True
    assert interpreted.keys() == fast.keys()
    different = [k for k in interpreted if interpreted[k] != fast[k]]
    assert not different, f"compiled results differ for {different}"
    # the probe exercised what it claims: refusals, evictions and both noise settings
    summaries = [v["summary"] for v in interpreted.values() if isinstance(v, dict) and "summary" in v]
    assert any(s["evictions"] > 0 for s in summaries)
    assert any(s["rejected"] > 0 for s in summaries)


def test_the_copy_remembers_its_sources(copy, tmp_path):
    assert compiled.stale(copy) is None
    root = tmp_path / "src"
    compiled.copy_sources(compiled.SOURCE_ROOT, root)
    assert compiled.stale(copy, root) is None
    greedy = root / "tidegate" / "ctrl" / "greedy.py"
    greedy.write_text(greedy.read_text() + "\n# changed\n")
    reason = compiled.stale(copy, root)
    assert reason is not None and reason.startswith("tidegate/ctrl/greedy.py changed") and "tidegate compile" in reason
    (root / "tidegate" / "ctrl" / "extra.py").write_text("")
    assert "1 other file" in compiled.stale(copy, root)
    assert "no compiled copy" in compiled.stale(tmp_path / "nowhere")
    # data the copy reads from beside its modules counts too: a profile, the shipped policy
    fresh = tmp_path / "fresh"
    compiled.copy_sources(compiled.SOURCE_ROOT, fresh)
    for data in ("tidegate/engine/core/profiles/a100-llama2-7b.json", "tidegate/checkpoints/policy.onnx"):
        (fresh / data).write_bytes((fresh / data).read_bytes() + b" ")
        assert compiled.stale(copy, fresh).startswith(f"{data} changed")
        shutil.copyfile(compiled.SOURCE_ROOT / data, fresh / data)
    assert compiled.stale(copy, fresh) is None


def test_compile_replaces_only_an_earlier_copy(tmp_path):
    """--out must be new, empty or an earlier copy: nothing else in it is ever deleted."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run1.csv").write_text("precious")
    with pytest.raises(compiled.CompileError, match="not empty and holds no compiled copy"):
        compiled.build(tmp_path)
    with pytest.raises(compiled.CompileError, match="holds the project itself"):
        compiled.build(compiled.SOURCE_ROOT)
    with pytest.raises(compiled.CompileError, match="holds the project itself"):
        compiled.build(compiled.SOURCE_ROOT.parent)
    (tmp_path / "file").write_text("x")
    with pytest.raises(compiled.CompileError, match="is a file"):
        compiled.build(tmp_path / "file")
    assert (tmp_path / "results" / "run1.csv").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "results"]


def _tidegate(*args: str, copy_dir: Path, compiled_env: bool = False) -> subprocess.CompletedProcess:
    env = _env(None)
    env["TIDEGATE_COMPILED_DIR"] = str(copy_dir)
    return subprocess.run([sys.executable, "-m", "tidegate", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=compiled.SOURCE_ROOT)


def test_the_cli_runs_a_command_compiled(copy):
    args = ("simulate", "--trace", "splitwise_conv", "--first", "300", "--controller", "slo-flow", "--json",
            "--no-progress")
    plain = _tidegate(*args, copy_dir=copy)
    fast = _tidegate("--compiled", *args, copy_dir=copy)
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    a, b = json.loads(plain.stdout), json.loads(fast.stdout)
    a.pop("wall_time_s")
    b.pop("wall_time_s")
    assert a == b


def test_bench_runs_compiled_in_worker_processes(copy, tmp_path):
    """bench sends profiles to worker processes: a compiled Profile pickles by its fields."""
    import csv

    args = ("bench", "--trace", "splitwise_conv", "--first", "200", "--loads", "1.0",
            "--controllers", "greedy,slo-flow", "--jobs", "2")
    plain = _tidegate(*args, "--out", str(tmp_path / "plain"), copy_dir=copy)
    fast = _tidegate("--compiled", *args, "--out", str(tmp_path / "fast"), copy_dir=copy)
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr[-2000:] + fast.stderr[-2000:]
    rows = [list(csv.DictReader((tmp_path / d / "results.csv").open())) for d in ("plain", "fast")]
    for row in rows[0] + rows[1]:
        row.pop("wall_time_s")
    assert rows[0] == rows[1] and len(rows[0]) == 2


def test_a_missing_copy_is_one_sentence(tmp_path):
    done = _tidegate("--compiled", "simulate", "--trace", "splitwise_conv", "--first", "10", copy_dir=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: there is no compiled copy in ")
    assert "tidegate compile" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_server_never_runs_compiled(copy):
    done = _tidegate("--compiled", "serve", "--model", "tiny", copy_dir=copy)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --compiled applies to simulate") and "not to serve" in done.stderr
    alone = _tidegate("--compiled", copy_dir=copy)
    assert alone.returncode == 2 and alone.stderr.strip().endswith("and needs one of them")
    helped = _tidegate("--compiled", "--help", copy_dir=copy)
    assert helped.returncode == 0 and helped.stdout.startswith("Usage:") and "--compiled" in helped.stdout


def test_a_shadowed_copy_is_refused(copy, tmp_path):
    """A process told to run compiled whose imports resolved to the source says so."""
    env = _env(None)
    env[compiled.ENV_VAR] = str(copy)
    done = subprocess.run([sys.executable, str(compiled.SOURCE_ROOT / "benchmarks" / "env_speed.py"), "--steps", "1"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("error: asked to run compiled from ") and "Traceback" not in done.stderr


def test_a_machine_without_a_compiler_is_told_so(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled.sysconfig, "get_config_var", lambda name: "no-such-cc -pthread")
    with pytest.raises(compiled.CompileError, match="needs a C compiler, and `no-such-cc` is not on the PATH"):
        compiled.build(tmp_path / "core")
    assert not (tmp_path / "core").exists()


def test_classes_open_to_interpreted_subclasses_have_no_unboxed_defaults():
    """mypyc passes an omitted int, float or bool argument wrongly when compiled code calls a
    method on an interpreted subclass's instance (slo-flow's own ``reset`` once gave such a
    subclass a token scale of 0). The classes open to subclasses therefore take none, except in
    ``__init__``, which compiled code does not call on a subclass."""
    import ast

    open_classes = []
    for module in compiled.MODULES:
        tree = ast.parse((compiled.SOURCE_ROOT / module).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any("allow_interpreted_subclasses" in ast.unparse(d)
                                                      for d in node.decorator_list):
                open_classes.append(node.name)
                for fn in node.body:
                    if not isinstance(fn, ast.FunctionDef) or fn.name == "__init__":
                        continue
                    args = [*fn.args.posonlyargs, *fn.args.args]
                    defaulted = list(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults))
                    defaulted += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]
                    for arg, _ in defaulted:
                        note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                        assert note not in ("int", "float", "bool"), f"{module} {node.name}.{fn.name}({arg.arg})"
    assert sorted(open_classes) == ["Controller", "SimExecutor"]
