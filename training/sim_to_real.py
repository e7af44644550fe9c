"""Sim-to-real check of the learned controller: the same arrivals through the simulator twin and
the real engine (tiny model, CPU, wall clock) for the shipped policy and two heuristics.

    tidegate sim-to-real [--requests 200] [--load 1.5] [--length-scale 0.1] [--max-tokens 256]
        [--profile tiny-cpu] [--policy runs/ppo/policy.onnx] [--out twin-learned.md]

Arrivals: the first ``requests`` requests of splitwise_conv with lengths x ``length_scale``
(to fit the tiny model), replayed at ``load`` x lambda_max of the tiny-cpu profile for those
lengths. The learned controller is built with that lambda_max and the tiny-cpu profile (the
policy itself was trained on a100-llama2-7b: this measures how it transfers). The policy defaults
to the shipped one (``ctrl.learned.DEFAULT_POLICY``); one that cannot be loaded is an error.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tidegate.ctrl import build_controller
from tidegate.ctrl.learned import DEFAULT_POLICY, TIMING_CAUSES, make_learned_controller
from tidegate.ctrl.theory import capacity
from tidegate.engine.bench.bench import markdown_table
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.twin.replay import replay_real
from tidegate.engine.workloads import read_trace, resolve_trace
from tidegate.training.errors import EvaluationError
from tidegate.training.evaluate import require_policy

COLUMNS = ("engine", "controller", "requests", "completed", "rejected", "expired", "evictions", "goodput_rps",
           "goodput_frac", "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s")


def sim_to_real(policy: str | Path = DEFAULT_POLICY, requests: int = 200, load: float = 1.5,
                length_scale: float = 0.1, max_tokens: int = 256, profile: str = "tiny-cpu",
                heuristics=("greedy", "flow:adaptive=true"), max_waiting: int = 512, log=None) -> list[dict]:
    """Goodput of the learned controller and ``heuristics`` on the simulator twin and on the real engine.

    :param policy: the exported ONNX policy (default: the shipped one).
    :param requests: the first this many requests of splitwise_conv (at least 2).
    :param load: offered load as a multiple of lambda_max.
    :param length_scale: multiply prompt and output lengths (to fit the tiny model).
    :param max_tokens: cap on every request's output.
    :param profile: the profile of the real engine's machine (name or file).
    :param heuristics: controller specs to compare with.
    :param max_waiting: queue limit for every controller.
    :param log: called with a line of progress per run (e.g. ``print``).
    :return: one row per (engine, controller), with ``lambda_max_rps``.
    :raises EvaluationError: the policy cannot be loaded, or a size is out of range.
    """
    import torch

    if requests < 2:
        raise EvaluationError(f"requests must be at least 2 (the arrival rate needs two), got {requests}")
    if not (load > 0 and length_scale > 0 and max_tokens >= 1):
        raise EvaluationError(f"load and length_scale must be positive and max_tokens at least 1, got load={load}, "
                              f"length_scale={length_scale}, max_tokens={max_tokens}")
    prof = load_profile(profile)
    policy = require_policy(policy, prof)
    torch.set_num_threads(1)  # as the tiny-cpu profile was fitted (and the step-time model assumes)
    base = read_trace(resolve_trace("splitwise_conv"), first_n=requests, length_scale=length_scale,
                      max_tokens_cap=max_tokens)
    lam = capacity([a.prompt_tokens for a in base], [a.output_tokens for a in base], prof).lambda_max_rps
    span = base[-1].arrival_time_s - base[0].arrival_time_s
    scale = load * lam / ((len(base) - 1) / span)
    arrivals = [replace(a, arrival_time_s=(a.arrival_time_s - base[0].arrival_time_s) / scale) for a in base]
    timeout = 5.0 * prof.ttft_slo_s

    def controllers():
        yield "learned+shield", make_learned_controller(policy, profile=prof,
                                                        max_waiting=max_waiting, queue_timeout_s=timeout)
        for spec in heuristics:
            sep = "," if ":" in spec else ":"
            yield spec, build_controller(f"{spec}{sep}max_waiting={max_waiting},queue_timeout_s={timeout}", prof)

    rows = []
    for (name, c_sim), (_, c_real) in zip(controllers(), controllers()):
        s = simulate(arrivals, prof, c_sim, record_steps=False).summary
        rows.append({**s, "engine": "sim", "controller": name, "goodput_frac": s["goodput_rps"] / lam})
        if log:
            log(f"{name}: sim goodput {s['goodput_rps'] / lam:.3f}; "
                f"real engine, {arrivals[-1].arrival_time_s:.0f}s of arrivals")
        core, _ = replay_real(arrivals, prof, c_real)
        r = core.metrics.summary(core.pool.capacity_tokens, prof.ttft_slo_s, prof.tpot_slo_s,
                                 final_waiting=len(core.waiting))
        causes = getattr(getattr(c_real, "inner", None), "fallbacks", {})
        # a policy late on the wall clock (a busy machine) is reported apart from one that failed
        late = sum(n for cause, n in causes.items() if cause in TIMING_CAUSES)
        rows.append({**r, "engine": "real", "controller": name, "goodput_frac": r["goodput_rps"] / lam,
                     "fallbacks": sum(causes.values()) - late, "late": late})
        if log:
            log(f"{name}: real goodput {r['goodput_rps'] / lam:.3f}")
    for row in rows:
        row["lambda_max_rps"] = lam
    return rows


def sim_to_real_table(rows: list[dict], load: float, requests: int, length_scale: float, profile: str) -> str:
    """The Markdown report of :func:`sim_to_real`'s rows: lambda_max and the setting, then one row per run."""
    return (f"lambda_max ({profile}, splitwise_conv x{length_scale} lengths) = {rows[0]['lambda_max_rps']:.3g} rps; "
            f"load {load}; {requests} requests\n\n" + markdown_table(rows, COLUMNS + ("fallbacks", "late")))
