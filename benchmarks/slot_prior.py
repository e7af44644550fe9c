"""slo-flow against greedy on Dong & Cao's slot model, at loads near the memory's stability bound.

    .venv/bin/python benchmarks/slot_prior.py [--loads 0.9,0.95,0.99,1.3] [--slots 2000] [--three-classes]

One class (20 prompt and 20 output tokens) arrives at evenly spaced times at each load, a multiple of the memory's
bound M / W on the ``slot`` profile (a step is one time unit, prefill costs memory but no time). Each controller's
goodput, refusals, evictions, TTFT and the mean queue in the run's first and second half (a queue that grows for as
long as the arrivals last shows the activation rate is slower than they are). ``slo-flow:stable_rate=False``
activates at ``rho M / w_hat`` alone, as the learned policy's prior does.

``--three-classes`` adds two Poisson mixes at 0.96 of the memory's bound: 10/10, 20/20 and 30/30 tokens at 5.35,
1.07 and 0.321 a slot for 3,000 slots (``max_tokens`` 64), and ``paper_sec41``'s 20/20 at 0.8 with 60/100 and 40/50
at 0.1 a slot each for 10,000 slots (``max_tokens`` 128).
"""

from __future__ import annotations

import argparse

from tidegate.ctrl import build_controller
from tidegate.ctrl.theory import lifetime_kv_workload
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import Arrival
from tidegate.engine.workloads.synthetic import load_synthetic

CONTROLLERS = ("greedy", "slo-flow", "slo-flow:stable_rate=False", "learned")
#: the three-class mixes (name, slots of arrivals, max_tokens, (rate a slot, prompt, output) per class)
THREE_CLASSES = (("three classes, small", 3000.0, 64, ((5.35, 10, 10), (1.07, 20, 20), (0.321, 30, 30))),
                 ("three classes, paper_sec41's two and one more", 10000.0, 128,
                  ((0.8, 20, 20), (0.1, 60, 100), (0.1, 40, 50))))


def _loads(text: str) -> list[float]:
    """``--loads``: positive numbers, comma-separated."""
    try:
        loads = [float(x) for x in text.split(",")]
    except ValueError:
        loads = []
    if not loads or not all(x > 0 for x in loads):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive loads")
    return loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=_loads, default="0.9,0.95,0.99,1.3", help="multiples of the memory's bound M / W")
    ap.add_argument("--slots", type=float, default=2000.0, help="time units of arrivals")
    ap.add_argument("--controllers", default=",".join(CONTROLLERS))
    ap.add_argument("--three-classes", action="store_true", help="also the two three-class Poisson mixes")
    args = ap.parse_args()
    slot = load_profile("slot")
    try:  # a controller name or option it does not know: one sentence, exit 2
        for spec in args.controllers.split(","):
            build_controller(spec, slot)
    except ValueError as exc:
        ap.error(str(exc))
    controllers = [(spec, lambda spec=spec: build_controller(spec, slot)) for spec in args.controllers.split(",")]
    prompt = output = 20
    w = lifetime_kv_workload(prompt, output)
    print("| load | controller | goodput per slot | refused | evictions | TTFT p50 / p99 "
          "| mean queue, 1st / 2nd half |")
    print("|---|---|---:|---:|---:|---|---|")
    runs: list[tuple[str, list[Arrival]]] = []
    for load in args.loads:
        per_slot = load * slot.kv_capacity_tokens / w
        runs.append((f"{load:g}", [Arrival(i / per_slot, prompt, output, output, 0)
                                   for i in range(int(args.slots * per_slot))]))
    if args.three_classes:
        for name, slots, max_tokens, classes in THREE_CLASSES:
            spec = {"name": name, "arrival": {"process": "poisson"}, "duration_s": slots, "seed": 0,
                    "max_tokens": max_tokens, "classes": [{"rate_rps": r, "prompt_tokens": p, "output_tokens": o}
                                                          for r, p, o in classes]}
            runs.append((name, load_synthetic(spec)))
    for load_name, arrivals in runs:
        for spec, controller in controllers:
            run = simulate(arrivals, slot, controller())
            s, waiting = run.summary, run.core.metrics.step_waiting
            half = len(waiting) // 2
            first, second = sum(waiting[:half]) / max(half, 1), sum(waiting[half:]) / max(len(waiting) - half, 1)
            print(f"| {load_name} | {spec} | {s['goodput_rps']:.3f} | {s['rejected']} | {s['evictions']} | "
                  f"{s['ttft_p50_s']:.1f} / {s['ttft_p99_s']:.1f} | {first:.1f} / {second:.1f} |", flush=True)


if __name__ == "__main__":
    main()
