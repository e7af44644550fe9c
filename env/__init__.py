"""The Gymnasium environments: ``gymnasium.make("tidegate/Serving-v0", **kwargs)`` (one replica's
controller) and ``gymnasium.make("tidegate/Fleet-v0", **kwargs)`` (a fleet gateway's admission)."""

import gymnasium

ENV_ID = "tidegate/Serving-v0"
FLEET_ENV_ID = "tidegate/Fleet-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="tidegate.env.serving_env:ServingEnv")
if FLEET_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=FLEET_ENV_ID, entry_point="tidegate.env.fleet_env:FleetEnv")

__all__ = ["ENV_ID", "FLEET_ENV_ID"]
