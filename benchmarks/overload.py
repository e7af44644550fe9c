"""Overload and engine-failure benchmark of the server, measured from outside it.

    python benchmarks/overload.py [--controllers greedy,slo-flow] [--duration 60] [--out docs/bench/overload]
    python benchmarks/overload.py --quick        # two controllers, 15 s each: a smoke run

Part A, overload, for each controller: start ``tidegate serve``, measure its capacity with a short
closed-loop run, then offer ``--load`` times that rate as Poisson arrivals of streaming requests
from ``--load-processes`` processes (``--clients`` concurrent streams in all). Meanwhile an idle
probe process sends one small non-streamed completion and one ``GET /health`` every 100 ms (the
loaded clients' event loops lag behind hundreds of streams, so latency is measured by a client
with nothing else to do), and this process polls ``/metrics`` for KV usage and the resident memory
of the server and its child processes. Every request ends in exactly one outcome: completed
(``[DONE]``), an error event, a stream closed early, an HTTP status, a transport error, or a hang
(no response or stream end within ``--request-timeout-s``). The load processes run ``--client-nice``
steps nicer than the server and the probe.

Part B, engine killed mid-stream: open ``--kill-streams`` long streams, SIGKILL the engine process,
and time how long until every open stream has ended, until ``/ready`` answers 200 with a new
engine, and whether a new request then completes.

Writes ``overload.json``, ``overload.md`` and ``overload.png`` to ``--out``; progress goes to stderr.
Needs ``psutil`` (the memory of the server's processes) beside the project's dependencies. The
pieces are in ``engine/bench/overload/``; this script is the command line and the two parts' order.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

try:
    import psutil  # noqa: F401  (imported by engine.bench.overload.server; checked here for a clear sentence)
except ImportError:
    sys.exit("benchmarks/overload.py needs psutil to read the server's memory: pip install psutil")

from tidegate.engine.bench.overload import log
from tidegate.engine.bench.overload.clients import LoadProcesses
from tidegate.engine.bench.overload.phases import measure_capacity, overload_phase
from tidegate.engine.bench.overload.recovery import new_request, wait_for_streams, watch_recovery
from tidegate.engine.bench.overload.report import markdown, write_outputs
from tidegate.engine.bench.overload.server import Server, ServerError
from tidegate.engine.bench.overload.stats import kill_summary
from tidegate.engine.bench.overload.targets import TARGETS, kill_misses, lost, overload_misses
from tidegate.engine.bench.report import usage_error

#: the registered controllers that copy a server's scheduler, by that server's name
ALIASES = {"vllm": "greedy", "tgi": "no-evict"}
DEFAULT_CONTROLLERS = "greedy,no-evict,sglang,watermark,flow,slo-flow,learned"
QUICK_CONTROLLERS = "greedy,slo-flow"


def serve_args(args, controller: str | None) -> list[str]:
    """The ``serve`` options of one run: the controller and the options passed through."""
    out = ["--controller", controller] if controller else []
    for opt in ("kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens", "max_in_flight", "queue_timeout_s"):
        value = getattr(args, opt)
        if value is not None:
            out += ["--" + opt.replace("_", "-"), str(value)]
    for extra in args.serve_arg:
        out += shlex.split(extra)
    return out


def request_spec(args, model: str) -> dict:
    """The requests every load process sends (see ``engine.bench.overload.clients``)."""
    return {"model": model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "timeout_s": args.request_timeout_s, "seed": args.seed}


def run_overload(ctx, controller: str, args, log_dir: Path) -> dict:
    """Part A for one controller: capacity, then ``--load`` times it."""
    row: dict = {"controller": controller}
    server = Server(serve_args(args, controller), log_dir / f"server-{controller}.log")
    try:
        log(f"[{controller}] starting the server")
        server.start(args.startup_timeout_s)
        model, _ = server.model_info()
        engine = server.engine_pid()
        row["engine_nice"] = os.getpriority(os.PRIO_PROCESS, engine) if engine else None  # as the server set it
        spec = request_spec(args, model)
        row["capacity_rps"] = capacity = measure_capacity(
            ctx, server, spec, clients=args.capacity_clients, duration_s=args.capacity_s,
            processes=args.load_processes, nice=args.client_nice, request_timeout_s=args.request_timeout_s)
        row["offered_rps"] = rate = args.load * capacity
        log(f"[{controller}] capacity {capacity:.1f} req/s; offering {rate:.1f} req/s for {args.duration:.0f} s")
        if rate <= 0:
            raise ServerError("no request completed in the capacity run")
        row.update(overload_phase(
            ctx, server, spec, rate, clients=args.clients, duration_s=args.duration, processes=args.load_processes,
            nice=args.client_nice, probe_period_s=args.probe_period_s, metrics_period_s=args.metrics_period_s,
            request_timeout_s=args.request_timeout_s))
        row["targets_missed"] = overload_misses(row)
        log(f"[{controller}] sent {row['sent']}: completed {row['completed']}, 429 {row['rejected_429']}, "
            f"503 {row['unavailable_503']}, 5xx {row['server_5xx']}, lost {lost(row)}; "
            f"missed: {', '.join(row['targets_missed']) or 'none'}")
    except (ServerError, httpx.HTTPError, queue.Empty) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        log(f"[{controller}] failed: {row['error']}")
    finally:
        server.stop()
        row["server_log_errors"] = server.log_errors()
    return row


def run_engine_kill(ctx, args, log_dir: Path) -> dict:
    """Part B: SIGKILL the engine under ``--kill-streams`` open streams; the recovery."""
    out: dict = {"controller": args.kill_controller or "server default"}
    server = Server(serve_args(args, args.kill_controller), log_dir / "server-engine-kill.log")
    load = None
    try:
        log("[engine kill] starting the server")
        server.start(args.startup_timeout_s)
        killed_pid = server.engine_pid()
        if killed_pid is None:
            out["skipped"] = ("no engine process to kill: /health has no engine_pid and the server has no child "
                              "process besides multiprocessing's resource tracker")
            log(f"[engine kill] skipped: {out['skipped']}")
            return out
        model, context = server.model_info()
        spec = request_spec(args, model)
        room = (context or 10**9) - args.prompt_tokens - 16  # 16: a BOS token and some slack
        spec.update(clients=args.kill_streams, timeout_s=args.kill_timeout_s,
                    max_tokens=min(args.kill_max_tokens, room))
        out["max_tokens"] = spec["max_tokens"]
        progress = ctx.Queue()
        load = LoadProcesses(ctx, "burst", server.url, spec, 1, progress, nice=args.client_nice)
        load.start()
        statuses = wait_for_streams(progress, args.kill_streams, 60)
        out["statuses_before_kill"] = {str(k): v for k, v in statuses.items()}
        if not statuses[200]:
            _, records, _ = load.collect(args.kill_timeout_s + 30)
            raise ServerError(f"no stream started, so the engine was not killed: statuses {dict(statuses)}, "
                              f"errors {dict(Counter(r['error'] for r in records))}")
        time.sleep(args.kill_after_s)
        log(f"[engine kill] {out['statuses_before_kill']} answered; SIGKILL to engine pid {killed_pid}")
        t_kill = time.monotonic()
        os.kill(killed_pid, signal.SIGKILL)
        out["killed_engine_pid"] = killed_pid
        out.update(watch_recovery(server, killed_pid, t_kill, args.recovery_timeout_s))
        planned, records, failures = load.collect(args.kill_timeout_s + 30)
        out.update(kill_summary(records, planned, failures, t_kill))
        if out["ready_again_after_kill_s"] is not None:
            out.update(new_request(server, model, t_kill, args.recovery_timeout_s))
        out["targets_missed"] = kill_misses(out)
        log(f"[engine kill] streams ended {out['streams_ended_after_kill_s']} s after the kill "
            f"({out['end_kinds']}); ready again after {out['ready_again_after_kill_s']} s")
    except (ServerError, httpx.HTTPError, queue.Empty) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        log(f"[engine kill] failed: {out['error']}")
    finally:
        if load is not None:
            load.close()
        server.stop()
        out["server_log_errors"] = server.log_errors()
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--parts", default="overload,engine-kill", help="which parts to run: overload, engine-kill (default: both)")
    add("--controllers", default=None, help=f"comma-separated controllers (vllm = greedy, tgi = no-evict); default "
                                            f"{DEFAULT_CONTROLLERS}, with --quick {QUICK_CONTROLLERS}")
    add("--quick", action="store_true", help="smoke run: two controllers, 15 s of overload, 4 s capacity run")
    add("--duration", type=float, default=None, help="seconds of overload per controller (default: 60)")
    add("--load", type=float, default=3.0, help="offered rate as a multiple of the measured capacity (default: 3)")
    add("--capacity-s", type=float, default=None, help="seconds of the closed-loop capacity run (default: 8)")
    add("--capacity-clients", type=int, default=64, help="clients of the capacity run (default: 64)")
    add("--clients", type=int, default=256, help="most concurrent streams of the overload run (default: 256)")
    add("--load-processes", type=int, default=4, help="processes the clients are spread over (default: 4)")
    add("--prompt-tokens", type=int, default=64, help="prompt length (default: 64)")
    add("--max-tokens", type=int, default=32, help="max_tokens of each request, with ignore_eos (default: 32)")
    add("--request-timeout-s", type=float, default=120.0,
        help="a request with no response or stream end by then counts as a hang (default: 120)")
    add("--client-nice", type=int, default=10,
        help="niceness added to the load processes, 0-19 (default: 10): on a small machine the load generator "
             "stands in for remote clients, so it must not take CPU from the server; the idle probe keeps the "
             "server's niceness, since it measures the server's answer latency and must not wait behind it")
    add("--probe-period-s", type=float, default=0.1, help="idle probe period (default: 0.1)")
    add("--metrics-period-s", type=float, default=0.2, help="/metrics and memory sampling period (default: 0.2)")
    add("--kill-controller", default=None, help="controller of part B (default: the server's)")
    add("--kill-streams", type=int, default=64, help="streams open when the engine is killed (default: 64)")
    add("--kill-max-tokens", type=int, default=2000, help="their max_tokens, capped to the context (default: 2000)")
    add("--kill-after-s", type=float, default=2.0, help="seconds of streaming before the kill (default: 2)")
    add("--kill-timeout-s", type=float, default=90.0, help="a stream not ended by then counts as hung (default: 90)")
    add("--recovery-timeout-s", type=float, default=90.0, help="longest wait for /ready after the kill (default: 90)")
    add("--startup-timeout-s", type=float, default=180.0, help="longest wait for a new server (default: 180)")
    for opt, kind in (("--kv-capacity-tokens", int), ("--max-num-seqs", int), ("--max-num-batched-tokens", int),
                      ("--max-in-flight", int), ("--queue-timeout-s", float)):
        add(opt, type=kind, default=None, help="passed to serve (default: serve's)")
    add("--serve-arg", action="append", default=[], help="more serve options, e.g. '--block-size 32' (repeatable)")
    add("--seed", type=int, default=0, help="seed of arrivals and prompts (default: 0)")
    add("--log-dir", default=None, help="folder for the server logs (default: a new temporary folder)")
    add("--out", default="docs/bench/overload", help="folder for the results (default: docs/bench/overload)")
    args = ap.parse_args()
    quick = args.quick
    args.controllers = args.controllers or (QUICK_CONTROLLERS if quick else DEFAULT_CONTROLLERS)
    args.duration = args.duration or (15.0 if quick else 60.0)
    args.capacity_s = args.capacity_s or (4.0 if quick else 8.0)
    return args


def controller_names(text: str) -> list[str]:
    """The registered names of the comma-separated ``text``; exits 2 naming an unknown one."""
    from tidegate.ctrl import CONTROLLERS, parse_spec

    names = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        name, _, options = spec.partition(":")
        name = ALIASES.get(name, name)
        if name not in CONTROLLERS and name != "learned":
            known = ", ".join(sorted([*CONTROLLERS, "learned", *ALIASES]))
            usage_error(f"unknown controller {parse_spec(spec)[0]!r} in --controllers; choose from {known}")
        full = f"{name}:{options}" if options else name
        if full not in names:
            names.append(full)
    return names


def main() -> None:
    args = parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    if not parts <= {"overload", "engine-kill"}:
        usage_error(f"--parts {args.parts!r}: expected overload and/or engine-kill")
    if not 0 <= args.client_nice <= 19:
        usage_error(f"--client-nice {args.client_nice}: expected a niceness from 0 to 19")
    controllers = controller_names(args.controllers) if "overload" in parts else []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so every server is stopped on the way out
    out = Path(args.out)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tidegate-overload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"results to {out}, server logs to {log_dir}")
    ctx = mp.get_context("spawn")
    result: dict = {"command": " ".join(["python", *map(shlex.quote, sys.argv)]),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()},
              "niceness": {"server": os.nice(0), "idle_probe": os.nice(0),
                           "load_processes": min(19, os.nice(0) + args.client_nice)},
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "settings": vars(args), "targets": TARGETS,
              "overload": [], "engine_kill": None}
    for controller in controllers:
        result["overload"].append(run_overload(ctx, controller, args, log_dir))
        write_outputs(result, out)
    if "engine-kill" in parts:
        result["engine_kill"] = run_engine_kill(ctx, args, log_dir)
    write_outputs(result, out)
    print(markdown(result))


if __name__ == "__main__":
    main()
