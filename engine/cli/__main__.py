"""``python -m engine.cli``: the ``tidegate`` command."""

from engine.cli import main

main(prog_name="tidegate")
