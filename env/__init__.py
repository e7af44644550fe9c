"""The Gymnasium environment: ``gymnasium.make("tidegate/Serving-v0", **kwargs)``."""

import gymnasium

ENV_ID = "tidegate/Serving-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="tidegate.env.serving_env:ServingEnv")

__all__ = ["ENV_ID"]
