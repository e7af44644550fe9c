"""Commands of the simulator twin: ``simulate``, ``bench``, ``capacity`` and ``roofline``."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import click

from tidegate.engine.cli.support import POSITIVE, friendly, load_arrivals, parse_floats, workload_options


@click.command()
@workload_options
@click.option("--profile", "profile_name", default="a100-llama2-7b", show_default=True,
              help="Profile name (slot, a100-llama2-7b, h200-llama3-8b) or a JSON/YAML file.")
@click.option("--controller", "controller_spec", default="greedy", show_default=True,
              help="NAME[:key=value,...]; names: greedy, no-evict, sglang, watermark, class-budgets, flow, "
                   "slo-flow, learned.")
@click.option("--eviction", type=click.Choice(["recompute", "reset"]), default="recompute", show_default=True,
              help="What an evicted request keeps. recompute: its generated tokens (their KV is recomputed by "
                   "prefill, as in vLLM and the real engine); reset: nothing, it starts over (the paper's model, "
                   "for reproducing its results).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Reuse the KV blocks of prompt prefixes the workload says are shared (Mooncake hash_ids, "
                   "synthetic shared_prefix_tokens and turns), as vLLM does by default.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Simulate a fleet of this many replicas of the profile behind the gateway's code (the fleet twin, "
                   "docs/GATEWAY.md); --controller is each replica's own, --load is per the fleet's capacity.")
@click.option("--router", type=click.Choice(["predicted-delay", "least-loaded", "power-of-two", "round-robin",
                                             "prefix-affinity"]), default="predicted-delay", show_default=True,
              help="With --replicas: the gateway's router.")
@click.option("--gateway-admission/--no-gateway-admission", default=True, show_default=True,
              help="With --replicas: the gateway's admission and queue, or a plain router.")
@click.option("--replica-profiles", default=None, metavar="NAME,NAME,...",
              help="With --replicas: the replicas' profiles, in turn (a fleet of unlike replicas; --load is then per "
                   "the sum of their capacities) [default: --profile for every replica].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal).")
@friendly()
def simulate(trace, workload, rate_scale, load, first_n, start_s, end_s, length_scale, max_tokens, seed,
             profile_name, controller_spec, eviction, prefix_caching, replicas, router, gateway_admission,
             replica_profiles, as_json, progress):
    """Replay a trace or synthetic workload through the simulator twin."""
    from tidegate.ctrl import build_controller
    from tidegate.engine.bench.bench import rate_scale_for_load
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.sim.simulate import simulate as run

    if rate_scale is not None and load is not None:
        raise click.UsageError("give --rate-scale or --load, not both")
    if rate_scale is not None and rate_scale <= 0:
        raise click.BadParameter("--rate-scale must be > 0")
    if load is not None and load <= 0:
        raise click.BadParameter("--load must be > 0")
    profile = load_profile(profile_name)
    if replica_profiles is not None and replicas is None:
        raise click.UsageError("--replica-profiles applies with --replicas")
    names = [n.strip() for n in (replica_profiles or profile_name).split(",") if n.strip()]
    if not names:
        raise click.BadParameter("--replica-profiles needs at least one profile name")
    if replicas is not None and len(names) > replicas:
        raise click.BadParameter(f"--replica-profiles names {len(names)} profiles for {replicas} replicas; the "
                                 f"profiles repeat over the replicas, so give at most one each")
    fleet = [load_profile(names[i % len(names)]) for i in range(replicas or 1)] if replicas else [profile]
    arrivals = load_arrivals(trace, workload, first_n, start_s, end_s, length_scale, max_tokens, seed, rate_scale)
    if load is not None:
        scale = sum(rate_scale_for_load(arrivals, p, load)[0] for p in fleet)
        arrivals = [replace(a, arrival_time_s=a.arrival_time_s / scale) for a in arrivals]
    if replicas is not None:
        from tidegate.engine.gateway.twin import FleetSettings

        summary = _simulate_fleet(arrivals, fleet, controller_spec, seed, replicas,
                                  FleetSettings(router=router, admission=gateway_admission, eviction=eviction),
                                  prefix_caching, progress)
        _print(summary, as_json)
        return
    controller = build_controller(controller_spec, profile, arrivals)
    if hasattr(controller, "seed"):
        controller.seed = seed
    show = sys.stderr.isatty() if progress is None else progress
    summary = run(arrivals, profile, controller, record_steps=False, progress=show, eviction=eviction,
                  prefix_caching=prefix_caching).summary
    summary = {"controller": controller_spec, "profile": profile.name, "eviction": eviction,
               "prefix_caching": prefix_caching, **summary}
    _print(summary, as_json)


def _simulate_fleet(arrivals, profiles, controller_spec, seed, replicas, settings, prefix_caching, progress) -> dict:
    """``simulate --replicas N``: the fleet twin, one profile per replica."""
    from tidegate.ctrl import build_controller
    from tidegate.engine.gateway.twin import simulate_fleet

    controllers = []
    for profile in profiles:
        c = build_controller(controller_spec, profile, arrivals)
        if hasattr(c, "seed"):
            c.seed = seed
        controllers.append(c)
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(arrivals), desc=f"{replicas} replicas", unit="req", leave=False, mininterval=0.5)
    summary = simulate_fleet(arrivals, profiles, controllers, settings,
                             prefix_caching=prefix_caching, noise_seed=seed,
                             on_progress=None if bar is None else lambda n: bar.update(n - bar.n))
    if bar is not None:
        bar.close()
    return {"controller": controller_spec, "profile": ",".join(dict.fromkeys(p.name for p in profiles)),
            "replicas_n": replicas, "eviction": settings.eviction,
            "prefix_caching": prefix_caching, **summary}


def _finite(value):
    """``value`` with every NaN or infinite float inside it (dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _print(summary: dict, as_json: bool) -> None:
    if as_json:  # strict JSON: a figure that is not a number (no request served, a span of no time) is null
        click.echo(json.dumps(_finite(summary), allow_nan=False))
        return
    width = max(len(k) for k in summary)
    for k, v in summary.items():
        if k == "replicas" and isinstance(v, list):
            for i, r in enumerate(v):
                click.echo(f"{'replica ' + str(i):<{width}}  " + ", ".join(
                    f"{rk} {rv:.4g}" if isinstance(rv, float) else f"{rk} {rv}" for rk, rv in r.items()))
            continue
        click.echo(f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}")


@click.command()
@click.option("--trace", "traces", multiple=True, default=("splitwise_conv",), show_default=True,
              help="Trace file or shipped name; repeat for several.")
@click.option("--controllers", default=None,
              help="Comma-separated controller specs (default: every controller). Separate specs with ';' "
                   "when they carry options, e.g. 'greedy;flow:budget=2,dist=poisson'.")
@click.option("--loads", default="0.8,1.0,1.5,2.0", show_default=True, help="Loads as multiples of lambda_max.")
@click.option("--profile", "profile_name", default="a100-llama2-7b", show_default=True)
@click.option("--first", "first_n", type=click.IntRange(min=1), default=None, help="Keep the first N requests.")
@click.option("--start-s", type=float, default=None)
@click.option("--end-s", type=float, default=None)
@click.option("--length-scale", type=POSITIVE, default=1.0, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel simulations (default: cores).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
              show_default=True)
@friendly()
def bench(traces, controllers, loads, profile_name, first_n, start_s, end_s, length_scale, max_tokens, seed,
          jobs, out_dir):
    """Every controller at several loads on traces: table, CSV and plots."""
    from tidegate.engine.bench.bench import DEFAULT_CONTROLLERS, TABLE_COLUMNS, markdown_table, run_bench
    from tidegate.engine.core.profile import load_profile

    profile = load_profile(profile_name)
    if controllers is None:
        specs = list(DEFAULT_CONTROLLERS)
    else:
        sep = ";" if ";" in controllers or ":" in controllers else ","
        specs = [s.strip() for s in controllers.split(sep) if s.strip()]
        if not specs:
            raise click.BadParameter(f"--controllers names no controller: {controllers!r} (separate them with ';' "
                                     f"when a spec has options, e.g. 'greedy;flow:budget=2')")
    rows = run_bench(list(traces), specs, parse_floats(loads, "--loads"), profile, out_dir, first_n=first_n,
                     start_s=start_s, end_s=end_s, length_scale=length_scale, max_tokens_cap=max_tokens,
                     seed=seed, jobs=jobs)
    click.echo(markdown_table(rows, TABLE_COLUMNS))
    click.echo(f"\nwrote {out_dir}/results.csv, results.md and plots (kv_usage_*, ttft_cdf_*, goodput_*.png)")


@click.command()
@workload_options
@click.option("--profile", "profile_name", default="a100-llama2-7b", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly()
def capacity(trace, workload, rate_scale, load, first_n, start_s, end_s, length_scale, max_tokens, seed,
             profile_name, as_json):
    """Lifetime KV workload, the necessary rate bound and the fluid bound lambda_max."""
    from tidegate.ctrl.theory import capacity as fluid_capacity
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.workloads import trace_stats

    if load is not None:
        raise click.UsageError("capacity reports the offered load as a multiple of lambda_max; --load applies to "
                               "simulate (--rate-scale changes the trace's speed here)")
    profile = load_profile(profile_name)
    arrivals = load_arrivals(trace, workload, first_n, start_s, end_s, length_scale, max_tokens, seed, rate_scale)
    cap = fluid_capacity([a.prompt_tokens for a in arrivals], [a.output_tokens for a in arrivals], profile)
    stats = trace_stats(arrivals)
    out = {"profile": profile.name, "requests": stats["requests"], "mean_rate_rps": stats["mean_rate_rps"],
           **cap.as_dict(), "load_vs_lambda_max": stats["mean_rate_rps"] / cap.lambda_max_rps}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"profile                    {profile.name}")
    click.echo(f"requests                   {out['requests']}")
    click.echo(f"mean arrival rate          {out['mean_rate_rps']:.4g} req/s")
    click.echo(f"S = E[P] + E[D]            {cap.mean_tokens_per_request:.6g} tokens")
    click.echo(f"W = E[PD] + E[D(D+1)]/2    {cap.lifetime_kv_workload:.6g} token-steps (lifetime KV workload)")
    click.echo(f"M                          {cap.kv_capacity_tokens} tokens")
    click.echo(f"memory bound M/(W t_full)  {cap.memory_bound_rps:.4g} req/s (necessary condition)")
    click.echo(f"lambda_max (fluid)         {cap.lambda_max_rps:.4g} req/s")
    click.echo(f"offered load               {out['load_vs_lambda_max']:.3g} x lambda_max")


@click.command()
@click.option("--write", is_flag=True, help="Regenerate the preset profile files.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where --write puts the files (default: the shipped profiles folder).")
@friendly()
def roofline(write, out_dir):
    """The roofline presets' step-time coefficients; with --write, their profile files."""
    from tidegate.engine.core.profile import PROFILES_DIR
    from tidegate.engine.sim.roofline import coefficient_table, preset_profiles

    profiles = preset_profiles()
    click.echo(coefficient_table(profiles))
    if write:
        folder = out_dir or PROFILES_DIR
        folder.mkdir(parents=True, exist_ok=True)
        for profile in profiles:
            path = folder / f"{profile.name}.json"
            profile.save(path)
            click.echo(f"wrote {path}")


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of the compiled copy [default: $TIDEGATE_COMPILED_DIR, else build/compiled in the "
                   "project].")
def compile_command(out):
    """Compile the simulator's core (engine loop, executor, heuristics, shield) with mypyc, for
    `tidegate --compiled ...` and the speed benchmarks' --compiled. Needs a C compiler."""
    from tidegate.engine.sim import compiled

    try:
        where = compiled.build(out, log=lambda line: click.echo(line, err=True))
    except compiled.CompileError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo(f"compiled {len(compiled.MODULES)} modules into {where}; run `tidegate --compiled <command>`")
