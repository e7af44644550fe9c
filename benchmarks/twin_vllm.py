"""The twin against vLLM's CPU build: one fresh ``tidegate twin-check --engine vllm`` per workload.

    .venv/bin/python benchmarks/twin_vllm.py [--workload NAME ...] [--first 300] [--out docs/bench/twin_vllm]
        [--raw DIR]

Workloads (each a fresh vLLM server, the profile fitted on vLLM's step log around the check):

- ``splitwise_conv``: the Splitwise conversation trace, lengths x0.1 for the tiny model;
- ``shared_prefix_chat``: the shipped multi-turn chat behind one system prompt, lengths as they are.

Writes per workload the check's ``twin_report.json`` and ``profile.json`` into ``OUT/NAME/`` (a
check's step logs, per-request files and plots go to ``--raw DIR`` when given, never into the tree),
and ``twin_vllm.md`` / ``twin_vllm.json`` / ``twin_vllm.png`` over all of them: each figure's
relative error and the KS distances against the targets (TTFT and TPOT p50 and p99 within 10%, KS
TPOT <= 0.1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from tidegate.engine.bench.vllm.twin_check import run_vllm_twin_check
from tidegate.engine.core.figures import save_png

OUT = Path("docs/bench/twin_vllm")
WORKLOADS = {"splitwise_conv": {"trace": "splitwise_conv", "length_scale": 0.1},
             "shared_prefix_chat": {"trace": "shared_prefix_chat", "length_scale": 1.0}}
FIGURES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
BOUND, KS_BOUND = 0.10, 0.10


def row(name: str, report: dict) -> dict:
    m = report["metrics"]
    out = {"workload": name, "requests": report["requests"], "step_mape": report["step_time"]["mape"],
           "client_overhead_ms": 1e3 * report["client_overhead_s"], "ks_tpot": report["ks_distance"]["tpot_s"],
           "ks_ttft": report["ks_distance"]["ttft_s"],
           "cached_real": m["cached_prompt_tokens"]["real"], "cached_sim": m["cached_prompt_tokens"]["sim"]}
    for key in FIGURES:
        out[key] = m[key]["rel_error"]
        out[key + "_real"] = m[key]["real"]
    out["met"] = all(abs(out[k]) <= BOUND for k in FIGURES) and out["ks_tpot"] <= KS_BOUND
    return out


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| workload | requests | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | KS TTFT | KS TPOT | step MAPE "
             "| outside the engine | cached prompt tokens, vLLM / twin | targets |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['requests']} | " + " | ".join(f"{100 * r[k]:+.1f}%" for k in FIGURES)
                     + f" | {r['ks_ttft']:.3f} | {r['ks_tpot']:.3f} | {100 * r['step_mape']:.1f}% | "
                     f"{r['client_overhead_ms']:.1f} ms | {r['cached_real']:.0f} / {r['cached_sim']:.0f} | "
                     f"{'met' if r['met'] else 'missed'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(FIGURES))]
        ax.bar(xs, [100 * r[k] for k in FIGURES], width, label=r["workload"])
    ax.axhspan(-100 * BOUND, 100 * BOUND, color="green", alpha=0.1, label="target: within 10%")
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(FIGURES))],
                  ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"])
    ax.set_ylabel("twin against vLLM (%)")
    ax.axhline(0, color="black", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    ap.add_argument("--first", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--raw", type=Path, default=None, help="also keep each check's raw files (steps, requests) here")
    args = ap.parse_args()
    names = args.workload or list(WORKLOADS)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            report = run_vllm_twin_check(first_n=args.first, seed=args.seed, out_dir=tmp, log=print,
                                         **WORKLOADS[name])  # type: ignore[arg-type]
            keep = args.out / name
            keep.mkdir(exist_ok=True)
            for file in ("twin_report.json", "profile.json"):
                shutil.copy(Path(tmp) / file, keep / file)
            if args.raw:  # every file of the check but the model's
                shutil.copytree(tmp, args.raw / name, ignore=shutil.ignore_patterns("models"), dirs_exist_ok=True)
        print(report["table"])
        print(f"{name}: {time.monotonic() - t0:.0f} s")
        rows.append(row(name, report))
    command = "python benchmarks/twin_vllm.py " + " ".join(f"--workload {n}" for n in names) + f" --first {args.first}"
    (args.out / "twin_vllm.md").write_text(markdown(rows, command))
    (args.out / "twin_vllm.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out / "twin_vllm.png")
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
