"""``python -m tidegate.engine.cli`` (or ``python -m tidegate``): the ``tidegate`` command."""

from tidegate.engine.cli import main

main(prog_name="tidegate")
