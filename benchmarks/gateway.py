"""Two ``tidegate serve`` replicas behind ``tidegate gateway``, measured from outside.

    python benchmarks/gateway.py [--load 3] [--duration 60] [--out docs/bench/gateway]

The replicas serve the tiny model with one torch thread each; the second has half the first's KV
cache (``--kv-tokens``). Every arm starts fresh replicas (and a fresh gateway), so no arm inherits
another's rate windows or refitted profiles. Requests are streamed completions of ``--input-len`` /
``--output-len`` tokens (``ignore_eos``), Poisson arrivals; goodput counts TTFT <= ``--ttft-slo-ms``
and TPOT <= ``--tpot-slo-ms``.

1. capacity: both replicas flooded at once, each by a client of its own (``--flood-rps``,
   ``--capacity-s``); a replica's served rate is its capacity, the fleet's is the sum. The replicas
   share this machine's cores in every arm, so each is measured as it runs in the fleet.
2. separate: each replica driven directly at ``--load`` x its own capacity, both at once (a split of
   the load that knows each replica's capacity); the goodputs summed. The idle probe (below) sends
   replica a what it sends the fleet in the fleet arms.
3. fleet: the pair behind the gateway at ``--load`` x the fleet's capacity, with the gateway's
   admission and router (``--router``), and as a plain round robin (``--no-admission``).
4. light load: replica A at 0.3 x its capacity, directly and through the gateway (the overhead).
5. kill: the fleet at 1 x its capacity; replica B's processes are killed at half time. Its open
   streams must end (an error event and ``[DONE]``) within 2 s, and the rest keep serving.

``--rounds N`` runs the separate and fleet arms N times, interleaved (each round in the reverse order of the
last), and reports each round's ratios and their geometric mean: on a VM whose speed drifts within the hour, a
ratio of arms minutes apart is steadier than one run of each.

The servers and an idle probe (one small completion every 100 ms, in a process of its own: the loaded
client's event loop lags behind thousands of streams) run ``--client-nice`` steps less nice than the
clients, which share this machine's cores with them. Writes ``gateway.json``, ``gateway.md`` and
``gateway.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from tidegate.engine.bench.loadgen import plan_random, run, run_load, summarize
from tidegate.engine.bench.overload.server import Server
from tidegate.engine.core.figures import save_png
from tidegate.engine.gateway.replicas import parse_gauges


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Gateway(Server):
    """``tidegate gateway`` as a subprocess."""

    def __init__(self, urls: list[str], gateway_args: list[str], log_path: Path) -> None:
        super().__init__([], log_path)
        self.cmd = [sys.executable, "-m", "tidegate", "gateway", "--port", str(self.port), "--log-level", "warning",
                    *[a for u in urls for a in ("--replica", u)], *gateway_args]


#: the idle probe is favoured as the servers are
PROBE_NICE = 5


def _probe(url: str, duration_s: float, out_path: str) -> None:
    """An idle client: one small completion every 100 ms; its answers' statuses and latencies, as JSON."""
    rows = []
    end = time.monotonic() + duration_s
    with httpx.Client(timeout=30) as c:
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                status = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": "probe", "max_tokens": 1,
                                                               "ignore_eos": True}).status_code
            except httpx.HTTPError:
                status = 0
            rows.append((status, time.perf_counter() - start))
            time.sleep(max(0.0, 0.1 - (time.perf_counter() - start)))
    Path(out_path).write_text(json.dumps(rows))


def probed(url: str, duration_s: float, out: Path):
    """Start the idle probe in a process of its own; call the result to join it and read its figures."""
    import multiprocessing as mp

    path = out / f"probe_{int(time.time() * 1000)}.json"
    proc = mp.get_context("spawn").Process(target=_probe, args=(url, duration_s, str(path)), daemon=True)
    proc.start()
    try:
        import psutil

        psutil.Process(proc.pid).nice(-PROBE_NICE)  # as favoured as the servers
    except Exception:
        pass

    def finish() -> dict:
        proc.join(duration_s + 60)
        rows = json.loads(path.read_text()) if path.exists() else []
        refused = sorted(lat for status, lat in rows if status == 429)
        p99 = refused[min(len(refused) - 1, int(0.99 * len(refused)))] * 1000 if refused else float("nan")
        return {"probes": len(rows), "probe_429": len(refused), "probe_429_p99_ms": p99,
                "probe_5xx": sum(500 <= status < 600 and status != 503 for status, _ in rows)}
    return finish


def favoured(server: Server, args) -> Server:
    """The server's processes ``--client-nice`` steps less nice than this process (the clients'), as
    servers run on machines of their own: the clients here share the cores with them."""
    for p in server.tree():
        try:
            p.nice(-args.client_nice)
        except Exception:
            pass
    return server


def start_replicas(args, which: str, out: Path) -> list[Server]:
    kv = {"a": args.kv_tokens, "b": args.kv_tokens // 2}
    servers = []
    for name in which:
        s = Server(["--threads", "1", "--kv-capacity-tokens", str(kv[name]), "--controller", args.controller,
                    "--log-level", "warning"], out / f"replica_{name}.log")
        s.start(120)
        servers.append(favoured(s, args))
    return servers


def drive(url: str, rate: float, duration_s: float, args, seed: int, kill=None) -> tuple[list, float]:
    plan = plan_random(10**9, rate, 1.0, args.input_len, args.output_len, seed, duration_s)
    log(f"  {len(plan)} requests at {rate:.2f} req/s for {duration_s:.0f} s -> {url}")
    if kill is None:
        return run(run_load(url, plan, progress=False, timeout_s=120))
    import asyncio

    async def with_kill():
        async def killer():
            await asyncio.sleep(duration_s / 2)
            kill()
            return time.perf_counter()
        task = asyncio.create_task(killer())
        start = time.perf_counter()
        outcomes, wall = await run_load(url, plan, progress=False, timeout_s=120)
        return outcomes, wall, start, await task
    return run(with_kill())


def figures(outcomes, wall, args) -> dict:
    s = summarize(outcomes, wall, args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
    keys = ("sent", "completed", "rejected_429", "unavailable_503", "server_errors_5xx", "stream_errors",
            "connection_errors", "throughput_rps", "goodput_rps", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "reject_latency_p99_ms")
    return {k: s[k] for k in keys}


def drive_each(urls: list[str], rates: list[float], duration_s: float, args, seed: int) -> list[tuple[list, float]]:
    """Each replica under load of its own, all at once (they share this machine as in the fleet)."""
    import asyncio

    async def all_at_once():
        plans = [plan_random(10**9, r, 1.0, args.input_len, args.output_len, seed + i, duration_s)
                 for i, r in enumerate(rates)]
        for u, r, p in zip(urls, rates, plans):
            log(f"  {len(p)} requests at {r:.2f} req/s for {duration_s:.0f} s -> {u}")
        return await asyncio.gather(*(run_load(u, p, progress=False, timeout_s=120) for u, p in zip(urls, plans)))

    return run(all_at_once())


class GaugeSampler:
    """Each replica's requests running and waiting, read from its ``/metrics`` every ``period_s`` while an arm runs
    (on a thread of its own): what the replicas held, to set beside what they served."""

    def __init__(self, urls: list[str], period_s: float = 0.5) -> None:
        self.urls, self.period_s = urls, period_s
        self.samples: list[list[dict[str, float]]] = [[] for _ in urls]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.period_s):
                for url, samples in zip(self.urls, self.samples):
                    try:
                        samples.append(parse_gauges(client.get(url + "/metrics").text))
                    except httpx.HTTPError:
                        pass

    def means(self) -> list[dict[str, float]]:
        """Each replica's mean running and waiting over its samples (NaN without any)."""
        out = []
        for samples in self.samples:
            row = {}
            for gauge in ("running", "waiting"):
                values = [x[gauge] for x in samples if gauge in x]
                row[gauge] = statistics.fmean(values) if values else float("nan")
            out.append(row)
        return out


def preempted(replicas: list[Server]) -> list[float]:
    """Each replica's count of requests it preempted (evicted from its KV cache, to run again) so far."""
    counts = []
    for r in replicas:
        try:
            text = httpx.get(r.url + "/metrics").text
        except httpx.HTTPError:  # a replica the kill arm killed
            counts.append(float("nan"))
            continue
        counts.append(parse_gauges(text).get("preemptions", float("nan")))
    return counts


def arm_separate(args, out: Path, rates: list[float], duration_s: float, seed: int,
                 probe: bool = False) -> tuple[list[tuple[list, float]], list[float], list[dict[str, float]], dict]:
    """Each replica driven by a client of its own: the runs, each replica's preemptions, what it held (its mean
    requests running and waiting), and with ``probe`` the idle probe's figures: the probe then sends replica a
    what it sends the fleet in the fleet arms, so the arms compared carry the same requests."""
    replicas = start_replicas(args, "ab", out)
    try:
        finish = probed(replicas[0].url, duration_s, out) if probe else None
        with GaugeSampler([r.url for r in replicas]) as sampler:
            runs = drive_each([r.url for r in replicas], rates, duration_s, args, seed)
        return runs, preempted(replicas), sampler.means(), finish() if finish is not None else {}
    finally:
        for r in replicas:
            r.stop()


def write_requests(path: Path, plan, outcomes, args) -> None:
    """Every request's record: when it was sent, its status, its first token's time and time per output token."""
    lines = ["sent_s,status,ttft_s,tpot_s,latency_s,met_slo"]
    for p, o in zip(plan, outcomes):
        tpot = (o.e2e_s - o.ttft_s) / len(o.itl_s) if o.itl_s and o.ttft_s is not None and o.e2e_s else None
        met = (o.status == 200 and o.error is None and o.ttft_s is not None and o.ttft_s <= args.ttft_slo_ms / 1e3
               and (tpot is None or tpot <= args.tpot_slo_ms / 1e3))
        cells = [f"{p.at_s:.3f}", str(o.status), "" if o.ttft_s is None else f"{o.ttft_s:.4f}",
                 "" if tpot is None else f"{tpot:.4f}", f"{o.latency_s:.4f}", str(int(met))]
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n")


def arm_fleet(args, out: Path, rate: float, gateway_args: list[str], seed: int, kill: bool = False,
              name: str = "fleet") -> dict:
    replicas = start_replicas(args, "ab", out)
    gw = Gateway([r.url for r in replicas], gateway_args, out / f"gateway-{name}.log")
    try:
        gw.start(60)
        favoured(gw, args)
        if not kill:
            probe = probed(gw.url, args.duration, out)
            cpu0 = gw.cpu_seconds()
            with GaugeSampler([r.url for r in replicas]) as sampler:
                outcomes, wall = drive(gw.url, rate, args.duration, args, seed)
            res = figures(outcomes, wall, args)
            write_requests(out / f"requests-{name}.csv",
                           plan_random(10**9, rate, 1.0, args.input_len, args.output_len, seed, args.duration),
                           outcomes, args)
            res["gateway_cpu_share"] = (gw.cpu_seconds() - cpu0) / wall  # of one core
            res["held"] = sampler.means()
            res.update(probe())
        else:
            victim = replicas[1]

            def do_kill():
                for p in victim.tree():
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                    except OSError:
                        pass
                log("  replica b killed")

            outcomes, wall, start, killed_at = drive(gw.url, rate, args.duration, args, seed, kill=do_kill)
            res = figures(outcomes, wall, args)
            plan = plan_random(10**9, rate, 1.0, args.input_len, args.output_len, seed, args.duration)
            kill_s = killed_at - start
            broken = [p.at_s + o.latency_s - kill_s for p, o in zip(plan, outcomes)
                      if o.status == 200 and o.error is not None]
            after = [o for p, o in zip(plan, outcomes) if p.at_s > kill_s + 2 and o.status == 200 and o.error is None]
            res.update(streams_broken=len(broken), slowest_end_after_kill_s=max(broken, default=0.0),
                       completed_after_kill=len(after))
        res["preemptions"] = sum(preempted(replicas))
        res["served_by_replica"] = [r["completed"] for r in httpx.get(gw.url + "/health").json()["replicas"]]
        res["gateway_metrics"] = {line.split(" ")[0]: float(line.split(" ")[1])
                                  for line in httpx.get(gw.url + "/metrics").text.splitlines()
                                  if line.startswith(("tidegate:gateway_requests_total",
                                                      "tidegate:gateway_retries_total"))}
        return res
    finally:
        gw.stop()
        for r in replicas:
            r.stop()


def arm_light(args, out: Path, rate: float) -> dict:
    (replica,) = start_replicas(args, "a", out)
    gw = Gateway([replica.url], [], out / "gateway_light.log")
    try:
        gw.start(60)
        favoured(gw, args)
        direct = figures(*drive(replica.url, rate, args.light_s, args, seed=3), args)
        through = figures(*drive(gw.url, rate, args.light_s, args, seed=3), args)
        return {"direct": direct, "gateway": through}
    finally:
        gw.stop()
        replica.stop()


def arm_ray(args, out: Path, cap_a: float) -> dict:
    """``tidegate serve --ray-replicas 2`` (both replicas with replica A's KV: one deployment, one config):
    its capacity, ``--load`` x that, and replica A's light load, through Ray Serve's proxy and router."""
    fleet = Server(["--ray-replicas", "2", "--threads", "1", "--kv-capacity-tokens", str(args.kv_tokens),
                    "--controller", args.controller, "--router", args.router, "--log-level", "warning"],
                   out / "ray_fleet.log")
    fleet.start(300)
    time.sleep(2.0)  # Ray's proxy learns of its replicas by long poll
    favoured(fleet, args)
    try:
        cap = summarize(*drive(fleet.url, args.flood_rps, args.capacity_s, args, seed=1))["throughput_rps"]
        log(f"  Ray Serve fleet capacity {cap:.2f} req/s")
        probe = probed(fleet.url, args.duration, out)
        over = figures(*drive(fleet.url, args.load * cap, args.duration, args, seed=2), args)
        over.update(probe())
        light = figures(*drive(fleet.url, 0.3 * cap_a, args.light_s, args, seed=3), args)
        return {"capacity_rps": cap, "overload": over, "light": light}
    finally:
        fleet.stop()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", type=float, default=3.0, help="overload, x capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per overload arm")
    p.add_argument("--capacity-s", type=float, default=30.0)
    p.add_argument("--light-s", type=float, default=30.0)
    p.add_argument("--flood-rps", type=float, default=40.0, help="arrivals of the capacity runs")
    p.add_argument("--kv-tokens", type=int, default=4096, help="replica A's KV cache; B gets half")
    p.add_argument("--controller", default="slo-flow", help="the replicas' own controller")
    p.add_argument("--router", default="predicted-delay")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=2000)
    p.add_argument("--tpot-slo-ms", type=float, default=200)
    p.add_argument("--client-nice", type=int, default=5,
                   help="the servers (and the idle probe) run this many steps less nice than the clients")
    p.add_argument("--arms", default="capacity,separate,fleet,light,kill,ray")
    p.add_argument("--rounds", type=int, default=1,
                   help="the separate and fleet arms this many times over, interleaved (the ratios per round)")
    p.add_argument("--out", type=Path, default=Path("docs/bench/gateway"))
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "tidegate-gateway-bench"
    logs.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    res: dict = {"machine": f"{platform.node()} {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
                 "args": {k: str(v) for k, v in vars(args).items()}}
    log("capacity of each replica, both flooded at once")
    runs, _, _, _ = arm_separate(args, logs, [args.flood_rps, args.flood_rps], args.capacity_s, seed=1)
    cap = {n: summarize(o, w)["throughput_rps"] for n, (o, w) in zip("ab", runs)}
    res["capacity_rps"] = cap
    fleet_cap = sum(cap.values())
    log(f"capacity a {cap['a']:.2f}, b {cap['b']:.2f}, fleet {fleet_cap:.2f} req/s")
    slo = ["--ttft-slo-s", str(args.ttft_slo_ms / 1000), "--tpot-slo-s", str(args.tpot_slo_ms / 1000)]
    rounds = []
    for k in range(args.rounds):
        # the arms of a round one after the other, in the reverse order every other round: a VM whose speed drifts
        # within the hour favours no arm, and each round's ratios pair arms minutes apart on the same arrivals
        one: dict = {}
        order = [a for a in ("separate", "fleet") if a in arms]
        for arm in (order if k % 2 == 0 else order[::-1]):
            if arm == "separate":
                log(f"round {k + 1}: separate, each replica at {args.load}x its own capacity, all at once")
                runs, counts, held, probe = arm_separate(args, logs, [args.load * cap["a"], args.load * cap["b"]],
                                                         args.duration, seed=2, probe=True)
                one["separate"] = {n: {**figures(o, w, args), "preemptions": c, "held": [h]}
                                   for n, (o, w), c, h in zip("ab", runs, counts, held)}
                one["separate"]["a"].update(probe)
                one["separate_goodput_sum"] = sum(r["goodput_rps"] for r in one["separate"].values())
            else:
                fleets = [("gateway", ["--router", args.router, *slo]),
                          ("round_robin", ["--router", "round-robin", "--no-admission"])]
                for name, gateway_args in (fleets if k % 2 == 0 else fleets[::-1]):
                    log(f"round {k + 1}: the fleet behind {name.replace('_', ' ')} at {args.load}x")
                    one[name] = arm_fleet(args, logs, args.load * fleet_cap, gateway_args, seed=2,
                                          name=name.replace("_", "-"))
        rounds.append(one)
    if rounds and rounds[0]:
        res.update(rounds[0])  # the table's arms: the first round's
        if args.rounds > 1:
            res["rounds"] = [{"separate_goodput_sum": r.get("separate_goodput_sum"),
                              "gateway": r.get("gateway", {}).get("goodput_rps"),
                              "round_robin": r.get("round_robin", {}).get("goodput_rps")} for r in rounds]
    if "light" in arms:
        log("light load: direct and through the gateway")
        res["light"] = arm_light(args, logs, 0.3 * cap["a"])
    if "kill" in arms:
        log("kill: replica b killed at half time, fleet at 1x")
        res["kill"] = arm_fleet(args, logs, fleet_cap, ["--router", args.router, *slo], seed=4, kill=True)
    if "ray" in arms:
        log(f"Ray Serve: tidegate serve --ray-replicas 2, its capacity, then {args.load}x it and light load")
        res["ray"] = arm_ray(args, logs, cap["a"])
    (args.out / "gateway.json").write_text(json.dumps(res, indent=2))
    write_report(res, args.out)
    log(f"wrote {args.out}/gateway.json, gateway.md, gateway.png")


def write_report(res: dict, out: Path) -> None:
    sep, light = res.get("separate", {}), res.get("light", {})
    rows = [("replica a alone", sep.get("a")), ("replica b alone", sep.get("b")), ("gateway", res.get("gateway")),
            ("round robin", res.get("round_robin")), ("light: direct", light.get("direct")),
            ("light: gateway", light.get("gateway")), ("kill: gateway", res.get("kill")),
            ("Ray Serve, 2 replicas", res.get("ray", {}).get("overload")),
            ("light: Ray Serve", res.get("ray", {}).get("light"))]
    lines = [f"# Two replicas behind the gateway ({res['date']}, {res['machine']})", "",
             f"Capacity (req/s): {json.dumps(res['capacity_rps'])}", "",
             "| arm | goodput req/s | served | 429 | 503 | 5xx | stream errors | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| 429 p99 ms: client / idle probe | preempted |", "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for name, r in rows:
        if r:
            lines.append(f"| {name} | {r['goodput_rps']:.2f} | {r['completed']}/{r['sent']} | {r['rejected_429']} | "
                         f"{r['unavailable_503']} | {r['server_errors_5xx']} | {r['stream_errors']} | "
                         f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.0f} / "
                         f"{r['tpot_p99_ms']:.0f} | {r['reject_latency_p99_ms']:.0f} / "
                         f"{r.get('probe_429_p99_ms', float('nan')):.0f} | {r.get('preemptions', float('nan')):.0f} |")
    if res.get("gateway") and res.get("round_robin") and res.get("separate_goodput_sum"):
        g = res["gateway"]["goodput_rps"]
        lines += ["", f"Gateway goodput: **{g / max(res['round_robin']['goodput_rps'], 1e-12):.2f}x** round robin's, "
                      f"**{g / res['separate_goodput_sum']:.2f}x** the replicas' separate goodputs summed "
                      f"({res['separate_goodput_sum']:.2f} req/s)."]
    if res.get("rounds"):
        lines += ["", "| round | separate, summed | gateway | round robin | gateway / round robin "
                      "| gateway / separate |", "|---:|---:|---:|---:|---:|---:|"]
        vs_rr, vs_sep = [], []
        for i, r in enumerate(res["rounds"], 1):
            g, rr, sep = r["gateway"], r["round_robin"], r["separate_goodput_sum"]
            a = g / rr if g is not None and rr else float("nan")
            b = g / sep if g is not None and sep else float("nan")
            vs_rr.append(a)
            vs_sep.append(b)
            cells = ["" if x is None else f"{x:.2f}" for x in (sep, g, rr)]
            lines.append(f"| {i} | {' | '.join(cells)} | {a:.2f}x | {b:.2f}x |")

        def gmean(xs):
            xs = [x for x in xs if x > 0]  # NaN is not: a round without the arm
            return statistics.geometric_mean(xs) if xs else float("nan")

        lines += ["", f"Over {len(res['rounds'])} rounds (geometric mean of the rounds' ratios): the gateway "
                      f"**{gmean(vs_rr):.2f}x** round robin's goodput, **{gmean(vs_sep):.2f}x** the replicas' "
                      "separate goodputs summed."]
    by_replica = [(name, r["served_by_replica"]) for name, r in rows if r and r.get("served_by_replica")]
    if by_replica:
        lines += ["", "Served by each replica through the gateway (a, b; the idle probe's requests among them): "
                      + "; ".join(f"{name}: {' and '.join(str(n) for n in ns)}" for name, ns in by_replica) + "."]
    held = [(name, r["held"]) for name, r in rows if r and r.get("held")]
    if held:
        lines += ["", "What the replicas held while each arm ran (mean of their gauges every 0.5 s; a, then b): "
                      + "; ".join(f"{name}: " + ", ".join(f"{h['running']:.1f} running and {h['waiting']:.1f} waiting"
                                                          for h in hs) for name, hs in held) + "."]
    if res.get("gateway", {}).get("gateway_cpu_share") is not None:
        lines += ["", f"The gateway's process used {res['gateway']['gateway_cpu_share']:.0%} of a core at the overload "
                      f"(the machine has {os.cpu_count()}, shared with the replicas and the clients)."]
    if res.get("light"):
        d, t = res["light"]["direct"], res["light"]["gateway"]
        lines += ["", f"Light load: TTFT p50 {d['ttft_p50_ms']:.1f} ms direct, {t['ttft_p50_ms']:.1f} ms through the "
                      f"gateway (**{t['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms**)."]
    if res.get("kill"):
        k = res["kill"]
        lines += ["", f"Kill: {k['streams_broken']} streams broken, the last ended "
                      f"{k['slowest_end_after_kill_s']:.2f} s after the kill; {k['completed_after_kill']} requests "
                      "sent after it completed."]
    if res.get("ray"):
        r = res["ray"]
        lines += ["", f"Ray Serve (`tidegate serve --ray-replicas 2`, both replicas with replica a's KV): capacity "
                      f"{r['capacity_rps']:.2f} req/s; at {res['args']['load']}x it, goodput "
                      f"{r['overload']['goodput_rps']:.2f} req/s "
                      f"(**{r['overload']['goodput_rps'] / max(r['capacity_rps'], 1e-12):.2f}x** its capacity), "
                      f"{r['overload']['rejected_429']} answered 429, {r['overload']['server_errors_5xx']} 5xx."]
    (out / "gateway.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = [(n, r) for n, r in rows[:4] if r]
    if named:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar([n for n, _ in named], [r["goodput_rps"] for _, r in named], color="#3a7")
        ax.set_ylabel("goodput (req/s)")
        ax.set_title("Two tiny-model replicas at the same overload")
        fig.tight_layout()
        save_png(fig, out / "gateway.png", dpi=120)


if __name__ == "__main__":
    main()
