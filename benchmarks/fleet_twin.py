"""The fleet twin at 16 replicas: the gateway's admission and routers against a plain round robin.

    python benchmarks/fleet_twin.py [--replicas 16] [--loads 0.8,1.2,1.5,2] [--out docs/bench/fleet_twin]

1. goodput: the Splitwise traces (``splitwise_conv``, ``splitwise_code``) on the A100 preset, at each load (a
   multiple of the fleet's capacity, 16 x one replica's), through ``--replicas`` replicas that schedule as vLLM
   does (``greedy``): the gateway with admission and predicted-delay routing against round robin without
   admission.
2. prefix affinity: ``benchmarks/workloads/fleet_chat.yaml`` (one 512-token system prompt, conversations of 2-8
   turns that resend their history, 11,850 requests) at ``--prefix-load``: the share of prompt tokens served from
   the replicas' prefix caches and the TTFT p99, prefix-affinity against least-loaded (both with admission).
3. speed: ``--speed-requests`` arrivals of ``splitwise_conv`` (the trace repeated) through the fleet at 1x, wall
   time on one core.

Writes ``fleet_twin.json``, ``fleet_twin.md`` and ``fleet_twin.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from tidegate.ctrl import build_controller
from tidegate.engine.bench.bench import rate_scale_for_load
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.gateway.twin import FleetSettings, simulate_fleet
from tidegate.engine.workloads import load_synthetic, read_trace, resolve_trace


def at_load(arrivals, profile, load: float, replicas: int):
    scale, _ = rate_scale_for_load(arrivals, profile, load)
    return [replace(a, arrival_time_s=a.arrival_time_s / (scale * replicas)) for a in arrivals]


def run(arrivals, profile, replicas: int, controller: str, **settings) -> dict:
    controllers = [build_controller(controller, profile, arrivals) for _ in range(replicas)]
    return simulate_fleet(arrivals, profile, controllers, FleetSettings(**settings))


def repeated(arrivals, n: int):
    """``n`` arrivals: the trace again and again, each copy after the last."""
    out, offset = [], 0.0
    span = arrivals[-1].arrival_time_s - arrivals[0].arrival_time_s + 1.0
    while len(out) < n:
        out.extend(replace(a, arrival_time_s=a.arrival_time_s + offset) for a in arrivals[:n - len(out)])
        offset += span
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--loads", default="0.8,1.2,1.5,2")
    ap.add_argument("--traces", default="splitwise_conv,splitwise_code")
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--controller", default="greedy", help="each replica's own scheduling")
    ap.add_argument("--prefix-load", type=float, default=0.8)
    ap.add_argument("--prefix-workload", type=Path, default=Path(__file__).parent / "workloads" / "fleet_chat.yaml")
    ap.add_argument("--speed-requests", type=int, default=100_000)
    ap.add_argument("--parts", default="goodput,prefix,speed")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/fleet_twin"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.profile)
    n = args.replicas
    parts = args.parts.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d"), "replicas": n, "profile": profile.name,
                 "controller": args.controller}
    if "goodput" in parts:
        res["goodput"] = []
        for trace in args.traces.split(","):
            base = read_trace(resolve_trace(trace))
            for load in (float(x) for x in args.loads.split(",")):
                arrivals = at_load(base, profile, load, n)
                row = {"trace": trace, "load": load}
                for arm, settings in (("gateway", {"router": "predicted-delay"}),
                                      ("round_robin", {"router": "round-robin", "admission": False})):
                    s = run(arrivals, profile, n, args.controller, **settings)
                    row[arm] = {k: s[k] for k in ("goodput_rps", "completed", "rejected", "expired", "ttft_p50_s",
                                                  "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "wall_time_s")}
                row["ratio"] = row["gateway"]["goodput_rps"] / max(row["round_robin"]["goodput_rps"], 1e-12)
                print(f"{trace} {load}x: gateway {row['gateway']['goodput_rps']:.2f}, round robin "
                      f"{row['round_robin']['goodput_rps']:.2f} req/s ({row['ratio']:.2f}x)", flush=True)
                res["goodput"].append(row)
    if "prefix" in parts:
        chat = load_synthetic(args.prefix_workload, seed=0)
        arrivals = at_load(chat, profile, args.prefix_load, n)
        prompt_tokens = sum(a.prompt_tokens for a in arrivals)
        res["prefix"] = {}
        for router in ("prefix-affinity", "least-loaded"):
            s = run(arrivals, profile, n, args.controller, router=router)
            res["prefix"][router] = {"cache_hit_rate": s["cached_prompt_tokens"] / prompt_tokens,
                                     "load": args.prefix_load, "ttft_p99_s": s["ttft_p99_s"],
                                     "goodput_rps": s["goodput_rps"], "gateway": s["gateway"]}
            print(f"prefix {router}: hit rate {res['prefix'][router]['cache_hit_rate']:.3f}, TTFT p99 "
                  f"{s['ttft_p99_s']:.3f} s", flush=True)
    if "speed" in parts:
        base = read_trace(resolve_trace("splitwise_conv"))
        arrivals = at_load(repeated(base, args.speed_requests), profile, 1.0, n)
        s = run(arrivals, profile, n, args.controller)
        res["speed"] = {"requests": len(arrivals), "wall_time_s": s["wall_time_s"], "completed": s["completed"]}
        print(f"speed: {len(arrivals)} requests through {n} replicas in {s['wall_time_s']:.1f} s", flush=True)
    (args.out / "fleet_twin.json").write_text(json.dumps(res, indent=2))
    report(res, args.out)


def report(res: dict, out: Path) -> None:
    lines = [f"# The fleet twin, {res['replicas']} replicas of {res['profile']} ({res['date']})", ""]
    if res.get("goodput"):
        lines += ["| trace | load | gateway goodput | round robin | ratio | gateway refused | gateway TTFT p99 | "
                  "round robin TTFT p99 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["goodput"]:
            g, rr = r["gateway"], r["round_robin"]
            lines.append(f"| {r['trace']} | {r['load']}x | {g['goodput_rps']:.2f} | {rr['goodput_rps']:.2f} | "
                         f"**{r['ratio']:.2f}x** | {g['rejected']} | {g['ttft_p99_s']:.2f} s | "
                         f"{rr['ttft_p99_s']:.2f} s |")
    if res.get("prefix"):
        lines += ["", "| router | prefix-cache hit rate | TTFT p99 | goodput |", "|---|---:|---:|---:|"]
        for router, r in res["prefix"].items():
            lines.append(f"| {router} | {r['cache_hit_rate']:.3f} | {r['ttft_p99_s']:.2f} s | "
                         f"{r['goodput_rps']:.2f} |")
    if res.get("speed"):
        sp = res["speed"]
        lines += ["", f"Speed: {sp['requests']:,} requests through {res['replicas']} replicas in "
                      f"{sp['wall_time_s']:.1f} s of wall time."]
    (out / "fleet_twin.md").write_text("\n".join(lines) + "\n")
    if res.get("goodput"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for trace in dict.fromkeys(r["trace"] for r in res["goodput"]):
            rows = [r for r in res["goodput"] if r["trace"] == trace]
            ax.plot([r["load"] for r in rows], [r["gateway"]["goodput_rps"] for r in rows], "o-",
                    label=f"{trace}: gateway")
            ax.plot([r["load"] for r in rows], [r["round_robin"]["goodput_rps"] for r in rows], "x--",
                    label=f"{trace}: round robin")
        ax.set_xlabel("load (x the fleet's capacity)")
        ax.set_ylabel("goodput (req/s)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save_png(fig, out / "fleet_twin.png", dpi=120)


if __name__ == "__main__":
    main()
