"""Prefix caching in the twin and in the real engine.

    .venv/bin/python benchmarks/prefix_cache.py twin --trace conversation_trace.jsonl [--out docs/bench/prefix_cache]
    .venv/bin/python benchmarks/prefix_cache.py real [--first 300] [--fit-around] [--pin-cpu N] [--out ...]

``twin``: a Mooncake-format trace (``hash_ids``) simulated with caching off and on, at the profile's
KV capacity and at multiples of it (what a larger cache, a KV pool beyond one GPU's memory, would
reuse), at ``--load`` times the fluid bound. Each row gives the prefill tokens, the share the cache
saved, TTFT and the simulator's wall time; beside it, the share an LRU over the trace's own 512-token
blocks of the same size saves taking the requests one after another (no timing: a cross-check of
the engine's cache, not a target). Writes ``twin.md``, ``twin.json`` and ``twin.png``.

``real``: the twin check (``tidegate twin-check``) of the shipped ``shared_prefix_chat`` workload,
once with caching on and once off, on the tiny model: the real engine's TTFT p50 with and without
the cache, and the twin's (``--fit-around``: each check's profile fitted on the workload's next
requests, served before and after it, and ``--pin-cpu``: on that core alone, the twin check's own
recipe; or ``--profile``). Writes ``real.md``, ``real.json`` and ``real.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

from tidegate.ctrl import build_controller
from tidegate.engine.bench.bench import rate_scale_for_load
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import read_trace

OUT = Path("docs/bench/prefix_cache")
MOONCAKE_BLOCK = 512


def lru_saving(arrivals, capacity_tokens: int) -> float:
    """The share of prompt tokens an LRU cache of ``capacity_tokens`` over the trace's content ids finds,
    taking the requests one after another (each keeps at least one token to compute)."""
    cache: OrderedDict[int, None] = OrderedDict()
    runs = max(1, capacity_tokens // MOONCAKE_BLOCK)
    total = hit = 0
    for a in arrivals:
        k = 0
        while k < len(a.prefix_ids) and a.prefix_ids[k] in cache:
            k += 1
        hit += min(int(k * a.prefix_block_tokens), a.prompt_tokens - 1) if k else 0
        total += a.prompt_tokens
        for content in a.prefix_ids:
            cache[content] = None
            cache.move_to_end(content)
        while len(cache) > runs:
            cache.popitem(last=False)
    return hit / total


def twin(trace: str, profile_name: str, load: float, multiples: list[int], out: Path) -> list[dict]:
    base = read_trace(trace)
    if not any(a.prefix_ids for a in base):
        raise SystemExit(f"{trace}: no hash_ids in the trace; the cache has nothing to match")
    profile = load_profile(profile_name)
    scale, _ = rate_scale_for_load(base, profile, load)
    arrivals = [replace(a, arrival_time_s=a.arrival_time_s / scale) for a in base]
    rows = []
    for multiple in multiples:
        prof = replace(profile, kv_capacity_tokens=profile.kv_capacity_tokens * multiple)
        runs = {}
        for caching in (False, True):
            t0 = time.perf_counter()
            s = simulate(arrivals, prof, build_controller("greedy", prof, arrivals), record_steps=False,
                         keep_requests=False, prefix_caching=caching).summary
            runs[caching] = (s, time.perf_counter() - t0)
            print(f"  KV x{multiple} caching {'on ' if caching else 'off'}: prefill {s['prefill_tokens']:,} "
                  f"cached {s['cached_prompt_tokens']:,} TTFT p50 {s['ttft_p50_s']:.3g} s "
                  f"({runs[caching][1]:.1f} s wall)", flush=True)
        (off, off_s), (on, on_s) = runs[False], runs[True]
        rows.append({"kv_capacity_tokens": prof.kv_capacity_tokens, "multiple": multiple,
                     "prefill_off": off["prefill_tokens"], "prefill_on": on["prefill_tokens"],
                     "cached_on": on["cached_prompt_tokens"],
                     "prefill_saved": 1 - on["prefill_tokens"] / off["prefill_tokens"],
                     "lru_saved": lru_saving(base, prof.kv_capacity_tokens),
                     "ttft_p50_off_s": off["ttft_p50_s"], "ttft_p50_on_s": on["ttft_p50_s"],
                     "ttft_p99_off_s": off["ttft_p99_s"], "ttft_p99_on_s": on["ttft_p99_s"],
                     "evictions_off": off["evictions"], "evictions_on": on["evictions"],
                     "wall_off_s": off_s, "wall_on_s": on_s})
    out.mkdir(parents=True, exist_ok=True)
    (out / "twin.json").write_text(json.dumps(rows, indent=1) + "\n")
    head = (f"{len(base):,} requests of {Path(trace).name} at {load} x the fluid bound on {profile_name} "
            f"(greedy), caching off and on")
    lines = [head, "", "| KV capacity (tokens) | prefill off | prefill on | saved | LRU over the trace's blocks "
             "| TTFT p50 off / on (s) | TTFT p99 off / on (s) | sim wall off / on (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kv_capacity_tokens']:,} (x{r['multiple']}) | {r['prefill_off']:,} | {r['prefill_on']:,} "
                     f"| **{r['prefill_saved']:.1%}** | {r['lru_saved']:.1%} | {r['ttft_p50_off_s']:.3g} / "
                     f"{r['ttft_p50_on_s']:.3g} | {r['ttft_p99_off_s']:.3g} / {r['ttft_p99_on_s']:.3g} | "
                     f"{r['wall_off_s']:.1f} / {r['wall_on_s']:.1f} |")
    (out / "twin.md").write_text("\n".join(lines) + "\n")
    _plot_twin(rows, head, out / "twin.png")
    return rows


def _plot_twin(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cap = [r["kv_capacity_tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(cap, [100 * r["prefill_saved"] for r in rows], "o-", label="the twin (engine's cache)")
    left.plot(cap, [100 * r["lru_saved"] for r in rows], "s--", label="LRU over the trace's blocks, in order")
    left.set(xscale="log", xlabel="KV capacity (tokens)", ylabel="prefill tokens saved (%)")
    left.legend()
    right.plot(cap, [r["ttft_p50_off_s"] for r in rows], "o-", label="TTFT p50, caching off")
    right.plot(cap, [r["ttft_p50_on_s"] for r in rows], "o-", label="TTFT p50, caching on")
    right.set(xscale="log", yscale="log", xlabel="KV capacity (tokens)", ylabel="seconds")
    right.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def real(first_n: int, rate_scale: float, out: Path, profile: str = "tiny-cpu", pin_cpu: int | None = None,
         fit_around: bool = False) -> dict:
    import os

    import torch

    from tidegate.engine.twin.check import run_twin_check

    if pin_cpu is not None:
        os.sched_setaffinity(0, {pin_cpu})
        torch.set_num_threads(1)

    reports = {}
    for caching in (True, False):
        print(f"twin check, caching {'on' if caching else 'off'}", flush=True)
        reports[caching] = run_twin_check(model="tiny", trace="shared_prefix_chat", first_n=first_n,
                                          length_scale=1.0, rate_scale=rate_scale, max_tokens=128,
                                          profile_name=profile, out_dir=out / ("on" if caching else "off"),
                                          prefix_caching=caching, fit_around=fit_around, log=print)
    row = {}
    for side in ("real", "sim"):
        on, off = reports[True][f"{side}_summary"], reports[False][f"{side}_summary"]
        row[side] = {"ttft_p50_on_s": on["ttft_p50_s"], "ttft_p50_off_s": off["ttft_p50_s"],
                     "ttft_p99_on_s": on["ttft_p99_s"], "ttft_p99_off_s": off["ttft_p99_s"],
                     "prefill_on": on["prefill_tokens"], "prefill_off": off["prefill_tokens"],
                     "cached_on": on["cached_prompt_tokens"],
                     "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"]}
    row["ratio_error"] = row["sim"]["ttft_p50_ratio"] / row["real"]["ttft_p50_ratio"] - 1
    row["metrics_on"] = {k: v["rel_error"] for k, v in reports[True]["metrics"].items() if "rel_error" in v}
    row["metrics_off"] = {k: v["rel_error"] for k, v in reports[False]["metrics"].items() if "rel_error" in v}
    out.mkdir(parents=True, exist_ok=True)
    (out / "real.json").write_text(json.dumps(row, indent=1, default=float) + "\n")
    r, s = row["real"], row["sim"]
    where = f", pinned to core {pin_cpu}" if pin_cpu is not None else ""
    if fit_around:
        profile = "fitted around each check on the next requests of the workload (--fit-around)"
    lines = [f"{first_n} requests of shared_prefix_chat (rate x{rate_scale}) on the tiny model{where}, greedy; the "
             f"twin with the profile {profile if fit_around else Path(profile).name}", "",
             "| | TTFT p50 off (ms) | TTFT p50 on (ms) | on / off | TTFT p99 off / on (ms) | prefill tokens off / on "
             "| cached prompt tokens |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, v in (("real engine", r), ("twin", s)):
        lines.append(f"| {name} | {1e3 * v['ttft_p50_off_s']:.1f} | {1e3 * v['ttft_p50_on_s']:.1f} | "
                     f"**{v['ttft_p50_ratio']:.3f}** | {1e3 * v['ttft_p99_off_s']:.1f} / "
                     f"{1e3 * v['ttft_p99_on_s']:.1f} | {v['prefill_off']:,} / {v['prefill_on']:,} | "
                     f"{v['cached_on']:,} |")
    lines += ["", f"The twin's on/off ratio against the real one's: {row['ratio_error']:+.1%}."]
    (out / "real.md").write_text("\n".join(lines) + "\n")
    _plot_real(row, out / "real.png")
    return row


def _plot_real(row: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["caching off", "caching on"]
    for k, (side, label) in enumerate((("real", "real engine"), ("sim", "twin"))):
        v = row[side]
        ax.bar([x + 0.38 * k for x in range(2)], [1e3 * v["ttft_p50_off_s"], 1e3 * v["ttft_p50_on_s"]], 0.36,
               label=label)
    ax.set_xticks([0.19, 1.19], names)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("shared_prefix_chat on the tiny model", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("twin", help="a Mooncake-format trace in the simulator, caching off and on")
    t.add_argument("--trace", required=True, help="a Mooncake-format JSONL trace with hash_ids")
    t.add_argument("--profile", default="h200-llama3-8b")
    t.add_argument("--load", type=float, default=0.8)
    t.add_argument("--multiples", default="1,4,16", help="KV capacities as multiples of the profile's")
    t.add_argument("--out", type=Path, default=OUT)
    r = sub.add_parser("real", help="the twin check of shared_prefix_chat, caching on and off")
    r.add_argument("--first", type=int, default=300)
    r.add_argument("--rate-scale", type=float, default=1.0)
    r.add_argument("--profile", default="tiny-cpu", help="the twin's profile (a name or a file)")
    r.add_argument("--pin-cpu", type=int, default=None, help="run on this core alone, one torch thread")
    r.add_argument("--fit-around", action="store_true",
                   help="fit each check's profile on the workload's next requests, served before and after it")
    r.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.what == "twin":
        twin(args.trace, args.profile, args.load, [int(x) for x in args.multiples.split(",")], args.out)
        print((args.out / "twin.md").read_text())
    else:
        real(args.first, args.rate_scale, args.out, args.profile, args.pin_cpu, args.fit_around)
        print((args.out / "real.md").read_text())


if __name__ == "__main__":
    main()
