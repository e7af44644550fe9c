"""Zoo-style training configs, shipped as package data so they are found from any current
directory and from a non-editable install, and the defaults of ``tidegate train``."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

#: the config ``tidegate train`` uses unless given ``--config``
DEFAULT_CONFIG = Path(str(importlib.resources.files(__name__) / "ppo.yaml"))
#: where a run writes its logs, checkpoints, ``model.zip`` and ``vecnormalize.pkl`` unless given ``--out``
#: (relative to the current directory; never the shipped ``checkpoints`` package)
DEFAULT_OUT = Path("runs/ppo")
