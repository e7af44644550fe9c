"""The errors a user of the training commands can cause, each with a one-sentence message naming
the input. They live apart from the modules that raise them so ``training.cli`` can map them to
exit code 2 without importing torch or stable-baselines3."""

from __future__ import annotations


class ConfigError(ValueError):
    """A training config, or a checkpoint to resume from, that cannot be used."""


class ExportError(ValueError):
    """A checkpoint (or its VecNormalize statistics) that cannot be exported, or an output that cannot be written."""


class EvaluationError(ValueError):
    """An evaluation input that cannot be used: a policy that does not load, a load, seed or request
    count out of range."""
