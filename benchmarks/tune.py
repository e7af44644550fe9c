"""``tidegate tune`` on a request log nobody trained on, measured end to end.

    python benchmarks/tune.py [--log summarisation|FILE] [--timesteps 40000] [--minutes 12] [--out docs/bench/tune]

``--log summarisation`` (the default) writes a log of summarisation traffic first: Poisson arrivals
at 2 requests a second for two hours, prompts of an article's length (lognormal, median 1,500
tokens, capped at 8,000) and outputs of a summary's (lognormal, median 120 tokens, capped at 1,000),
from a fixed seed. No family the shipped policy trained on looks like it (docs/BENCHMARKS.md). Any
trace file can be given instead (``--log splitwise_code``: the code trace, held out of training).

Then ``tidegate tune`` runs on it (fine-tuning on the first half, the verdict on the second at
1.2 x and 2 x lambda_max over ``--seeds`` draws) and its report is copied to ``--out``
(``tune.md``, ``tune.json``, ``tune.png``) with the command's wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def summarisation_log(path: Path, seed: int = 7, rate_rps: float = 2.0, hours: float = 2.0) -> Path:
    rng = np.random.default_rng(seed)
    n = int(rate_rps * hours * 3600)
    times = np.cumsum(rng.exponential(1.0 / rate_rps, n))
    prompts = np.clip(rng.lognormal(np.log(1500), 0.6, n), 64, 8000).astype(int)
    outputs = np.clip(rng.lognormal(np.log(120), 0.5, n), 8, 1000).astype(int)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write("arrived_at,num_prefill_tokens,num_decode_tokens\n")
        for t, p, o in zip(times, prompts, outputs):
            f.write(f"{float(t)!r},{int(p)},{int(o)}\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="summarisation", help="'summarisation' (generated) or a trace file or name")
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--timesteps", type=int, default=40_000)
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--seeds", default="0,1,2,3,4,5")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("runs/tune-bench"))
    ap.add_argument("--out", type=Path, default=Path("docs/bench/tune"))
    ap.add_argument("--resume", action="store_true", help="pass --resume to tidegate tune (the stages done are kept)")
    args = ap.parse_args()
    log = summarisation_log(args.work / "summarisation.csv") if args.log == "summarisation" else args.log
    cmd = [sys.executable, "-m", "tidegate", "tune", str(log), "--profile", args.profile, "--timesteps",
           str(args.timesteps), "--minutes", str(args.minutes), "--seeds", args.seeds, "--workers", str(args.workers),
           "--out", str(args.work / "tune"), *(["--resume"] if args.resume else [])]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    wall = time.monotonic() - start
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tune.md", "tune.json", "tune.png"):
        shutil.copyfile(args.work / "tune" / name, args.out / name)
    verdict = json.loads((args.out / "tune.json").read_text())
    verdict.update(wall_s=wall, machine=f"{platform.node()} {os.cpu_count()} CPUs", date=time.strftime("%Y-%m-%d"),
                   command=" ".join(cmd[1:]))
    (args.out / "tune.json").write_text(json.dumps(verdict, indent=2))
    with (args.out / "tune.md").open("a") as f:
        f.write(f"\nThe command took {wall / 60:.1f} min{' (resumed)' if args.resume else ''} on {verdict['machine']} "
                f"({verdict['date']}).\n")
    print(f"wrote {args.out}/tune.md ({wall / 60:.1f} min)", file=sys.stderr)


if __name__ == "__main__":
    main()
