"""A compiled copy of the simulator's core, for throughput: the env, training and sweeps.

``tidegate compile`` copies the project's packages into ``build/compiled/`` and compiles the
modules every simulated step runs (:data:`MODULES`: the engine's core, the simulator's executor,
the heuristic controllers and the shield) to C extensions with mypyc, the compiler that ships
with mypy; the other modules stay Python. ``tidegate --compiled <command>`` and the speed
benchmarks' ``--compiled`` run the same command again in a fresh interpreter whose imports
resolve to that copy. The compiled modules are the same source: a simulation gives the same
steps, times and summaries to the bit (``tests/test_compiled.py``).

What changes is what a bad value does. A compiled function checks its arguments' annotated
types when called, so a value the interpreter would have carried on with (a string where a
float is annotated, say) is a ``TypeError`` at once. That is why the server and the real engine
never run from this copy: their robustness to whatever a client or a broken policy sends is
tested on the interpreted source, and the copy is for simulations fed by the project's own code.

The copy remembers the files it was built from. A command asked to run compiled refuses, in
one sentence, when any file of the project's packages changed since (:func:`stale`): a module,
a profile, a workload or the shipped policy, so the copy never runs code or data older than the
tree beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

#: the project's import package, copied whole (its data files too) so the copy is self-contained; in a source
#: tree its subpackages are links to the repository's top-level folders, and the copy holds their files
PACKAGE = "tidegate"

#: the modules compiled: what a simulated step runs, mypy-clean and free of torch
MODULES = tuple(f"{PACKAGE}/{module}" for module in (
    "engine/core/block_pool.py", "engine/core/clock.py", "engine/core/engine_core.py", "engine/core/executor.py",
    "engine/core/metrics.py", "engine/core/offered.py", "engine/core/profile.py", "engine/core/request.py",
    "engine/core/slo.py", "engine/core/stats.py", "engine/core/decision.py", "engine/core/scheduler.py",
    "engine/core/batching.py", "engine/core/steady_decodes.py", "engine/core/profile_file.py", "engine/core/prefix.py",
    "engine/sim/executor.py", "engine/sim/steady.py",
    "ctrl/base.py", "ctrl/theory.py", "ctrl/shield.py", "ctrl/slo_flow.py", "ctrl/greedy.py", "ctrl/no_evict.py",
    "ctrl/watermark.py", "ctrl/sglang.py", "ctrl/flow.py", "ctrl/class_budgets.py",
))

MANIFEST = "tidegate-compiled.json"
#: set by :func:`rerun` in the process it starts: the compiled copy that process should import
ENV_VAR = "TIDEGATE_COMPILED"
#: where ``tidegate compile`` builds and ``--compiled`` looks, when set
DIR_VAR = "TIDEGATE_COMPILED_DIR"
#: the folder that holds the import package (the repository, in a source tree)
SOURCE_ROOT = Path(__file__).resolve().parents[2]


class CompileError(RuntimeError):
    """The compiled copy could not be built or is not usable; the message is one sentence."""


def default_dir(root: Path = SOURCE_ROOT) -> Path:
    """``$TIDEGATE_COMPILED_DIR``, else ``build/compiled`` in the project."""
    return Path(os.environ.get(DIR_VAR) or root / "build" / "compiled")


#: what a build leaves in a tree, never a source
_BUILT = (".so", ".pyd", ".pyc")


def _folder(out: Path | None, root: Path) -> Path:
    return Path(out) if out is not None else default_dir(root)


def copy_sources(root: Path, dest: Path) -> None:
    """Copy the import package under ``root`` to ``dest``, its linked folders as files: the files
    :func:`_sources` hashes."""
    shutil.copytree(root / PACKAGE, dest / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", *(f"*{suffix}" for suffix in _BUILT)))


def _source_files(root: Path) -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(root / PACKAGE, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [Path(folder) / n for n in sorted(names) if Path(n).suffix not in _BUILT]
    return files


def _sources(root: Path) -> dict[str, str]:
    """Every file of the import package under ``root`` -> its SHA-256: the Python files, and
    the data the copy reads from beside its modules (profiles, workloads, the shipped policy)."""
    return {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in _source_files(root)}


def _checked_out(out: Path | None, root: Path) -> Path:
    """``out`` made absolute, or :class:`CompileError` when building there could destroy anything
    but an earlier copy: the folder must be new, empty or a copy (it holds :data:`MANIFEST`), and
    neither the project nor a folder above it."""
    out = _folder(out, root).expanduser().resolve()
    if out == root.resolve() or out in root.resolve().parents:
        raise CompileError(f"{out} holds the project itself: give --out a folder of its own")
    if out.exists() and not out.is_dir():
        raise CompileError(f"{out} is a file, not a folder for the compiled copy")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise CompileError(f"{out} is not empty and holds no compiled copy: give --out a new or empty folder")
    return out


def _python() -> str:
    return f"{sys.implementation.cache_tag}-{sys.platform}"


def missing_toolchain() -> str | None:
    """What building needs and this machine lacks (a C compiler, the Python headers), or None."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"compiling needs a C compiler, and `{cc}` is not on the PATH"
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").exists():
        return f"compiling needs the Python headers, and {include} has no Python.h"
    return None


def build(out: Path | None = None, root: Path = SOURCE_ROOT, log: Callable[[str], None] = print) -> Path:
    """Copy the packages under ``root`` to ``out`` and compile :data:`MODULES` there in place.

    Built in a new sibling folder and moved into place at the end, so a failed build leaves the
    previous copy as it was; ``out`` is replaced only when it is new, empty or an earlier copy.
    Raises :class:`CompileError` with one sentence, or with the compiler's last lines."""
    missing = missing_toolchain()
    if missing is not None:
        raise CompileError(missing)
    out = _checked_out(out, root)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    try:
        _compile_into(tmp, root, out, log)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _compile_into(tmp: Path, root: Path, out: Path, log: Callable[[str], None]) -> None:
    sources = _sources(root)
    copy_sources(root, tmp)
    log(f"compiling {len(MODULES)} modules with mypyc into {out} (about half a minute) ...")
    cmd = [sys.executable, "-m", "mypyc", "--config-file", str(root / "pyproject.toml"), *MODULES]
    try:
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise CompileError(f"could not start mypyc ({exc})") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        if "No module named mypyc" in tail:
            raise CompileError("mypyc is not installed: pip install -e '.[compile]' (it comes with mypy)")
        raise CompileError(f"mypyc failed (exit {proc.returncode}); its last lines:\n{tail}")
    shutil.rmtree(tmp / "build", ignore_errors=True)
    (tmp / MANIFEST).write_text(json.dumps({"python": _python(), "modules": list(MODULES), "sources": sources},
                                           indent=1) + "\n")


def stale(out: Path | None = None, root: Path = SOURCE_ROOT) -> str | None:
    """Why the copy in ``out`` may not run for the sources under ``root``, or None when it may."""
    out = _folder(out, root)
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"there is no compiled copy in {out}: build it with `tidegate compile`"
    if manifest.get("python") != _python():
        return f"the compiled copy in {out} was built for {manifest.get('python')}, not {_python()}: " \
               "build it again with `tidegate compile`"
    now, then = _sources(root), manifest.get("sources", {})
    changed = sorted(set(now) ^ set(then) | {k for k in now.keys() & then.keys() if now[k] != then[k]})
    if changed:
        more = f" and {len(changed) - 1} other file(s)" if len(changed) > 1 else ""
        return f"{changed[0]}{more} changed since the compiled copy in {out} was built: " \
               "build it again with `tidegate compile`"
    return None


def active() -> bool:
    """Whether this process runs the compiled core (its engine loop is an extension module)."""
    from tidegate.engine.core import engine_core
    return not engine_core.__file__.endswith(".py")


def check() -> None:
    """In a process started by :func:`rerun`: raise :class:`CompileError` unless its imports
    resolved to the compiled copy (a source tree earlier on ``sys.path`` would shadow it)."""
    if os.environ.get(ENV_VAR) and not active():
        from tidegate.engine.core import engine_core
        raise CompileError(f"asked to run compiled from {os.environ[ENV_VAR]}, but the engine was imported "
                           f"from {engine_core.__file__}")


def script_core(argv: Sequence[str] | None = None) -> str:
    """For a benchmark script, first thing in ``main()`` and before it imports the core: with
    ``--compiled`` among its arguments, run the script again on the compiled copy (this process
    ends); a missing or stale copy is one sentence and exit 2. Returns ``"compiled"`` or
    ``"interpreted"``, for the script's report."""
    argv = list(sys.argv if argv is None else argv)
    try:
        if "--compiled" in argv[1:] and not os.environ.get(ENV_VAR):
            rerun(argv)
        check()
    except CompileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    return "compiled" if active() else "interpreted"


def rerun(argv: Sequence[str], out: Path | None = None, root: Path = SOURCE_ROOT) -> NoReturn:
    """Replace this process by ``python *argv`` with imports resolving to the compiled copy
    (``PYTHONPATH`` first; ``argv`` should start with ``-P`` when it runs a module, so that the
    working directory's source does not come first). The new process finds ``TIDEGATE_COMPILED``
    set, and :func:`check` there says whether its imports did resolve to the copy.

    Raises :class:`CompileError` (before replacing anything) when the copy is missing or stale."""
    out = _folder(out, root)
    reason = stale(out, root)
    if reason is not None:
        raise CompileError(reason)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(out.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV_VAR] = str(out.resolve())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)
