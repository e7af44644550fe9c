"""The gateway's own admission rule in the fleet twin, and two versions of it compared cell by cell.

    python benchmarks/gateway_rule.py run --out DIR [--loads 0.5,0.8,1.2,2,3] [--draws 0,1,2]
    python benchmarks/gateway_rule.py compare DIR_BEFORE DIR_AFTER --out DIR

``run`` serves whole episodes of the fleet env (the config's fleet: 4 replicas of the A100 preset that
schedule as vLLM does, or as ``--replica-controller`` says, behind the predicted-delay router, 128 s of
arrivals, then the drain) at action 0, the gateway's own rule, for every family of the config (training and
held-out) at each load (a multiple of the fleet's fluid bound), on test draws that neither training nor
validation saw. Each episode records goodput, SLO misses, refusals, the prompt tokens of the requests that met
both SLOs, and how the longest tenth of the episode's prompts fared.
It writes ``rule.json``.

``compare`` pairs two such runs (the same cells; say, the tree before a change on ``PYTHONPATH`` and the
tree after) and writes ``gateway_rule.md`` (goodput after / before per cell, geometric means, misses and
refusals, the prompt tokens served in time, the long prompts' share served in time) and
``gateway_rule.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tidegate.engine.core.slo import met_slo
from tidegate.engine.core.request import RequestState
from tidegate.engine.cli.support import fail
from tidegate.engine.workloads.arrivals import WorkloadError
from tidegate.env.fleet_env import FleetEnv
from tidegate.training.cli import OptionError, parse_list
from tidegate.training.fleet_eval import TEST_SEED_BASE, fleet_config, plot_ratios, run_episode

#: the share of an episode's prompts counted as long: its longest tenth
LONG_QUANTILE = 0.9


def run_cell(env: FleetEnv, family: str, load: float, draw: int) -> dict:
    """One whole episode at action 0, with how each request's prompt fared."""
    ends: list[tuple[int, bool]] = []  # (prompt tokens, met both SLOs)
    ttft, tpot = env.profile.ttft_slo_s, env.profile.tpot_slo_s

    def on_end(request) -> None:
        ends.append((request.prompt_len, request.state is RequestState.FINISHED and met_slo(request, ttft, tpot)))

    out = run_episode(env, lambda _obs: 0.0, TEST_SEED_BASE + draw, {"load": load}, on_end=on_end)
    prompts = np.array([p for p, _ in ends])
    good = np.array([g for _, g in ends])
    long = prompts > np.quantile(prompts, LONG_QUANTILE)
    return {"family": family, "load": load, "draw": draw, "requests": len(ends), "good": out["good"],
            "missed": out["missed"], "rejected": out["rejected"], "goodput_rps": out["goodput_rps"],
            "good_prompt_tokens": int(prompts[good].sum()), "long": int(long.sum()),
            "long_good": int((long & good).sum())}


def run(args) -> None:
    env_kwargs, families, _ = fleet_config(args.families)
    if args.replica_controller:
        env_kwargs["replica_controller"] = args.replica_controller
    loads = parse_list(args.loads, "--loads", float, "numbers like 0.5,1.2")
    draws = parse_list(args.draws, "--draws", int, "integers like 0,1,2")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, t0, n = [], time.perf_counter(), len(families) * len(loads) * len(draws)
    for family in families:
        env = FleetEnv(families=[family], baseline="none", drain=True, **env_kwargs)
        for load in loads:
            for draw in draws:
                rows.append(run_cell(env, family, load, draw))
                print(f"\r{len(rows)}/{n} episodes, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    (args.out / "rule.json").write_text(json.dumps(rows, indent=1))


def read_run(folder: Path) -> dict[tuple[str, float, int], dict]:
    """A ``run`` folder's episodes by (family, load, draw); exits with one sentence where there is none."""
    path = folder / "rule.json"
    try:
        rows = json.loads(path.read_text())
        return {(r["family"], r["load"], r["draw"]): r for r in rows}
    except OSError:
        fail(f"{path}: not found (make it with: gateway_rule.py run --out {folder})")
    except (ValueError, TypeError, KeyError):
        fail(f"{path}: not a rule.json written by gateway_rule.py run")


def compare(args) -> None:
    before, after = read_run(args.before), read_run(args.after)
    keys = [k for k in before if k in after]
    if not keys:
        fail("the two runs share no cell")
    cells = defaultdict(list)
    for k in keys:
        cells[k[:2]].append(k)
    families = list(dict.fromkeys(k[0] for k in keys))
    loads = sorted({k[1] for k in keys})

    def total(rows, field):
        return sum(r[field] for r in rows)

    ratios: dict[tuple[str, float], float] = {}
    lines = ["| family | load | goodput before | after | after / before | missed before -> after | "
             "refused before -> after | prompt tokens in time, after / before | "
             "long prompts in time, before -> after |",
             "|---|---:|---:|---:|---:|---|---|---:|---|"]
    for f in families:
        for ld in loads:
            ks = cells.get((f, ld))
            if not ks:
                continue
            b, a = [before[k] for k in ks], [after[k] for k in ks]
            paired = [math.log(x["goodput_rps"] / y["goodput_rps"]) for x, y in zip(a, b) if y["goodput_rps"] > 0]
            ratios[(f, ld)] = math.exp(float(np.mean(paired))) if paired else math.nan
            tokens = total(a, "good_prompt_tokens") / max(total(b, "good_prompt_tokens"), 1)
            lines.append(
                f"| {f} | {ld:g} | {np.mean([x['goodput_rps'] for x in b]):.2f} | "
                f"{np.mean([x['goodput_rps'] for x in a]):.2f} | {ratios[(f, ld)]:.3f} | "
                f"{total(b, 'missed')} -> {total(a, 'missed')} | {total(b, 'rejected')} -> {total(a, 'rejected')} | "
                f"{tokens:.3f} | {total(b, 'long_good') / max(total(b, 'long'), 1):.0%} -> "
                f"{total(a, 'long_good') / max(total(a, 'long'), 1):.0%} |")
    logs_all = [math.log(after[k]["goodput_rps"] / before[k]["goodput_rps"]) for k in keys
                if before[k]["goodput_rps"] > 0 and after[k]["goodput_rps"] > 0]
    logs_high = [math.log(after[k]["goodput_rps"] / before[k]["goodput_rps"]) for k in keys
                 if k[1] >= 1.2 and before[k]["goodput_rps"] > 0 and after[k]["goodput_rps"] > 0]
    light = [k for k in keys if k[1] <= 0.8]
    lines += ["", "Geometric mean of goodput after / before, draw by draw: all loads "
                  f"**{math.exp(np.mean(logs_all)):.3f}**, loads >= 1.2 **{math.exp(np.mean(logs_high)):.3f}**; "
                  f"worst draw {math.exp(min(logs_all)):.3f}, "
                  f"worst cell (mean of its draws) {min(ratios.values()):.3f}. At loads <= 0.8, refusals "
                  f"{sum(before[k]['rejected'] for k in light)} -> {sum(after[k]['rejected'] for k in light)} of "
                  f"{sum(before[k]['requests'] for k in light)} arrivals. {len(keys)} episodes a side; "
                  f"long prompts are each episode's longest tenth."]
    args.out.mkdir(parents=True, exist_ok=True)
    report = "\n".join(lines) + "\n"
    (args.out / "gateway_rule.md").write_text(report)
    plot_ratios({f: [ratios.get((f, ld), math.nan) for ld in loads] for f in families}, loads,
                "goodput, after / before", "The gateway's admission rule: after the change against before",
                args.out / "gateway_rule.png")
    print(report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--loads", default="0.5,0.8,1.2,2,3")
    r.add_argument("--draws", default="0,1,2", help="test draws per (family, load)")
    r.add_argument("--families", default=None, help="default: the config's training and held-out families")
    r.add_argument("--replica-controller", default=None,
                   help="each replica's own controller (default: the config's, greedy: vLLM's scheduling)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        run(args) if args.cmd == "run" else compare(args)
    except (OptionError, WorkloadError, ValueError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
