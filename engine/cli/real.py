"""Commands of the real engine: ``generate``, ``profile`` and ``twin-check``.

Named in ``engine.cli.COMMANDS``; imported when one of them runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from tidegate.engine.cli.support import friendly


def _threads(threads: int | None, pin_cpu: int | None = None) -> None:
    """Set torch's CPU threads; with ``pin_cpu``, run this process on that core alone (one thread)."""
    import os

    import torch
    if pin_cpu is not None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        if pin_cpu not in allowed:
            raise click.BadParameter(f"core {pin_cpu} is not one this process may run on "
                                     f"({', '.join(map(str, sorted(allowed))) or 'no affinity control here'})",
                                     param_hint="--pin-cpu")
        os.sched_setaffinity(0, {pin_cpu})
        threads = 1
    if threads:
        torch.set_num_threads(threads)


model_option = click.option("--model", default="tiny", show_default=True,
                            help="'tiny' (random-weight 3M Llama, no files needed) or a local Hugging Face "
                                 "model folder.")
device_option = click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when available).")
dtype_option = click.option("--dtype", default=None,
                            help="float32, bfloat16, float16 (default: the fastest the device computes natively: "
                                 "bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32).")
threads_option = click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads.")
pin_option = click.option("--pin-cpu", type=click.IntRange(min=0), default=None,
                          help="Run on this CPU core alone, one torch thread: pin the profile and the twin check "
                               "to the same core so that they compare like with like.")


@click.command("generate")
@model_option
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text; repeat for several.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed of the sampling (reproducible outputs).")
@click.option("--stop", multiple=True, help="Stop string; repeat for several.")
@click.option("--ignore-eos", is_flag=True, help="Generate max-tokens tokens whatever the model says.")
@click.option("--kv-capacity-tokens", type=click.IntRange(min=1), default=None, help="KV cache size in tokens.")
@click.option("--stream/--no-stream", default=False, help="Print text as it is generated (one prompt).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt.")
@device_option
@dtype_option
@threads_option
@friendly(ValueError)
def generate_command(model, prompts, max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos,
                     kv_capacity_tokens, stream, as_json, device, dtype, threads):
    """Generate text for prompts on the real engine."""
    from tidegate.engine.real.llm import LLM
    from tidegate.engine.real.sampling import SamplingParams

    _threads(threads)
    if stream and len(prompts) > 1:
        raise click.UsageError("--stream takes one --prompt")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=list(stop),
                              ignore_eos=ignore_eos)
    llm = LLM(model, kv_capacity_tokens=kv_capacity_tokens, device=device, dtype=dtype)
    if stream:
        for delta in llm.stream(prompts[0], sampling, max_tokens):
            click.echo(delta, nl=False)
        click.echo()
        return
    for out in llm.generate(list(prompts), sampling, max_tokens):
        if as_json:
            click.echo(json.dumps({"request_id": out.request_id, "text": out.text, "token_ids": out.token_ids,
                                   "finish_reason": out.finish_reason}))
        else:
            click.echo(out.text)


@click.command("profile")
@model_option
@device_option
@dtype_option
@threads_option
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Profile JSON to write (loadable with --profile FILE).")
@click.option("--name", default=None, help="Profile name (default: the file's stem).")
@click.option("--kv-capacity-tokens", type=click.IntRange(min=16), default=None,
              help="KV capacity written into the profile (default: sized for the model and device).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs per grid point and pass.")
@click.option("--passes", type=click.IntRange(min=1), default=3, show_default=True,
              help="Walks over the shuffled grid.")
@click.option("--quick", is_flag=True, help="A smaller grid (for tests).")
@click.option("--from-twin", is_flag=True,
              help="Fit on the steps of a real serving run (a trace replayed in real time, as twin-check does) "
                   "instead of the grid.")
@click.option("--from-steps", "from_steps", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Fit on the steps a twin-check recorded (its twin_steps.csv) instead of timing anything.")
@click.option("--trace", default="splitwise_conv", show_default=True, help="--from-twin: trace to serve.")
@click.option("--skip", type=click.IntRange(min=0), default=300, show_default=True,
              help="--from-twin: leave out the trace's first N requests (twin-check replays the first 300).")
@click.option("--first", "first_n", type=click.IntRange(min=1), default=300, show_default=True,
              help="--from-twin: requests to serve after the skipped ones.")
@click.option("--length-scale", type=float, default=0.1, show_default=True, help="--from-twin: scale trace lengths.")
@click.option("--rate-scale", type=float, default=1.0, show_default=True, help="--from-twin: scale trace speed.")
@click.option("--controller", "controller_spec", default="greedy", show_default=True, help="--from-twin: controller.")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True,
              help="--from-twin: serve the requests this many times and pool the steps (averages machine load).")
@click.option("--loss", type=click.Choice(["l1", "l2"]), default=None,
              help="Fit the median step (l1: absolute error relative to the prediction) or least squares on "
                   "relative error (l2) [default: l1 with --from-twin and --from-steps, l2 on the grid].")
@pin_option
@friendly(ValueError)
def profile_command(model, device, dtype, threads, out_path, name, kv_capacity_tokens, repeats, passes, quick,
                    from_twin, from_steps, trace, skip, first_n, length_scale, rate_scale, controller_spec, runs, loss,
                    pin_cpu):
    """Time engine steps and fit the simulator's step-time model (grid of batch shapes, or --from-twin)."""
    from tidegate.engine.real.profiler import run_profile
    from tidegate.engine.twin.fit import run_profile_from_serving, run_profile_from_steps

    _threads(threads, pin_cpu)
    log = lambda s: click.echo(s, err=True)  # noqa: E731
    if from_twin and from_steps:
        raise click.UsageError("--from-twin and --from-steps exclude each other")
    if from_steps:
        profile = run_profile_from_steps(from_steps, model=model, name=name or out_path.stem,
                                         kv_capacity_tokens=kv_capacity_tokens, loss=loss or "l1")
    elif from_twin:
        profile = run_profile_from_serving(model, device=device, dtype=dtype, name=name or out_path.stem,
                                           trace=trace, skip=skip, first_n=first_n, length_scale=length_scale,
                                           rate_scale=rate_scale, controller_spec=controller_spec,
                                           kv_capacity_tokens=kv_capacity_tokens, loss=loss or "l1", runs=runs, log=log)
    else:
        profile = run_profile(model, device=device, dtype=dtype, name=name or out_path.stem,
                              kv_capacity_tokens=kv_capacity_tokens, repeats=repeats, passes=passes, quick=quick,
                              loss=loss or "l2", log=log)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out_path)
    fit = profile.extra["fit"]
    split = "" if profile.per_decode_token_s is None else f" per_decode_token_s={profile.per_decode_token_s:.6g}"
    click.echo(f"base_s={profile.base_s:.6g} per_token_s={profile.per_token_s:.6g}{split} "
               f"per_kv_token_s={profile.per_kv_token_s:.6g} per_prefill_s={profile.per_prefill_s:.6g} "
               f"per_prefill_alone_s={profile.per_prefill_alone_s:.6g} "
               f"noise_sigma={profile.noise_sigma:.3g} noise_corr={profile.noise_corr:.3g} "
               f"noise_white={profile.noise_white:.3g}")
    if profile.noise_knee_s:
        click.echo(f"noise_knee_s={profile.noise_knee_s:.3g} noise_floor={profile.noise_floor:.3g} "
                   "(the noise of longer steps is smaller)")
    if profile.per_first_decode_s or profile.per_after_prefill_s or profile.per_after_prefill_token_s:
        click.echo(f"per_prefill_pair_s={profile.per_prefill_pair_s:.6g} "
                   f"per_first_decode_s={profile.per_first_decode_s:.6g} "
                   f"per_after_prefill_s={profile.per_after_prefill_s:.6g} "
                   f"per_after_prefill_token_s={profile.per_after_prefill_token_s:.6g} "
                   f"after_prefill_decay={profile.after_prefill_decay:.2g}")
    what = "serving steps" if (from_twin or from_steps) else "grid points"
    click.echo(f"R^2={fit['r2']:.4f} MAPE={100 * fit['mape']:.2f}% held-out MAPE={100 * fit['heldout_mape']:.2f}% "
               f"({fit['points']} {what})")
    for kind, res in fit.get("by_kind", {}).items():
        click.echo(f"  {kind}: {res['steps']} steps, MAPE {100 * res['mape']:.2f}%, "
                   f"median measured / predicted {1 + res['bias']:.3f}")
    click.echo(f"wrote {out_path}")


@click.command("twin-check")
@model_option
@click.option("--trace", required=True, help="Trace file or shipped name (splitwise_conv, splitwise_code), or a "
                                             "synthetic workload YAML (sampled with --seed).")
@click.option("--first", "first_n", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--length-scale", type=float, default=0.1, show_default=True,
              help="Multiply prompt and output lengths (fit the trace to the tiny model).")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="Replay at this multiple of the trace's speed.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Cap on output lengths (max_tokens of every request).")
@click.option("--profile", "profile_name", default=None,
              help="The fitted profile the simulator uses (name or file) [default: tiny-cpu].")
@click.option("--fit-around", is_flag=True,
              help="Fit the profile on the trace's next --first requests served through the real engine, half "
                   "before the check and half after (a machine whose speed drifts is profiled at its speed during "
                   "the check, on average); writes it to the output folder's profile.json.")
@click.option("--controller", "controller_spec", default=None,
              help="The controller of both runs [default: greedy; with --engine vllm: vllm, vLLM's own scheduling, "
                   "which the twin simulates as greedy].")
@click.option("--engine", type=click.Choice(["tidegate", "vllm"]), default="tidegate", show_default=True,
              help="The real engine: tidegate's own, or a vLLM server (.venv-vllm) with tidegate's plugin and step "
                   "log, the profile fitted on vLLM's steps around the check unless --profile is given.")
@click.option("--vllm-python", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="--engine vllm: vLLM's python [default: .venv-vllm/bin/python].")
@click.option("--vllm-arg", "vllm_args", multiple=True,
              help="--engine vllm: more vLLM server arguments, e.g. --vllm-arg '--max-num-seqs 64' (repeatable).")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="--engine vllm: vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Both engines reuse the KV blocks of shared prompt prefixes (a Mooncake trace's hash_ids say "
                   "which; the real engine's prompts share tokens where they do).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--noise-seeds", type=click.IntRange(min=1), default=8, show_default=True,
              help="Simulate with this many step-noise seeds and compare the real requests with all their "
                   "simulated requests pooled (a profile without noise is simulated once).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("twin-out"),
              show_default=True, help="Folder for the report JSON and the step-time plot.")
@click.option("--json", "as_json", is_flag=True)
@device_option
@dtype_option
@threads_option
@pin_option
@friendly(ValueError)
def twin_check_command(model, trace, first_n, length_scale, rate_scale, max_tokens, profile_name, fit_around,
                       controller_spec, engine, vllm_python, vllm_args, kv_cache_gib, prefix_caching, seed,
                       noise_seeds, out_dir, as_json, device, dtype, threads, pin_cpu):
    """Run one workload through the real engine (tidegate's or vLLM) and the simulator twin and compare them."""
    from tidegate.engine.twin.check import run_twin_check

    if fit_around and profile_name is not None:
        raise click.UsageError("--profile and --fit-around exclude each other: --fit-around fits the profile itself")
    if engine == "vllm":
        _twin_check_vllm(locals())
        return
    for given, flag in ((vllm_python, "--vllm-python"), (vllm_args, "--vllm-arg")):
        if given:
            raise click.UsageError(f"{flag} applies to --engine vllm")
    controller_spec = controller_spec or "greedy"
    _threads(threads, pin_cpu)
    report = run_twin_check(model=model, trace=trace, first_n=first_n, length_scale=length_scale,
                            rate_scale=rate_scale, max_tokens=max_tokens, profile_name=profile_name or "tiny-cpu",
                            controller_spec=controller_spec, seed=seed, out_dir=out_dir, device=device,
                            dtype=dtype, fit_around=fit_around, noise_seeds=noise_seeds,
                            log=lambda s: click.echo(s, err=True), prefix_caching=prefix_caching)
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(report["table"])
    fitted = f", {out_dir}/profile.json" if fit_around else ""
    click.echo(f"\nwrote {out_dir}/twin_report.json{fitted} and {out_dir}/twin_step_time.png")


def _twin_check_vllm(opts: dict) -> None:
    """``twin-check --engine vllm``: the check against a vLLM server (``engine.bench.vllm.twin_check``)."""
    from tidegate.engine.bench.vllm.twin_check import PASS_THROUGH, run_vllm_twin_check

    for key, flag in (("device", "--device"), ("dtype", "--dtype"), ("threads", "--threads"),
                      ("pin_cpu", "--pin-cpu")):
        if opts[key] is not None:
            raise click.UsageError(f"{flag} applies to tidegate's own engine; give vLLM its flags with --vllm-arg")
    out_dir = opts["out_dir"]
    # its errors (VllmCheckError, ModelFolderError) are ValueErrors: one line and exit code 2 (``friendly``)
    report = run_vllm_twin_check(
        model=opts["model"], trace=opts["trace"], first_n=opts["first_n"], length_scale=opts["length_scale"],
        rate_scale=opts["rate_scale"], max_tokens=opts["max_tokens"], profile_name=opts["profile_name"],
        controller_spec=opts["controller_spec"] or PASS_THROUGH, seed=opts["seed"],
        noise_seeds=opts["noise_seeds"], out_dir=out_dir, vllm_python=opts["vllm_python"],
        vllm_args=opts["vllm_args"], kv_cache_gib=opts["kv_cache_gib"], prefix_caching=opts["prefix_caching"],
        log=lambda s: click.echo(s, err=True))
    if opts["as_json"]:
        click.echo(json.dumps(report, default=float))
        return
    click.echo(report["table"])
    fitted = f", {out_dir}/profile.json" if report["fit_around"] else ""
    click.echo(f"\nwrote {out_dir}/twin_report.json{fitted}, {out_dir}/vllm_steps.csv and {out_dir}/twin_step_time.png")



@click.command("tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random weights (0: --model tiny's).")
@friendly()
def tiny_model_command(out_dir, seed):
    """Save the built-in tiny model (config, seeded random weights, a byte-level tokenizer.json and a chat
    template) as a Hugging Face folder that vLLM or transformers serve like any model; nothing is downloaded."""
    from tidegate.engine.real.tiny_folder import save_tiny_model

    click.echo(f"wrote {save_tiny_model(out_dir, seed)}")
