"""What every ``tidegate`` command shares: user errors as one line and exit code 2."""

from __future__ import annotations

import functools
import sys

import click


def _project_errors() -> tuple[type[Exception], ...]:
    from ctrl import ControllerSpecError
    from engine.core.profile import ProfileError
    from engine.real.model import ModelLoadError
    from engine.workloads.workload import WorkloadError
    return (ControllerSpecError, ProfileError, WorkloadError, ModelLoadError)


def friendly(*extra: type[Exception]):
    """Decorator: the project's user-input errors (and ``extra`` ones) become one
    ``error: ...`` line on stderr and exit code 2, never a traceback."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (*_project_errors(), *extra) as exc:
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
        return wrapper
    return decorate
