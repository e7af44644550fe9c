"""Vanilla vLLM against vLLM with tidegate's plugin under Poisson load: issue 32's targets, measured.

    python benchmarks/vllm_overload.py                       # every arm at 0.7x, 1.5x and 3x capacity
    python benchmarks/vllm_overload.py --quick               # smoke run: vllm and tidegate, 10 s at 0.7x and 1.5x
    python benchmarks/vllm_overload.py --arm tidegate='--scheduler-cls ... --middleware ...'
    python benchmarks/vllm_overload.py --arms tidegate --reuse EARLIER_OUT   # the plugin again, vanilla's rows reused

Every arm is the same vLLM OpenAI server (``.venv-vllm``, ``make vllm-setup``) on the same model folder
with the same common arguments, plus the arm's own (``--arm NAME='ARGS'`` replaces or adds one;
``{step_log}`` in ARGS becomes that arm's step-log path). The default arms:

- ``vllm``: vanilla vLLM, which queues without bound. It runs first: a closed-loop run measures its
  capacity (completed requests per second, in steady state), and every load is a multiple of it.
- ``vllm-queued-N``: vanilla vLLM with ``--max-num-queued-reqs N`` (it answers 503 past N unfinished
  requests), at the loads of ``--queued-loads`` only; the N are ``--queued-reqs``. The best of them at a
  load, in hindsight, is the reference tidegate must come within 0.97x of.
- ``tidegate``: the plugin (``--scheduler-cls`` and tidegate's default controller) with its step log.

At each load an arm gets Poisson arrivals for ``--duration-s`` of streaming completions (random token
ids, fixed output length) from ``--load-processes`` processes; each request is given up ``--drain-s``
after the last arrival. An idle probe (a process with nothing else to do) sends one small completion
every ``--probe-period-s`` to time 429s as the server answers them. ``--arm NAME+='ARGS'`` adds
arguments to an arm, e.g. ``--arm tidegate+='--middleware pkg.module.obj'``. One server per arm serves all its
loads in turn, after a short warm-up; between loads it must hold no request.

Figures per arm and load: goodput (DistServe: requests per second of the arrival window within the TTFT
and TPOT SLOs), TTFT and TPOT p50/p99 of served requests, 429s with their latency and Retry-After, 503
and other 5xx, every request in one bucket, the ratios against vanilla vLLM and against the best
queued arm, the plugin's share of each step from its step log, and issue 32's targets for the tidegate
arms. ``--reuse`` takes an earlier run's capacity and its rows of the arms this run leaves out, where both offered
the same arrivals to the same servers (a change to the plugin is measured again in 11 minutes, not 18). Writes
``vllm_overload.json``, ``.md`` and ``.png`` to ``--out`` (after every load, so an
interrupted run keeps what it measured) and the servers' logs, step logs and every request's record
(``requests-ARM-LOADx.jsonl``) to ``--out``/logs; progress goes to stderr. The pieces are in ``engine/bench/vllm/``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tidegate.ctrl import DEFAULT_CONTROLLER
from tidegate.engine.bench.overload import log
from tidegate.engine.bench.overload.server import ServerError
from tidegate.engine.bench.vllm.arms import Arm, ArmError, default_arms, merge_arms, parse_arm, queued_arms
from tidegate.engine.bench.vllm.model import ModelFolderError, describe, model_folder, prompt_token_ids
from tidegate.engine.bench.vllm.phases import closed_run, load_run, measure_capacity, step_log_lines
from tidegate.engine.bench.vllm.report import markdown, write_outputs
from tidegate.engine.bench.vllm.reuse import ReuseError, load_result, reused_rows
from tidegate.engine.bench.vllm.server import VLLM_PYTHON, VllmServer
from tidegate.engine.bench.vllm.stats import add_ratios, probe_stats, queue_stats, request_stats
from tidegate.engine.bench.vllm.steps import step_overhead
from tidegate.engine.bench.vllm.targets import TARGETS, misses
from tidegate.engine.bench.report import usage_error

STARTUP_GUESS_S = 75.0  # vLLM's start-up on a 2-core machine with a small model (40-90 s)


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = ap.add_argument
    add("--quick", action="store_true", help="smoke run: arms vllm,tidegate; loads 0.7,1.5; 10 s each")
    add("--model", default="llama-24m", help="llama-24m (8 layers, hidden 512, 4 KV heads), tiny (tidegate's 3M "
                                              "Llama), or a Hugging Face folder")
    add("--model-seed", type=int, default=0, help="seed of the built model's random weights")
    add("--arm", action="append", default=[], metavar="NAME='ARGS'",
        help="an arm's vLLM server arguments; replaces the default arm of that name or adds one (repeatable)")
    add("--controller", default=DEFAULT_CONTROLLER, help="the tidegate arm's controller, as tidegate serve takes it")
    add("--arms", default=None, help="comma-separated arms to run, in order; vllm-queued stands for the sweep "
                                     "(default: every arm)")
    add("--loads", type=floats, default=None, help="loads as multiples of vanilla vLLM's capacity [0.7,1.5,3]")
    add("--queued-reqs", default="auto",
        help="N of the vllm-queued-N arms, comma-separated; auto: C and 1.5 C, C the clients of the capacity "
             "ramp's level that set the capacity (--max-num-queued-reqs caps waiting plus running requests)")
    add("--queued-loads", type=floats, default=(1.5, 3.0), help="the loads the vllm-queued-N arms run at")
    add("--capacity-rps", type=float, default=None, help="skip the capacity run and take this capacity")
    add("--reuse", type=Path, default=None, metavar="RUN",
        help="an earlier run's vllm_overload.json (or its --out folder) with the same arrivals, model and servers: "
             "its capacity, and its rows of the arms this run leaves out (e.g. --arms tidegate --reuse DIR)")
    add("--capacity-s", type=float, default=None, help="seconds of each closed-loop level of the capacity ramp [20]")
    add("--capacity-warmup-s", type=float, default=None, help="each level's first seconds, not counted [6]")
    add("--capacity-clients", type=ints, default=(32, 64, 128, 256),
        help="the ramp's levels: closed-loop clients, in increasing order")
    add("--duration-s", type=float, default=None, help="seconds of Poisson arrivals per arm and load [120]")
    add("--drain-s", type=float, default=None,
        help="seconds after the last arrival that clients still wait [TTFT SLO + TPOT SLO x (max tokens - 1) + 5: "
             "a request still open then could not have met both SLOs]")
    add("--prompt-tokens", type=int, default=256, help="prompt length in tokens")
    add("--max-tokens", type=int, default=128, help="output length in tokens (min_tokens and ignore_eos too)")
    add("--ttft-slo-s", type=float, default=2.0, help="TTFT SLO")
    add("--tpot-slo-s", type=float, default=0.2, help="TPOT SLO")
    add("--vllm-python", type=Path, default=VLLM_PYTHON, help="the python of vLLM's venv (make vllm-setup)")
    add("--vllm-args", default="--dtype bfloat16 --max-model-len 2048",
        help="server arguments common to every arm")
    add("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE of every server")
    add("--load-processes", type=int, default=2, help="processes the Poisson arrivals are split over")
    add("--connections", type=int, default=8192,
        help="most open connections of all load processes together (vanilla vLLM's queue holds one each)")
    add("--client-nice", type=int, default=0, help="niceness added to the load processes (0-19)")
    add("--probe-period-s", type=float, default=0.5, help="idle probe period; 0: no probe")
    add("--metrics-period-s", type=float, default=1.0, help="vLLM /metrics sampling period")
    add("--startup-timeout-s", type=float, default=400.0, help="longest wait for a server's /health")
    add("--idle-timeout-s", type=float, default=120.0, help="longest wait for a server to hold no request")
    add("--seed", type=int, default=0, help="seed of arrivals and prompts")
    add("--out", type=Path, default=Path("bench-out/vllm"), help="folder for the results, logs and models")
    args = ap.parse_args(argv)
    q = args.quick
    args.arms = args.arms or ("vllm,tidegate" if q else None)
    args.loads = args.loads or ((0.7, 1.5) if q else (0.7, 1.5, 3.0))
    args.duration_s = args.duration_s or (10.0 if q else 120.0)
    args.capacity_s = args.capacity_s or (12.0 if q else 20.0)
    args.capacity_warmup_s = args.capacity_warmup_s if args.capacity_warmup_s is not None else (4.0 if q else 6.0)
    if args.drain_s is None:
        args.drain_s = args.ttft_slo_s + args.tpot_slo_s * (args.max_tokens - 1) + 5.0
    return args


def queued_values(text: str, capacity_clients: int | None) -> list[int] | None:
    """The N of the ``vllm-queued-N`` arms; None for ``auto`` until the capacity ramp has run."""
    if text.strip() == "auto":
        return None if capacity_clients is None else [capacity_clients, round(1.5 * capacity_clients)]
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = [-1]
    if not values or any(v < 1 for v in values):
        usage_error(f"--queued-reqs {text!r}: expected auto or positive integers separated by commas")
    return values


def vllm_version(python: Path) -> str | None:
    """The vLLM distribution's version in ``python``'s venv (the CPU build is named ``vllm-cpu``)."""
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    for dist in ("vllm-cpu", "vllm"):
        try:
            done = subprocess.run([str(python), "-c", code, dist], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0:
            return f"{dist} {done.stdout.strip()}"
    return None


def planned_seconds(arms: list[Arm], args) -> float:
    """A guess of the run's length: start-ups, capacity, and each load's arrivals plus (at most) the drain."""
    total = 0.0 if args.capacity_rps or args.reuse else len(args.capacity_clients) * (args.capacity_s + 15)
    for arm in arms:
        loads = [x for x in args.loads if arm.runs_at(x)]
        total += STARTUP_GUESS_S + 10 + sum(args.duration_s + (args.drain_s if x > 1 else 5) + 8 for x in loads)
    return total


def run_arm(ctx, arm: Arm, args, run: dict) -> None:
    """One server of ``arm``: (vanilla: the capacity run, then) each of its loads; a row per load."""
    logs = args.out / "logs"
    step_log = (logs / f"steps-{arm.name}.csv").resolve()
    arm_args = [a.replace("{step_log}", str(step_log)) for a in arm.server_args]
    writes_steps = any("{step_log}" in a for a in arm.server_args)
    loads = [x for x in args.loads if arm.runs_at(x)]
    server = None
    rows: list[dict] = run["rows"].setdefault(arm.name, [])
    try:
        for load in loads:
            row = {"arm": arm.name, "load": load, "queued_reqs": arm.queued_reqs, "server_args": arm_args}
            rows.append(row)
            if server is None:
                server = VllmServer(args.vllm_python, run["folder"], [*shlex.split(args.vllm_args), *arm_args],
                                    logs / f"vllm-{arm.name}.log", {"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib})
                start_server(server, arm, args, run)
                row["server_ready_s"] = server.ready_after_s
            capacity = run["capacity"]["capacity_rps"]
            row["offered_rps"] = rate = load * capacity
            first = step_log_lines(step_log) if writes_steps else 0
            log(f"[{arm.name}] {load:g}x capacity: {rate:.2f} req/s for {args.duration_s:.0f} s")
            raw = load_run(ctx, server, run["spec"], rate, duration_s=args.duration_s, drain_s=args.drain_s,
                           processes=args.load_processes, nice=args.client_nice, probe_period_s=args.probe_period_s,
                           metrics_period_s=args.metrics_period_s, label=f"{arm.name} {load:g}x")
            row.update(request_stats(raw["records"], raw["planned"], duration_s=args.duration_s,
                                     max_tokens=args.max_tokens, ttft_slo_s=args.ttft_slo_s,
                                     tpot_slo_s=args.tpot_slo_s))
            row.update(probe_stats(raw["probes"], raw["t0"], args.duration_s))
            row.update(queue_stats(raw["samples"], raw["t0"]))
            row["load_failures"] = raw["failures"]
            save_records(logs / f"requests-{arm.name}-{load:g}x.jsonl", raw["records"], raw["t0"])
            if raw["failures"]:
                log(f"[{arm.name}] load process failures: {'; '.join(raw['failures'])}")
            try:
                row["idle_after_s"] = server.wait_idle(args.idle_timeout_s)
            except ServerError as exc:
                row["idle_after_s"] = None
                log(f"[{arm.name}] {exc}; restarting it for the next load")
                server.stop()
                server = None
            if writes_steps and step_log.exists():
                row["step_overhead"] = step_overhead(step_log, first, step_log_lines(step_log) or None)
            log(f"[{arm.name}] {load:g}x: goodput {row['goodput_rps']:.2f} req/s, served {row['served']}, "
                f"429 {row['rejected_429']}, 503 {row['unavailable_503']}, 5xx {row['server_5xx']}, cut "
                f"{row['cut_at_drain']}, TTFT p99 {row['ttft_p99_ms'] or 0:.0f} ms of {row['planned']} planned")
            write(run, args)
    except (ServerError, httpx.HTTPError, queue.Empty, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        log(f"[{arm.name}] failed: {error}")
        if rows and "goodput_rps" not in rows[-1]:
            rows[-1]["error"] = error
        else:
            rows.append({"arm": arm.name, "load": None, "error": error})
    finally:
        if server is not None:
            server.stop()
            for row in rows:
                row.setdefault("server_log_errors", server.log_errors()["count"])


def save_records(path: Path, records: list[dict], t0: float) -> None:
    """Every request's record, one JSON line each, times in seconds since the load started."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: round(v - t0, 4) if k.endswith("_s") and v is not None else v
                                for k, v in r.items()}) + "\n")


def start_server(server: VllmServer, arm: Arm, args, run: dict) -> None:
    """Start ``arm``'s server and warm it up; the vanilla arm measures the capacity the first time."""
    log(f"[{arm.name}] starting vLLM: {shlex.join(server.cmd[1:])}")
    server.start(args.startup_timeout_s)
    model, context = server.model_info()
    run["spec"]["model"] = model
    log(f"[{arm.name}] ready after {server.ready_after_s:.0f} s (model {model}, context {context}, KV "
        f"{server.kv_info().get('kv_cache_size_tokens')} tokens); warming up")
    closed_run(run["ctx"], server, run["spec"], clients=4, duration_s=3.0, processes=1, nice=args.client_nice,
               drain_s=args.drain_s)
    server.wait_idle(args.idle_timeout_s)
    if run["capacity"] is None:
        log(f"[{arm.name}] capacity ramp: {', '.join(map(str, args.capacity_clients))} closed-loop clients, "
            f"{args.capacity_s:.0f} s each")
        run["capacity"] = measure_capacity(run["ctx"], server, run["spec"], levels=list(args.capacity_clients),
                                           duration_s=args.capacity_s, warmup_s=args.capacity_warmup_s,
                                           processes=args.load_processes, nice=args.client_nice,
                                           drain_s=args.drain_s, ttft_slo_s=args.ttft_slo_s,
                                           tpot_slo_s=args.tpot_slo_s)
        run["capacity"]["kv"] = server.kv_info()
        log(f"[{arm.name}] capacity {run['capacity']['capacity_rps']:.2f} req/s "
            f"({run['capacity']['capacity_output_tok_s']:.0f} output tok/s) at {run['capacity']['capacity_clients']} "
            "clients")
        server.wait_idle(args.idle_timeout_s)


def write(run: dict, args) -> None:
    result = run["result"]
    result["rows"] = [r for rows in run["rows"].values() for r in rows]
    add_ratios(result["rows"])
    for r in result["rows"]:
        if r["arm"] in run["tidegate_arms"] and "goodput_rps" in r:
            r["targets_missed"] = misses(r, args.ttft_slo_s * 1000)
    result["capacity"] = run["capacity"]
    write_outputs(result, args.out)


def plan(args, settings: dict) -> tuple[list[Arm], dict[str, list[dict]], dict | None, bool, Path]:
    """The arms to run, the rows and capacity reused from an earlier run, whether the queued sweep waits for
    the capacity ramp's N, and the model folder; bad arguments end here, in one sentence."""
    try:
        earlier = load_result(args.reuse) if args.reuse is not None else None
        given = [parse_arm(a) for a in args.arm]
        only = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
        sweep = only is None or "vllm-queued" in only
        clients = ((earlier.get("capacity") or {}).get("capacity_clients") or args.capacity_clients[-1]
                   if earlier else None)
        explicit = queued_values(args.queued_reqs, clients)
        defaults = default_arms(args.controller, args.ttft_slo_s, args.tpot_slo_s)
        if explicit and sweep:
            defaults += queued_arms(explicit, args.queued_loads)
        if only is not None and "vllm-queued" in only:
            at = only.index("vllm-queued")
            only[at:at + 1] = [a.name for a in defaults if a.queued_reqs is not None]
        arms = merge_arms(defaults, given, only, args.queued_loads, need_vanilla=earlier is None)
        reused, capacity = (reused_rows(earlier, settings, {a.name for a in arms}, args.loads, str(args.reuse))
                            if earlier else ({}, None))
        folder = model_folder(args.model, args.out / "models", args.model_seed)
    except (ArmError, ModelFolderError, ReuseError) as exc:
        usage_error(str(exc))
    return arms, reused, capacity, sweep and explicit is None, folder  # no N yet: the capacity ramp's


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.vllm_python.exists():
        usage_error(f"{args.vllm_python} does not exist: run `make vllm-setup` (vLLM's own venv) or pass --vllm-python")
    if not 0 <= args.client_nice <= 19:
        usage_error(f"--client-nice {args.client_nice}: expected a niceness from 0 to 19")
    if args.reuse is not None and args.capacity_rps:
        usage_error("--reuse takes the earlier run's capacity; leave out --capacity-rps")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    arms, reused, capacity, sweep_later, folder = plan(args, settings)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server is stopped on the way out
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    settings.update(common_args=shlex.split(args.vllm_args), env={"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib},
                    arms={a.name: {"server_args": list(a.server_args), "loads": a.loads} for a in arms})
    result = {"command": " ".join(["python", *map(shlex.quote, sys.argv)]) if argv is None else shlex.join(argv),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "settings": settings, "targets": TARGETS,
              "model": describe(folder), "vllm_version": vllm_version(args.vllm_python), "rows": []}
    if args.capacity_rps:
        capacity = {"capacity_rps": args.capacity_rps, "given": True}
    run = {"ctx": ctx, "folder": folder, "capacity": capacity, "result": result, "rows": reused,
           "tidegate_arms": {a.name for a in arms if a.name != "vllm" and a.queued_reqs is None},
           "spec": {"model": None, "token_ids": prompt_token_ids(folder), "prompt_tokens": args.prompt_tokens,
                    "max_tokens": args.max_tokens, "seed": args.seed,
                    "connections": max(1, args.connections // args.load_processes)}}
    queued_note = " (+ the vllm-queued-N sweep, N from the capacity ramp)" if sweep_later else ""
    log(f"arms {', '.join(a.name for a in arms)}{queued_note} at loads {', '.join(f'{x:g}x' for x in args.loads)}; "
        f"model {folder} ({result['model']['parameters'] / 1e6:.1f}M parameters); about "
        f"{planned_seconds(arms + (queued_arms([1, 2], args.queued_loads) if sweep_later else []), args) / 60:.0f} "
        f"min; results to {args.out}")
    k = 0
    while k < len(arms):
        run_arm(ctx, arms[k], args, run)
        write(run, args)
        if run["capacity"] is None:
            log("vanilla vLLM's capacity was not measured, so no load can be offered; stopping")
            break
        if k == 0 and sweep_later:
            named = {a.name for a in arms}
            sweep_arms = [a for a in queued_arms(queued_values(args.queued_reqs, run["capacity"].get(
                "capacity_clients", args.capacity_clients[-1])), args.queued_loads) if a.name not in named]
            arms[1:1] = sweep_arms
            settings["arms"].update({a.name: {"server_args": list(a.server_args), "loads": a.loads}
                                     for a in sweep_arms})
            log(f"queued-reqs sweep: {', '.join(a.name for a in sweep_arms)} at "
                f"{', '.join(f'{x:g}x' for x in args.queued_loads)}")
        k += 1
    write(run, args)
    print(markdown(result))


if __name__ == "__main__":
    main()
