"""Evaluate the exported policy against the heuristic controllers on the held-out traces.

    python -m training.evaluate --policy checkpoints/policy.onnx [--loads 0.8,1.0,1.5,2.0]
        [--requests 2000] [--out docs/bench_learned.md]

Every controller replays the same windows of the evaluation split (the last 30% of
splitwise_conv and all of splitwise_code) through ``engine.simulate`` at each load (multiples
of lambda_max). The learned controller runs as deployed: ``make_learned_controller`` (the shield
around it, the flow controller as fallback); the heuristics get the same overload options
(queue limit and timeout) as the shield.
"""

from __future__ import annotations

from pathlib import Path

from ctrl import build_controller
from ctrl.learned import make_learned_controller
from engine.bench import markdown_table
from engine.profile import load_profile
from engine.simulate import simulate
from engine.workload import Arrival

from env.serving_env import TRAIN_FRACTION, split_segments

DEFAULT_HEURISTICS = ("greedy", "no-evict", "sglang", "watermark", "flow:adaptive=true")
COLUMNS = ("trace", "load", "controller", "requests", "completed", "rejected", "expired", "evictions",
           "goodput_frac", "slo_attainment", "ttft_p99_s", "tpot_p99_s", "kv_usage_mean", "fallbacks",
           "shield_intervention_rate")


def _window(segment, n: int, load: float) -> list[Arrival]:
    """The segment's first ``n`` requests replayed at ``load`` x lambda_max."""
    scale = load * segment.lambda_max_rps / segment.mean_rate_rps
    k = min(n, len(segment.times_s))
    return [Arrival(float(segment.times_s[i]) / scale, segment.prompts[i], segment.outputs[i],
                    segment.max_tokens[i]) for i in range(k)]


def evaluate(policy: str | Path | None = "checkpoints/policy.onnx", *, profile: str = "a100-llama2-7b",
             loads=(0.8, 1.0, 1.5, 2.0), requests: int = 2000, heuristics=DEFAULT_HEURISTICS,
             shield_mode: str = "soft", control_interval: int = 10, max_waiting: int = 512,
             queue_timeout_s: float | None = None, out: str | Path | None = None) -> list[dict]:
    """Goodput and friends of the learned controller and the heuristics on the evaluation split.

    :param policy: the exported ONNX policy (None: only the heuristics).
    :param profile: the profile name or path.
    :param loads: offered loads as multiples of lambda_max.
    :param requests: requests per run (the first N of each evaluation segment).
    :param heuristics: controller specs to compare with.
    :param shield_mode: the learned controller's shield mode.
    :param control_interval: engine steps per policy call (as in training).
    :param max_waiting: queue limit for every controller.
    :param queue_timeout_s: queue timeout for every controller (default 5 x TTFT SLO, as the env).
    :param out: write a Markdown table here.
    :return: one row per (trace, load, controller).
    """
    prof = load_profile(profile)
    timeout = queue_timeout_s or 5.0 * prof.ttft_slo_s
    rows = []
    for seg in split_segments(None, "eval", prof):
        for load in loads:
            arrivals = _window(seg, requests, load)
            runs = []
            if policy is not None:
                runs.append(("learned+shield", make_learned_controller(
                    policy, profile=prof, lambda_max_rps=seg.lambda_max_rps, control_interval=control_interval,
                    shield_mode=shield_mode, max_waiting=max_waiting, queue_timeout_s=timeout)))
            for spec in heuristics:
                sep = "," if ":" in spec else ":"
                runs.append((spec, build_controller(f"{spec}{sep}max_waiting={max_waiting},queue_timeout_s={timeout}",
                                                    prof)))
            for name, controller in runs:
                s = simulate(arrivals, prof, controller, record_steps=False).summary
                s.update(trace=seg.name, load=load, controller=name,
                         goodput_frac=s["goodput_rps"] / seg.lambda_max_rps,
                         fallbacks=getattr(getattr(controller, "inner", None), "fallback_total", 0),
                         shield_intervention_rate=getattr(controller, "intervention_rate", float("nan")))
                rows.append(s)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            f"Evaluation split: the last {1 - TRAIN_FRACTION:.0%} of splitwise_conv and all of splitwise_code, "
            f"first {requests} requests of each, profile {prof.name}; goodput_frac = goodput / lambda_max.\n\n"
            + markdown_table(rows, COLUMNS) + "\n")
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Evaluate the learned controller against the heuristics.")
    ap.add_argument("--policy", default="checkpoints/policy.onnx")
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--loads", default="0.8,1.0,1.5,2.0")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = evaluate(args.policy, profile=args.profile, loads=[float(x) for x in args.loads.split(",")],
                    requests=args.requests, out=args.out)
    print(markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
