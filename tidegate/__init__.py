"""tidegate: admission and batching control for streaming LLM inference.

One import package whose subpackages are the repository's top-level folders (``pyproject.toml``
maps them with setuptools' ``package-dir``)::

    tidegate.ctrl         controllers, the shield, the learned runtime, the theory (numpy only)
    tidegate.engine       the engine loop, its executors, workloads, the server, the twin
    tidegate.env          the Gymnasium environment (``tidegate/Serving-v0``)
    tidegate.training     PPO training, export, evaluation
    tidegate.checkpoints  the shipped policy, as package data
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tidegate")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
