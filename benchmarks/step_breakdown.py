"""Where a step of the real engine spends its time, on the burst ``benchmarks/serve_vs_vllm.py`` sends:
scheduling and the controller (the core's Python), packing the step's inputs, the model forward, sampling,
the stop checks, and detokenisation with the stream's bookkeeping; then, inside the forward, torch's
operators grouped by kind (matmuls, attention over the paged cache, normalisation and the rest).

    python benchmarks/step_breakdown.py [--model llama-24m] [--requests 200] [--input-len 256] [--output-len 128]
        [--dtype float32] [--threads N] [--profile-steps 20] [--out bench-out/step_breakdown]

It runs the engine offline (``LLM``, greedy controller, the serving defaults for the device) with every request
added at once, as the benchmark client sends them; the server's HTTP side is not in it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from tidegate.engine.bench.vllm.model import model_folder
from tidegate.engine.core.figures import save_png
from tidegate.engine.real.llm import LLM
from tidegate.engine.real.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("schedule and control", "pack inputs", "model forward", "sample", "stop checks", "detokenise and stream")
#: torch operator names (substrings) by the kind of work they do in a Llama forward over the paged cache
KINDS = (("matmul", ("addmm", "aten::mm", "aten::bmm", "aten::linear", "matmul")),
         ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
         ("paged KV gather and write", ("index_select", "index_copy", "index_put", "gather", "take", "aten::index")),
         ("norm, rotary and activations", ("pow", "rsqrt", "mean", "silu", "aten::mul", "aten::add", "aten::neg",
                                           "aten::cat", "aten::cos", "aten::sin")),
         ("copies and views", ("copy_", "contiguous", "to_copy", "aten::to", "view", "reshape", "transpose",
                               "expand", "slice", "select", "unsqueeze", "empty", "zeros", "as_strided")))


class Timers:
    """Seconds spent in each wrapped method, summed over the run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0

        setattr(owner, name, timed)


def op_kind(name: str) -> str:
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model_dir = model_folder(args.model, ROOT / "bench-out" / "models")
    llm = LLM(str(model_dir), dtype=args.dtype, controller="greedy", record_steps=False)
    rng = random.Random(0)
    vocab = llm.executor.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    sampling = SamplingParams(ignore_eos=True)
    executor = llm.executor
    timers = Timers()
    for name, part in (("_pack", "pack inputs"), ("_forward", "model forward"), ("_sample", "sample"),
                       ("_stops", "stop checks")):
        timers.wrap(executor, name, part)
    timers.wrap(llm.core.scheduler, "on_token", "detokenise and stream")  # the callback the core calls
    for p in prompts:  # a callback per request, as the server's stream has
        llm.add_request(p, sampling, args.output_len, on_delta=lambda *_: None)
    steps, step_s, profiled = 0, 0.0, 0
    op_seconds: dict[str, float] = defaultdict(float)
    while llm.has_unfinished:
        running = len(llm.core.scheduler.running)
        full = running in (args.requests, llm.profile.max_num_seqs)
        if full and profiled < args.profile_steps and steps > 20:
            # a profiled step runs slower: its operators are counted, its time is not
            before = dict(timers.seconds)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                llm.step()
            timers.seconds = defaultdict(float, before)
            profiled += 1
            for event in prof.key_averages():
                op_seconds[op_kind(event.key)] += event.self_cpu_time_total / 1e6
            continue
        t0 = time.perf_counter()
        llm.step()
        step_s += time.perf_counter() - t0
        steps += 1
    parts = dict(timers.seconds)
    inner = sum(parts.get(p, 0.0) for p in PARTS[1:])
    parts["schedule and control"] = step_s - inner
    op_total = sum(op_seconds.values()) or 1.0
    return {"model": args.model, "requests": args.requests, "input_len": args.input_len,
            "output_len": args.output_len, "dtype": str(executor.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "max_num_batched_tokens": llm.profile.max_num_batched_tokens,
            "max_num_seqs": llm.profile.max_num_seqs, "steps": steps, "seconds": step_s,
            "output_tokens": args.requests * args.output_len,
            "parts_s": {p: parts.get(p, 0.0) for p in PARTS},
            "forward_ops_share": {k: v / op_total for k, v in sorted(op_seconds.items(), key=lambda kv: -kv[1])},
            "profiled_steps": profiled}


def report(result: dict) -> str:
    total = result["seconds"]
    lines = [f"# Where a step's time goes: {result['requests']} requests of {result['input_len']}/"
             f"{result['output_len']} tokens at once, `{result['model']}`",
             "",
             f"{result['dtype']}, {result['threads']} torch thread(s), steps of up to "
             f"{result['max_num_batched_tokens']} tokens and {result['max_num_seqs']} requests: {result['steps']} "
             f"steps timed in {total:.1f} s (and {result['profiled_steps']} profiled), about "
             f"{result['output_tokens'] / total:.0f} output tok/s.",
             "", "| part of the step | seconds | share |", "|---|---:|---:|"]
    lines += [f"| {p} | {s:.3f} | {100 * s / total:.2f}% |" for p, s in result["parts_s"].items()]
    lines += ["", f"Inside the forward, by torch operator (self CPU time over {result['profiled_steps']} steps of a "
                  "full decode batch):", "", "| operators | share |", "|---|---:|"]
    lines += [f"| {k} | {100 * v:.1f}% |" for k, v in result["forward_ops_share"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    parts = result["parts_s"]
    axes[0].barh(list(parts), [100 * s / result["seconds"] for s in parts.values()], color="tab:blue")
    axes[0].set_xlabel("share of step time (%)")
    axes[0].invert_yaxis()
    ops = result["forward_ops_share"]
    axes[1].barh(list(ops), [100 * v for v in ops.values()], color="tab:orange")
    axes[1].set_xlabel("share of the forward's operator time (%)")
    axes[1].invert_yaxis()
    fig.suptitle(f"{result['model']}, {result['requests']} x {result['input_len']}/{result['output_len']} tokens, "
                 f"{result['dtype']}, {result['threads']} thread(s)")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-24m")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "step_breakdown")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "step_breakdown.json").write_text(json.dumps(result, indent=2))
    text = report(result)
    (args.out / "step_breakdown.md").write_text(text)
    plot(result, args.out / "step_breakdown.png")
    print(text)


if __name__ == "__main__":
    main()
