"""Refusals at light Poisson load in the simulator, and whether the replica was overloaded anyway.

    .venv/bin/python benchmarks/light_load_sim.py --out docs/bench/matrix [--profile tiny-cpu --profile ...]

For the Poisson families at loads 0.3, 0.5 and 0.7 x lambda_max (``--draws`` TEST draws of 1,500
requests each, eight by default: the matrix's six and two more), each controller's refusals and
goodput, and for greedy (which refuses only the requests that can never fit into the replica's KV,
a column of their own) the share of requests that missed their TTFT or TPOT SLO: where greedy
misses many, the nominal load is not light for this replica under its SLOs
(lambda_max is a throughput bound that ignores the TPOT SLO's cap on a step's tokens). On each
``--profile`` (default: the A100 preset), a row per profile, family and load.
Writes ``light_load.md`` and ``light_load.json`` into OUT.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tidegate.training.evaluate import TEST, evaluate

POISSON = ("chat", "short", "long-context", "multi-class")
LOADS = (0.3, 0.5, 0.7)


def light_row(cell: list[dict], family: str, load: float) -> dict:
    """The table's row of one cell's evaluation rows."""

    def total(name: str, key: str) -> float:
        return sum(r[key] for r in cell if r["controller"] == name)

    def mean(name: str, key: str) -> float:
        vals = [r[key] for r in cell if r["controller"] == name]
        return sum(vals) / len(vals)

    return {"family": family, "load": load, "requests": int(total("greedy", "requests")),
            "learned_refusals": int(total("learned", "rejected")),
            "slo_flow_refusals": int(total("slo-flow", "rejected")),
            "never_fit": int(total("greedy", "rejected")),
            "greedy_missed_slo": 1.0 - mean("greedy", "slo_attainment"),
            "learned_goodput": mean("learned", "goodput_frac"),
            "slo_flow_goodput": mean("slo-flow", "goodput_frac"),
            "greedy_goodput": mean("greedy", "goodput_frac")}


def light_load(policy: Path, out: Path, requests: int = 1500, draws: int = 8,
               profiles: tuple[str, ...] = ("a100-llama2-7b",), **opts) -> list[dict]:
    """Simulate the Poisson families at light load with ``policy``, greedy and slo-flow; write
    ``light_load.json`` and ``light_load.md`` into ``out``; return the table's rows.

    :param opts: passed to ``training.evaluate.evaluate`` (``workers``, ``backend``, ``address``).
    """
    rows = evaluate({"learned": policy}, families=list(POISSON), loads=LOADS, seeds=tuple(range(draws)),
                    requests=requests, heuristics=("greedy", "slo-flow"), purpose=TEST, profile=list(profiles),
                    **opts)
    table = []
    for prof in profiles:
        for fam in POISSON:
            for load in LOADS:
                cell = [r for r in rows if r["family"] == fam and r["load"] == load and r["profile"] == str(prof)]
                name = f"{fam} @ {Path(prof).stem}" if len(profiles) > 1 else fam
                table.append(light_row(cell, name, load))
    out.mkdir(parents=True, exist_ok=True)
    (out / "light_load.json").write_text(json.dumps(table, indent=1))
    lines = ["| family | load | requests | learned refusals | slo-flow refusals | of them, never fit "
             "| greedy: share missing its SLO | goodput learned | slo-flow | greedy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['family']} | {t['load']} | {t['requests']} | {t['learned_refusals']} | "
                     f"{t['slo_flow_refusals']} | {t['never_fit']} | {t['greedy_missed_slo']:.1%} | "
                     f"{t['learned_goodput']:.3f} | "
                     f"{t['slo_flow_goodput']:.3f} | {t['greedy_goodput']:.3f} |")
    (out / "light_load.md").write_text("\n".join(lines) + "\n")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", type=Path, default=None, help="ONNX policy (default: the shipped one).")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/matrix"))
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--draws", type=int, default=8, help="TEST draws per (family, load).")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--profile", action="append", default=None,
                    help="a profile (name or file), repeatable (default: a100-llama2-7b).")
    args = ap.parse_args()
    from tidegate.ctrl.learned import DEFAULT_POLICY

    light_load(args.policy or DEFAULT_POLICY, args.out, args.requests, args.draws,
               tuple(args.profile or ("a100-llama2-7b",)), workers=args.workers)
    print((args.out / "light_load.md").read_text())


if __name__ == "__main__":
    main()
