"""Commands of the server side: ``serve`` (the OpenAI-compatible server) and ``loadgen``."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from tidegate.ctrl import DEFAULT_CONTROLLER
from tidegate.engine.cli.support import fail, friendly
from tidegate.engine.cli.vllm_serve import VllmServeError, serve_vllm
from tidegate.engine.gateway.routers import PROMPT_FREE_ROUTERS


LOG_LEVELS = ("debug", "info", "warning", "error")


class _StartError(Exception):
    """The server cannot start for a reason the user can fix (the port is taken)."""


@click.command()
@click.version_option(package_name="tidegate", prog_name="tidegate")
@click.option("--engine", type=click.Choice(["tidegate", "vllm"]), default="tidegate", show_default=True,
              help="tidegate's own engine, or vLLM's OpenAI server with tidegate's controller in its scheduler and "
                   "its 429 in its API process (vLLM runs from .venv-vllm, `make vllm-setup`; --controller vllm: "
                   "vLLM's own scheduling, the baseline). With vllm, --host, --port, --served-model-name, "
                   "--max-model-len, --dtype, --api-key, --chat-template and --trust-request-chat-template go to "
                   "vLLM; the options of tidegate's own engine do not apply.")
@click.option("--vllm-arg", "vllm_args", multiple=True,
              help="With --engine vllm: more flags for vLLM's server, split as a shell would (repeatable), e.g. "
                   "--vllm-arg '--max-num-seqs 64' --vllm-arg=--enforce-eager.")
@click.option("--vllm-python", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --engine vllm: vLLM's python [default: .venv-vllm/bin/python beside the project].")
@click.option("--step-log", default=None,
              help="With --engine vllm: the plugin's CSV of one row per step (`tidegate profile --from-steps` "
                   "fits a profile from it).")
@click.option("--model", default="tiny", show_default=True, help="'tiny' (built-in, offline) or a local model folder.")
@click.option("--served-model-name", default=None, help="Model name clients send (default: --model).")
@click.option("--controller", "controller_spec", default=DEFAULT_CONTROLLER, show_default=True,
              help="NAME[:key=value,...] (see `tidegate simulate --help`); 'learned' is the shipped policy "
                   "inside the shield, with its runtime guard.")
@click.option("--profile", "profile_name", default=None,
              help="Step-time profile of this model and machine, for the controllers' estimates: a name or file "
                   "(make one with `tidegate profile`), or 'fit' to fit a quick one at start-up (the model is "
                   "loaded once more for it) [default: tiny-cpu, the tiny model's].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="TIDEGATE_API_KEY", show_envvar=True, default=None,
              help="Clients must send 'Authorization: Bearer KEY' (the probes /health, /ready, /metrics and "
                   "/version stay open).")
@click.option("--chat-template", "chat_template_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="A Jinja chat template file, used instead of the tokenizer's.")
@click.option("--trust-request-chat-template/--no-trust-request-chat-template", default=False, show_default=True,
              help="Take a chat request's own chat_template (rendered in a sandbox), as vLLM's flag of that name.")
@click.option("--generation-config", type=click.Choice(["auto", "vllm"]), default="auto", show_default=True,
              help="auto: a request that leaves out temperature, top_p, top_k, min_p or a penalty gets the model "
                   "folder's generation_config.json value, as vLLM's flag of that name; vllm: OpenAI's defaults.")
@click.option("--enable-auto-tool-choice", is_flag=True, default=False,
              help="Serve tool_choice 'auto' (the default with tools): the model chooses between text and calls, "
                   "read by --tool-call-parser, as vLLM's flags.")
@click.option("--tool-call-parser", type=click.Choice(["hermes"]), default=None,
              help="The model's syntax of a tool call: hermes (<tool_call>{...}</tool_call>: Qwen 2.5 and 3, Hermes).")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="The longest prompt + output served, in tokens (at most the model's context) "
                   "[default: the model's context].")
@click.option("--max-request-bytes", type=click.IntRange(min=1), default=16 * 1024 * 1024, show_default=True,
              help="A request body larger than this gets 413.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info", show_default=True)
@click.option("--access-log/--no-access-log", default=False, show_default=True,
              help="One log line per HTTP request (uvicorn's access log).")
@click.option("--kv-capacity-tokens", type=click.IntRange(min=1), default=None,
              help="KV cache size M in tokens (default: what fits in 1 GiB, or a quarter of the available memory if "
                   "less, on CPU; in 80% of the free memory on CUDA).")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="The most tokens one step computes (longer prompts are prefilled in chunks) [default: vLLM's "
                   "for the device: 2048 on a CPU; on CUDA 2048 to 16384 by the GPU's memory].")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
              help="The most requests running at once [default: vLLM's for the device: 128 on a CPU, 256 to 1024 "
                   "on CUDA].")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "--prefix-caching/--no-prefix-caching",
              "prefix_caching", default=True, show_default=True,
              help="A prompt whose leading blocks of tokens are in the KV cache starts after them instead of "
                   "computing them again (vLLM's automatic prefix caching, on by default as in vLLM).")
@click.option("--enable-prompt-tokens-details", is_flag=True,
              help="Usage says how many prompt tokens the prefix cache held (prompt_tokens_details.cached_tokens), "
                   "as vLLM's flag.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when available).")
@click.option("--dtype", default=None,
              help="float32, bfloat16, float16 [default: the fastest the device computes natively: bf16 on CUDA "
                   "(fp16 before Ampere); on a CPU bf16 where it has AMX or AVX512-BF16, else fp32].")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests admitted and not yet answered before new ones get 429.")
@click.option("--queue-timeout-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="A request that waits this long without starting ends with 503. A controller with a tighter "
                   "limit of its own keeps it (the learned one's shield: 5 x the TTFT SLO); the 503 says which.")
@click.option("--stream-buffer-chunks", type=click.IntRange(min=1), default=512, show_default=True,
              help="Chunks buffered for one slow client before its stream is ended.")
@click.option("--drain-timeout-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, how long in-flight requests may take to finish.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens of a chat request that sets none.")
@click.option("--engine-process/--engine-thread", default=True, show_default=True,
              help="Run the engine in a process of its own (the HTTP side never waits on model steps; a dead "
                   "or hung engine is replaced) or in a thread of the server's process.")
@click.option("--engine-timeout-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="An engine that sends nothing (not even its idle heartbeat) for this long is stopped; open "
                   "streams end with an error and a new engine starts.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads of the engine (default in an engine process: the cores no other work keeps "
                   "busy at its start, all but one for the HTTP side from four on; torch's default in an engine "
                   "thread).")
@click.option("--engine-nice", type=click.IntRange(0, 19), default=None,
              help="Niceness the engine process adds to the server's, so that on a busy machine health checks "
                   "and refusals are answered before model steps run (0: the same priority)  [default: 5]")
@friendly(_StartError, VllmServeError)
@click.option("--ray-replicas", type=click.IntRange(min=1), default=None,
              help="Serve as this many replicas on Ray Serve (the tidegate[ray] extra), each a tidegate server with "
                   "its own engine and controller, behind Ray Serve's HTTP proxy on --host/--port with the gateway's "
                   "router as Ray's request router (docs/GATEWAY.md, 'On Ray Serve').")
@click.option("--ray-address", default=None,
              help="With --ray-replicas: a running Ray cluster to deploy on ('auto', 'ray://HOST:10001') "
                   "[default: a local Ray on this machine].")
@click.option("--router", type=click.Choice(list(PROMPT_FREE_ROUTERS)), default="predicted-delay", show_default=True,
              help="With --ray-replicas: which replica with room takes a request (see `tidegate gateway --help`).")
@click.option("--ray-ttft-slo-s", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="With --ray-replicas: a request waits at the router for a replica with room while it would still "
                   "start within this; one that would not gets 429 with a Retry-After from the fleet's drain rate.")
@click.option("--ray-max-queued", type=click.IntRange(min=1), default=256, show_default=True,
              help="With --ray-replicas: the most requests waiting at the router; more get 429 with a Retry-After.")
@click.option("--ray-queue-ttl-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="With --ray-replicas: a request that waits this long at the router for a replica with room ends "
                   "with 503 (one of a less urgent priority may wait behind more urgent ones).")
@click.option("--ray-replica-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="With --ray-replicas: the CPUs Ray reserves for each replica.")
@click.option("--ray-replica-gpus", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="With --ray-replicas: the GPUs Ray reserves for each replica (1 to serve each on a GPU).")
@click.pass_context
def serve(ctx, engine, vllm_args, vllm_python, step_log, model, served_model_name, controller_spec, profile_name,
          host, port, api_key, chat_template_path, trust_request_chat_template, generation_config,
          enable_auto_tool_choice, tool_call_parser, max_model_len, max_request_bytes, log_level, access_log,
          kv_capacity_tokens, block_size,
          max_num_batched_tokens, max_num_seqs, prefix_caching, enable_prompt_tokens_details, device, dtype,
          max_in_flight, queue_timeout_s,
          stream_buffer_chunks, drain_timeout_s, default_max_tokens, engine_process, engine_timeout_s, threads,
          engine_nice, ray_replicas, ray_address, router, ray_ttft_slo_s, ray_max_queued, ray_queue_ttl_s,
          ray_replica_cpus, ray_replica_gpus):
    """The OpenAI-compatible streaming server (/v1/completions, /v1/chat/completions, /tokenize, /metrics)."""
    ray_options = {"ray_address": ray_address, "ray_ttft_slo_s": ray_ttft_slo_s, "ray_max_queued": ray_max_queued,
                   "ray_queue_ttl_s": ray_queue_ttl_s, "ray_replica_cpus": ray_replica_cpus,
                   "ray_replica_gpus": ray_replica_gpus, "router": router}
    if ray_replicas is None:
        given = [name for name in ray_options if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--{given[0].replace('_', '-')} applies to --ray-replicas")
    elif engine == "vllm":
        raise click.UsageError("--ray-replicas serves tidegate's own engine; --engine vllm does not apply")
    if engine == "vllm":
        serve_vllm(ctx, model, controller_spec, profile_name, vllm_args, vllm_python, step_log,
                   own_options=_OWN_ENGINE_OPTIONS)
    elif vllm_args or vllm_python or step_log:
        raise click.UsageError("--vllm-arg, --vllm-python and --step-log apply to --engine vllm")
    import logging

    from tidegate.ctrl import build_controller
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.serve import GracefulServer, ServeConfig, build_service, create_app
    from tidegate.engine.serve.launch import bind_sockets

    log_level = log_level.lower()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    chat_template = _read_chat_template(chat_template_path)
    fit = profile_name == "fit"
    # fail before the model loads, and say which policy a learned controller will run
    controller = build_controller(controller_spec, load_profile("tiny-cpu" if fit else profile_name or "tiny-cpu"))
    try:
        config = ServeConfig(model=model, served_model_name=served_model_name, controller=controller_spec,
                             profile=None if fit else profile_name, host=host,
                             port=port, kv_capacity_tokens=kv_capacity_tokens, block_size=block_size,
                             max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             prefix_caching=prefix_caching, enable_prompt_tokens_details=enable_prompt_tokens_details,
                             device=device, dtype=dtype, max_in_flight=max_in_flight,
                             queue_timeout_s=queue_timeout_s,
                             stream_buffer_chunks=stream_buffer_chunks, drain_timeout_s=drain_timeout_s,
                             default_max_tokens=default_max_tokens, generation_config=generation_config,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                             engine_process=engine_process,
                             engine_timeout_s=engine_timeout_s, threads=threads,
                             api_key=api_key or None,
                             chat_template=chat_template, trust_request_chat_template=trust_request_chat_template,
                             max_model_len=max_model_len,
                             max_request_bytes=max_request_bytes, log_level=log_level, access_log=access_log,
                             **({} if engine_nice is None else {"engine_nice": engine_nice}))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if ray_replicas is not None:
        if fit:
            raise click.UsageError("--profile fit does not apply to --ray-replicas; fit one with `tidegate profile` "
                                   "and pass its file")
        _serve_on_ray(config, ray_replicas, ray_options)
        return
    try:  # hold the port while the model loads: one taken fails now, not after
        sockets = bind_sockets(host, port)
    except ValueError as exc:
        raise _StartError(exc) from None
    try:
        _choose_profile(config, fit)
        service = build_service(config)
    except ValueError as exc:
        for sock in sockets:
            sock.close()
        raise click.UsageError(str(exc)) from None
    on_started = functools.partial(_banner, config, service, controller)
    try:
        GracefulServer(create_app(service, config), service, config, sockets, on_started).run()
    except KeyboardInterrupt:  # uvicorn may re-raise the Ctrl-C it shut down on: a stop asked for, not a failure
        pass
    click.echo("tidegate: stopped", err=True)


def _serve_on_ray(config, replicas: int, options: dict) -> None:
    """``tidegate serve --ray-replicas N``: deploy, say where, and serve until interrupted."""
    import signal
    import threading

    try:
        from tidegate.engine.gateway.ray_serve import RayFleetConfig, start, stop
    except ImportError as exc:
        raise click.UsageError(f"--ray-replicas needs Ray Serve: pip install 'tidegate[ray]' ({exc})") from None
    try:
        fleet = RayFleetConfig(replicas=replicas, router=options["router"], ttft_slo_s=options["ray_ttft_slo_s"],
                               max_queued=options["ray_max_queued"], queue_ttl_s=options["ray_queue_ttl_s"],
                               cpus=options["ray_replica_cpus"],
                               gpus=options["ray_replica_gpus"], address=options["ray_address"],
                               max_ongoing=config.max_in_flight)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        start(config, fleet)
    except KeyboardInterrupt:
        stop(fleet)
        raise click.Abort() from None
    except Exception as exc:  # Ray's errors: a cluster not reachable, replicas that fail to start
        stop(fleet)
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise click.ClickException(f"Ray Serve did not start: {type(exc).__name__}: "
                                   f"{lines[-1] if lines else 'no reason given'}") from None
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start, which installs handlers of its own
        signal.signal(sig, lambda *_: done.set())
    click.echo(f"tidegate: serving {config.model_name!r} with controller {config.controller!r} on "
               f"http://{config.host}:{config.port}/v1 as {replicas} Ray Serve replicas (router {fleet.router}, "
               f"{'cluster ' + fleet.address if fleet.address else 'a local Ray'})", err=True)
    try:
        while not done.wait(1.0):
            pass
    finally:
        click.echo("tidegate: stopping the Ray Serve application", err=True)
        stop(fleet)


#: the options of tidegate's own engine and server, which --engine vllm refuses (vLLM takes its own, --vllm-arg)
_OWN_ENGINE_OPTIONS = ("log_level", "access_log", "max_request_bytes", "kv_capacity_tokens", "block_size",
                       "max_num_batched_tokens", "max_num_seqs", "prefix_caching", "enable_prompt_tokens_details",
                       "device", "max_in_flight", "queue_timeout_s", "stream_buffer_chunks", "drain_timeout_s",
                       "default_max_tokens", "engine_process", "engine_timeout_s", "threads", "engine_nice",
                       "generation_config", "enable_auto_tool_choice", "tool_call_parser")


def _read_chat_template(path: Path | None) -> str | None:
    """The text of a ``--chat-template`` file, checked to be a Jinja template."""
    if path is None:
        return None
    from tidegate.engine.serve.chat import check_chat_template

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise click.BadParameter(f"the file {str(path)!r} does not exist", param_hint="--chat-template") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"the file {str(path)!r} cannot be read ({type(exc).__name__})",
                                 param_hint="--chat-template") from None
    try:
        check_chat_template(text, f"the file {str(path)!r}")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--chat-template") from None
    return text


def _choose_profile(config, fit: bool) -> None:
    """Fit a quick profile when asked to (``config.profile`` becomes its file), and say plainly when a
    model of one's own runs on the tiny model's profile."""
    import os

    from tidegate.engine.serve.launch import fit_profile

    if fit:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidegate" / "profiles"
        out = cache / f"fit-{Path(config.model).name}-{config.device or 'auto'}-{config.dtype or 'auto'}.json"
        click.echo(f"tidegate: fitting a quick step-time profile of {config.model!r} (the model loads once more "
                   f"for it)", err=True)
        config.profile = str(fit_profile(config, out))
        click.echo(f"tidegate: the fit is in {out}; `--profile {out}` uses it without fitting again", err=True)
    elif config.profile is None and (why := _unlike_tiny_cpu(config)):
        click.echo(f"tidegate: warning: no --profile, so the controllers estimate step times with tiny-cpu, the "
                   f"built-in tiny model's profile on a CPU in fp32, and their admission and TTFT estimates will be "
                   f"off for {why}; fit one with `tidegate profile --model MODEL --out FILE` and pass --profile FILE, "
                   f"or pass --profile fit to fit a quick one at start-up", err=True)


def _unlike_tiny_cpu(config) -> str | None:
    """What differs from what the shipped profile was fitted on (the tiny model, a CPU, fp32), if anything."""
    if config.model != "tiny":
        return "this model"
    import torch

    from tidegate.engine.real.model import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    if device.type != "cpu":
        return f"device {device}"
    if resolve_dtype(config.dtype, device) == torch.float32:
        return None
    return f"dtype {config.dtype}" if config.dtype else "dtype bf16 (this CPU's default)"


def _banner(config, service, controller) -> None:
    """What the server says once it listens."""
    info = service.info
    where = f"engine process {service.engine_pid}" if config.engine_process else "engine thread"
    click.echo(f"tidegate: serving {config.model_name!r} with controller {config.controller!r} on "
               f"http://{config.host}:{config.port}/v1 (KV capacity {info.kv_capacity_tokens} tokens, context "
               f"{info.max_model_len} tokens, {where})", err=True)
    if info.compute:
        click.echo(f"tidegate: the engine computes in {info.compute}", err=True)
    profile = info.profile
    click.echo(f"tidegate: step-time profile {profile.name!r}: {profile.description}", err=True)
    if config.api_key:
        click.echo("tidegate: clients must send the API key ('Authorization: Bearer KEY'); the probes stay open",
                   err=True)
    policy_note = getattr(getattr(controller, "inner", None), "policy_status", None)
    if policy_note:
        click.echo(f"tidegate: {policy_note}", err=True)
    mode = getattr(controller, "mode", None)
    if mode is not None:
        click.echo(f"tidegate: shield in {mode} mode ("
                   + ("zero evictions: every running request's prompt + max_tokens is reserved"
                      if mode == "strict" else "eviction rate bounded, see docs/SAFETY.md; "
                      f"'{config.controller.partition(':')[0]}:shield_mode=strict' reserves for zero evictions")
                   + ")", err=True)


@click.command()
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
@click.option("--goodput", "goodput_slos", multiple=True,
              help="SLO for goodput, e.g. --goodput ttft:2000 --goodput tpot:100 (ms).")
@click.option("--model", default=None, help="Model name (default: the server's first).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@friendly()
def loadgen(url, trace, dataset, rate, rate_scale, burstiness, duration_s, num_requests, max_concurrency,
            input_len, output_len, length_scale, max_tokens_cap, goodput_slos, model, seed, out_path):
    """Streaming load against any OpenAI-compatible server; latency percentiles, goodput, 429s."""
    from tidegate.engine.bench.loadgen import (
        format_summary, outcomes_json, plan_random, plan_trace, run, run_load, summarize,
    )
    from tidegate.engine.workloads import read_trace, resolve_trace

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
        if num_requests is None and rate is None:
            raise click.UsageError("--duration without --num-requests needs --rate: all at once, it never ends")
        plan = plan_random(num_requests or 10**9, rate or float("inf"), burstiness, input_len, output_len, seed,
                           duration_s)
    import httpx
    try:
        outcomes, wall = run(run_load(url, plan, model, max_concurrency, progress=sys.stderr.isatty()))
    except (httpx.TransportError, httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        fail(f"the server at {url} cannot be reached ({type(exc).__name__}: {exc})")
    summary = summarize(outcomes, wall, slos.get("ttft"), slos.get("tpot"))
    click.echo(format_summary(summary))
    if out_path:
        Path(out_path).write_text(json.dumps({"summary": summary, "requests": outcomes_json(outcomes)}))
