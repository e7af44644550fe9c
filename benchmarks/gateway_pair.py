"""The twin of ``benchmarks/gateway.py``'s pair: two replicas of the tiny model's profile, the second with half the
first's KV cache, behind the gateway (its admission and the predicted-delay router) and behind a plain round robin,
in the fleet twin.

    python benchmarks/gateway_pair.py [--replica-controller greedy] [--loads 0.8,1.2,2,3] --out DIR

Poisson arrivals of 256 prompt and 64 output tokens (the real benchmark's shape), 500 s of them at each load, a
multiple of the pair's fluid bound (the two replicas' bounds summed). The twin runs on its virtual clock: the
figures are the same on a busy machine. Writes ``gateway_pair.md`` and ``gateway_pair.png`` (goodput against
load) to ``--out``, and ``gateway_pair.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from tidegate.ctrl import build_controller
from tidegate.ctrl.theory import capacity
from tidegate.engine.cli.support import fail
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.gateway.twin import FleetSettings, simulate_fleet
from tidegate.engine.workloads.synthetic import load_synthetic
from tidegate.training.cli import parse_list

WORKLOAD = {"name": "pair256x64", "arrival": {"process": "poisson"}, "duration_s": 500, "seed": 0, "max_tokens": 64,
            "classes": [{"rate_rps": 10, "prompt_tokens": 256, "output_tokens": 64}]}
ARMS = {"gateway": FleetSettings(), "round robin": FleetSettings(router="round-robin", admission=False)}


def run(controller: str, loads: list[float]) -> list[dict]:
    tiny = load_profile("tiny-cpu")
    pair = [tiny, replace(tiny, kv_capacity_tokens=tiny.kv_capacity_tokens // 2)]
    base = load_synthetic(WORKLOAD)
    bound = sum(capacity([a.prompt_tokens for a in base], [a.output_tokens for a in base], p).lambda_max_rps
                for p in pair)
    base_rate = len(base) / base[-1].arrival_time_s
    rows = []
    for load in loads:
        stretch = base_rate / (load * bound)  # > 1 slows the arrivals down: keep the same 500 s of them
        arrivals = [replace(a, arrival_time_s=a.arrival_time_s * stretch)
                    for a in base[: int(len(base) * min(1.0, 1.0 / stretch))]]
        row: dict = {"load": load, "requests": len(arrivals)}
        for name, settings in ARMS.items():
            s = simulate_fleet(arrivals, pair, [build_controller(controller, p, arrivals) for p in pair], settings)
            row[name] = {"goodput_rps": s["goodput_rps"], "preemptions": s["evictions"],
                         "refused": s["gateway"]["rejected"], "served": s["completed"]}
        print(f"load {load:g}: " + ", ".join(f"{n} {row[n]['goodput_rps']:.2f} req/s, {row[n]['preemptions']} "
                                            "preempted" for n in ARMS), flush=True)
        rows.append(row)
    return rows


def write(rows: list[dict], controller: str, out: Path) -> None:
    lines = [f"# The pair in the twin: tiny-cpu and tiny-cpu with half its KV, `{controller}` replicas", "",
             "| load | requests | gateway goodput req/s | preempted | refused "
             "| round robin goodput req/s | preempted |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g, rr = r["gateway"], r["round robin"]
        lines.append(f"| {r['load']:g}x | {r['requests']} | {g['goodput_rps']:.2f} | {g['preemptions']} | "
                     f"{g['refused']} | {rr['goodput_rps']:.2f} | {rr['preemptions']} |")
    (out / "gateway_pair.md").write_text("\n".join(lines) + "\n")
    (out / "gateway_pair.json").write_text(json.dumps({"controller": controller, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in ARMS:
        ax.plot([r["load"] for r in rows], [r[name]["goodput_rps"] for r in rows], marker="o", label=name)
    ax.set_xlabel("load (x the pair's fluid bound)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(f"the pair in the twin, {controller} replicas")
    ax.legend()
    fig.tight_layout()
    save_png(fig, out / "gateway_pair.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replica-controller", default="greedy", help="the replicas' own controller")
    ap.add_argument("--loads", default="0.8,1.2,2,3", help="multiples of the pair's fluid bound")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        loads = parse_list(args.loads, "--loads", float, "numbers like 0.8,1.2,2")
        build_controller(args.replica_controller, load_profile("tiny-cpu"), [])
    except ValueError as exc:  # OptionError, ControllerSpecError: one sentence each
        fail(str(exc))
    if any(not x > 0 for x in loads):
        fail(f"--loads {args.loads!r} is not valid: every load must be above 0")
    args.out.mkdir(parents=True, exist_ok=True)
    write(run(args.replica_controller, loads), args.replica_controller, args.out)
    print(f"wrote {args.out}/gateway_pair.md, gateway_pair.png, gateway_pair.json")


if __name__ == "__main__":
    main()
