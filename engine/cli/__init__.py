"""The ``tidegate`` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from engine.cli.support import friendly


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"{what} must be positive numbers, got {text!r}")
    return values


def workload_options(fn):
    """The options that pick and shape a workload."""
    opts = [
        click.option("--trace", help="Trace file (Splitwise/Vidur, Azure 2023, BurstGPT CSV, Mooncake "
                     "JSONL) or a shipped name: splitwise_conv, splitwise_code."),
        click.option("--workload", help="Synthetic workload YAML (or the shipped paper_sec41)."),
        click.option("--rate-scale", type=float, default=None, help="Replay at this many times the trace's speed."),
        click.option("--load", type=float, default=None,
                     help="Replay at this multiple of the fluid bound lambda_max (instead of --rate-scale)."),
        click.option("--first", "first_n", type=click.IntRange(min=1), default=None, help="Keep the first N requests."),
        click.option("--start-s", type=float, default=None, help="Keep requests from this trace time on."),
        click.option("--end-s", type=float, default=None, help="Keep requests before this trace time."),
        click.option("--length-scale", type=float, default=1.0, show_default=True,
                     help="Multiply prompt and output lengths (for small models)."),
        click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                     help="max_tokens of every request (outputs are capped to it; default 2048)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of synthetic draws and controllers."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def load_arrivals(trace, workload, first_n, start_s, end_s, length_scale, max_tokens, seed, rate_scale=None):
    from engine.workloads.workload import load_synthetic, read_trace, resolve_trace
    if bool(trace) == bool(workload):
        raise click.UsageError("give exactly one of --trace FILE or --workload FILE.yaml")
    if workload:
        if first_n or start_s is not None or end_s is not None:
            raise click.UsageError("--first, --start-s and --end-s apply to traces, not to --workload")
        return load_synthetic(resolve_trace(workload), seed=seed, rate_scale=rate_scale or 1.0,
                              length_scale=length_scale, max_tokens_cap=max_tokens)
    return read_trace(resolve_trace(trace), rate_scale=rate_scale or 1.0, first_n=first_n, start_s=start_s,
                      end_s=end_s, length_scale=length_scale, max_tokens_cap=max_tokens)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """tidegate: admission and batching control for streaming LLM inference."""


@main.command()
@workload_options
@click.option("--profile", "profile_name", default="a100-llama2-7b", show_default=True,
              help="Profile name (slot, a100-llama2-7b, h200-llama3-8b) or a JSON/YAML file.")
@click.option("--controller", "controller_spec", default="greedy", show_default=True,
              help="NAME[:key=value,...]; names: greedy, no-evict, sglang, watermark, class-budgets, flow.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal).")
@friendly()
def simulate(trace, workload, rate_scale, load, first_n, start_s, end_s, length_scale, max_tokens, seed,
             profile_name, controller_spec, as_json, progress):
    """Replay a trace or synthetic workload through the simulator twin."""
    from ctrl import build_controller
    from engine.bench.bench import rate_scale_for_load
    from engine.core.profile import load_profile
    from engine.sim.simulate import simulate as run
    from engine.workloads.workload import Arrival

    if rate_scale is not None and load is not None:
        raise click.UsageError("give --rate-scale or --load, not both")
    if rate_scale is not None and rate_scale <= 0:
        raise click.BadParameter("--rate-scale must be > 0")
    if load is not None and load <= 0:
        raise click.BadParameter("--load must be > 0")
    profile = load_profile(profile_name)
    arrivals = load_arrivals(trace, workload, first_n, start_s, end_s, length_scale, max_tokens, seed, rate_scale)
    if load is not None:
        scale, _ = rate_scale_for_load(arrivals, profile, load)
        arrivals = [Arrival(a.arrival_time_s / scale, a.prompt_tokens, a.output_tokens, a.max_tokens, a.class_id)
                    for a in arrivals]
    controller = build_controller(controller_spec, profile, arrivals)
    if hasattr(controller, "seed"):
        controller.seed = seed
    show = sys.stderr.isatty() if progress is None else progress
    summary = run(arrivals, profile, controller, record_steps=False, progress=show).summary
    summary = {"controller": controller_spec, "profile": profile.name, **summary}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        width = max(len(k) for k in summary)
        for k, v in summary.items():
            click.echo(f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}")


@main.command()
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
@click.option("--length-scale", type=float, default=1.0, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel simulations (default: cores).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
              show_default=True)
@friendly()
def bench(traces, controllers, loads, profile_name, first_n, start_s, end_s, length_scale, max_tokens, seed,
          jobs, out_dir):
    """Every controller at several loads on traces: table, CSV and plots."""
    from engine.bench.bench import DEFAULT_CONTROLLERS, TABLE_COLUMNS, markdown_table, run_bench
    from engine.core.profile import load_profile

    profile = load_profile(profile_name)
    if controllers is None:
        specs = list(DEFAULT_CONTROLLERS)
    else:
        sep = ";" if ";" in controllers or ":" in controllers else ","
        specs = [s.strip() for s in controllers.split(sep) if s.strip()]
    rows = run_bench(list(traces), specs, _floats(loads, "--loads"), profile, out_dir, first_n=first_n,
                     start_s=start_s, end_s=end_s, length_scale=length_scale, max_tokens_cap=max_tokens,
                     seed=seed, jobs=jobs)
    click.echo(markdown_table(rows, TABLE_COLUMNS))
    click.echo(f"\nwrote {out_dir}/results.csv, results.md and plots (kv_usage_*, ttft_cdf_*, goodput_*.png)")


@main.command()
@workload_options
@click.option("--profile", "profile_name", default="a100-llama2-7b", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly()
def capacity(trace, workload, rate_scale, load, first_n, start_s, end_s, length_scale, max_tokens, seed,
             profile_name, as_json):
    """Lifetime KV workload, the necessary rate bound and the fluid bound lambda_max."""
    from ctrl.theory import capacity as fluid_capacity
    from engine.core.profile import load_profile
    from engine.workloads.workload import trace_stats

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


@main.command()
@click.option("--model", default="tiny", show_default=True, help="'tiny' (built-in, offline) or a local model folder.")
@click.option("--served-model-name", default=None, help="Model name clients send (default: --model).")
@click.option("--controller", "controller_spec", default="learned", show_default=True,
              help="NAME[:key=value,...] (see `tidegate simulate --help`); 'learned' is the shipped policy "
                   "inside the shield.")
@click.option("--profile", "profile_name", default=None,
              help="Step-time profile of this model and machine, for the controllers' estimates "
                   "(default: tiny-cpu; make one with `tidegate profile`).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--kv-capacity-tokens", type=click.IntRange(min=1), default=None,
              help="KV cache size M in tokens (default: 32768 on CPU, 80% of free memory on CUDA).")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when available).")
@click.option("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on CUDA, fp32 on CPU).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests admitted and not yet answered before new ones get 429.")
@click.option("--queue-timeout-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="A request that waits this long without starting ends with 503.")
@click.option("--stream-buffer-chunks", type=click.IntRange(min=1), default=512, show_default=True,
              help="Chunks buffered for one slow client before its stream is ended.")
@click.option("--drain-timeout-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, how long in-flight requests may take to finish.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens of a chat request that sets none.")
@friendly()
def serve(model, served_model_name, controller_spec, profile_name, host, port, kv_capacity_tokens, block_size,
          max_num_batched_tokens, max_num_seqs, device, dtype, max_in_flight, queue_timeout_s,
          stream_buffer_chunks, drain_timeout_s, default_max_tokens):
    """The OpenAI-compatible streaming server (/v1/completions, /v1/chat/completions, /metrics)."""
    import logging

    from ctrl import build_controller
    from engine.serve.server import GracefulServer, ServeConfig, build_service, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.core.profile import load_profile

    build_controller(controller_spec, load_profile(profile_name or "tiny-cpu"))  # fail before the model loads
    config = ServeConfig(model=model, served_model_name=served_model_name, controller=controller_spec,
                         profile=profile_name, host=host,
                         port=port, kv_capacity_tokens=kv_capacity_tokens, block_size=block_size,
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, device=device,
                         dtype=dtype, max_in_flight=max_in_flight, queue_timeout_s=queue_timeout_s,
                         stream_buffer_chunks=stream_buffer_chunks, drain_timeout_s=drain_timeout_s,
                         default_max_tokens=default_max_tokens)
    try:
        service = build_service(config)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"tidegate: serving {config.model_name!r} with controller {controller_spec!r} on "
               f"http://{host}:{port}/v1 (KV capacity {service.core.pool.capacity_tokens} tokens)", err=True)
    GracefulServer(create_app(service, config), service, config).run()


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="Base URL of the server.")
@click.option("--trace", default=None, help="Replay a trace's timing and lengths.")
@click.option("--dataset", type=click.Choice(["random"]), default=None, help="Random prompts instead of a trace.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Requests per second (random dataset; default: all at once).")
@click.option("--rate-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Replay a trace this many times faster.")
@click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Coefficient of variation of inter-arrival times (1 = Poisson).")
@click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop scheduling arrivals after this many seconds.")
@click.option("--num-requests", type=click.IntRange(min=1), default=None, help="Requests to send.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None)
@click.option("--input-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--length-scale", type=float, default=1.0, show_default=True, help="Scale trace lengths.")
@click.option("--max-tokens", "max_tokens_cap", type=click.IntRange(min=1), default=None, help="Cap trace outputs.")
@click.option("--goodput", "goodput_slos", multiple=True, help="SLO for goodput, e.g. --goodput ttft:2000 --goodput tpot:100 (ms).")
@click.option("--model", default=None, help="Model name (default: the server's first).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@friendly()
def loadgen(url, trace, dataset, rate, rate_scale, burstiness, duration_s, num_requests, max_concurrency,
            input_len, output_len, length_scale, max_tokens_cap, goodput_slos, model, seed, out_path):
    """Streaming load against any OpenAI-compatible server; latency percentiles, goodput, 429s."""
    from engine.bench.loadgen import format_summary, outcomes_json, plan_random, plan_trace, run, run_load, summarize
    from engine.workloads.workload import read_trace, resolve_trace

    if bool(trace) == bool(dataset):
        raise click.UsageError("give exactly one of --trace FILE or --dataset random")
    slos = {}
    for item in goodput_slos:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot"):
            raise click.BadParameter(f"--goodput {item!r}: expected ttft:MS or tpot:MS")
        try:
            slos[key] = float(value) / 1000
        except ValueError:
            raise click.BadParameter(f"--goodput {item!r}: expected a number of milliseconds") from None
    if trace:
        arrivals = read_trace(resolve_trace(trace), rate_scale=rate_scale, first_n=num_requests,
                              length_scale=length_scale, max_tokens_cap=max_tokens_cap,
                              end_s=None if duration_s is None else duration_s * rate_scale)
        plan = plan_trace(arrivals)
    else:
        if num_requests is None and duration_s is None:
            raise click.UsageError("--dataset random needs --num-requests or --duration")
        plan = plan_random(num_requests or 10**9, rate or float("inf"), burstiness, input_len, output_len, seed,
                           duration_s)
    outcomes, wall = run(run_load(url, plan, model, max_concurrency, progress=sys.stderr.isatty()))
    summary = summarize(outcomes, wall, slos.get("ttft"), slos.get("tpot"))
    click.echo(format_summary(summary))
    if out_path:
        Path(out_path).write_text(json.dumps({"summary": summary, "requests": outcomes_json(outcomes)}))


def _register_commands() -> None:
    from engine.cli.real import generate_command, profile_command, twin_check_command
    from training.cli import evaluate_command, export_command, train_command

    for command in (generate_command, profile_command, twin_check_command, train_command, export_command,
                    evaluate_command):
        main.add_command(command)


_register_commands()


