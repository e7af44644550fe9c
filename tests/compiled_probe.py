"""Run by tests/test_compiled.py in a child process, once on the interpreted source and once on
the compiled copy: simulations under every controller and an env rollout, printed as one JSON
object of exact figures (floats as their hex, step traces as digests) for the two to compare."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

from tidegate.ctrl import CONTROLLERS, build_controller
from tidegate.ctrl.base import Controller, Decision, Observation
from tidegate.ctrl.flow import FlowController
from tidegate.ctrl.theory import capacity
from tidegate.engine.sim import compiled
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.driver import replay
from tidegate.engine.sim.executor import SimExecutor
from tidegate.engine.sim.simulate import make_request, make_sim_engine, simulate
from tidegate.engine.workloads import Arrival, read_trace, resolve_trace


class Alternating(Controller):
    """An interpreted controller (a subclass of the compiled base, as a user's would be)."""

    def decide(self, obs: Observation) -> Decision:
        return Decision(2 if obs.step_index % 2 else 0, 512, 64)


class Slower(SimExecutor):
    """An interpreted executor subclassing the compiled one: every step 10% longer."""

    def execute(self, batch):
        result = super().execute(batch)
        result.duration_s *= 1.1
        return result


def exact(value):
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [exact(v) for v in value]
    return value


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.asarray(a).tobytes())
    return h.hexdigest()


def run(arrivals, profile, controller, eviction: str) -> dict:
    result = simulate(arrivals, profile, controller, record_steps=True, eviction=eviction)
    m = result.core.metrics
    summary = {k: v for k, v in result.summary.items() if k != "wall_time_s"}
    ends = [(r.request_id, r.state.name, r.first_token_time_s, r.finish_time_s, r.num_output_tokens)
            for r in m.terminal]
    return {"summary": exact(summary), "steps": digest(m.step_time_s, m.step_duration_s, m.step_kv_tokens,
                                                       m.step_waiting, m.step_running, m.step_tokens),
            "ends": hashlib.sha256(repr(exact(ends)).encode()).hexdigest()}


def main() -> None:
    n = int(sys.argv[1])
    out: dict = {"compiled": compiled.active()}
    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=n)
    # twice the rate, so queues, refusals and evictions happen
    arrivals = [Arrival(a.arrival_time_s / 2, a.prompt_tokens, a.output_tokens, a.max_tokens, a.class_id)
                for a in arrivals]
    quiet = load_profile("a100-llama2-7b")
    noisy = dataclasses.replace(quiet, noise_sigma=0.15, noise_corr=0.3, noise_white=0.4, noise_knee_s=0.02,
                                noise_floor=0.4,
                                kv_capacity_tokens=quiet.kv_capacity_tokens // 4)
    for name in [*sorted(CONTROLLERS), "learned"]:
        for profile, eviction in ((quiet, "recompute"), (noisy, "reset")):
            controller = build_controller(name, profile, arrivals)
            out[f"{name}/{profile.noise_sigma}/{eviction}"] = run(arrivals, profile, controller, eviction)
    out["interpreted-subclass"] = run(arrivals, quiet, Alternating(max_waiting=50), "recompute")
    core = make_sim_engine(quiet, build_controller("slo-flow", quiet))
    core.executor = Slower(quiet)
    replay(core, [a.arrival_time_s for a in arrivals], lambda i: make_request(i, arrivals[i]))
    out["interpreted-executor"] = exact(core.metrics.summary(core.pool.capacity_tokens, quiet.ttft_slo_s,
                                                             quiet.tpot_slo_s))
    # a profile file that writes its counts as floats (4096.0), as a hand-edited one may
    data = noisy.to_dict()
    data["kv_capacity_tokens"] = float(data["kv_capacity_tokens"])
    data["max_num_seqs"] = 64.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "counts-as-floats.json"
        path.write_text(json.dumps(data))
        from_file = load_profile(path)
    out["profile-file"] = run(arrivals, from_file, build_controller("slo-flow", from_file), "recompute")
    out["class-constants"] = [list(FlowController.DISTS), list(Observation.FIELDS)]
    # what crosses to worker processes (bench sends profiles): pickled and back, the same
    pickled = pickle.loads(pickle.dumps((noisy, capacity([100, 300], [20, 50], noisy))))
    out["pickled"] = [pickled[0] == noisy, pickled[1] == capacity([100, 300], [20, 50], noisy)]

    from tidegate.env.serving_env import ServingEnv

    env = ServingEnv(control_interval=10, episode_steps=64, seed=3)
    env.action_space.seed(3)
    obs, _ = env.reset(seed=3)
    trail = [obs.tobytes().hex()]
    for _ in range(150):
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        trail.append(f"{obs.tobytes().hex()} {float(reward).hex()}")
        if terminated or truncated:
            obs, _ = env.reset()
            trail.append(obs.tobytes().hex())
    out["env"] = hashlib.sha256("\n".join(trail).encode()).hexdigest()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
