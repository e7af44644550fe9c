"""Real-engine benchmarks.

(a) continuous batching (EngineCore + TorchExecutor) against ``model.generate`` with static
    batches (padded to the longest prompt, run to the longest output, batch after batch) on the
    same mixed-length workload: output tokens per second of both and the ratio;
(b) engine overhead: the share of step time spent outside the model forward, at batch 32;
(c) on CUDA only: (a) and (b) with a ~1B-parameter random-weight Llama.

    python benchmarks/real_engine.py --threads 1 [--requests 200] [--batch 32] [--only a|b|c] [--repeats 3]

With ``--repeats N`` (a) and (b) run N times, interleaved, and the medians are reported (the
machine these run on is shared, so single runs are noisy). (a) also prints the work ratio: the
token positions each side pushes through the model (static: every padded prompt position and
every row of every decode step; continuous: each request's own prompt and output): the waste
continuous batching removes, and about the speed-up a purely compute-bound model would see.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch
from transformers import GenerationConfig

from tidegate.engine.real.llm import LLM
from tidegate.engine.real.model import build_tiny_model
from tidegate.engine.real.sampling import SamplingParams


def mixed_workload(n: int, seed: int = 0, prompt_range=(16, 256), output_range=(8, 128)):
    """``n`` (prompt ids, output length) pairs with uniform random lengths."""
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 259) for _ in range(rng.randint(*prompt_range) - 1)], rng.randint(*output_range))
            for _ in range(n)]


def bench_continuous(model, tokenizer, workload, batch: int, device) -> dict:
    llm = LLM(model_and_tokenizer=(model, tokenizer), kv_capacity_tokens=32768, device=device,
              max_num_seqs=batch, max_num_batched_tokens=1024, record_steps=False)
    llm.generate([workload[0][0]], SamplingParams(ignore_eos=True), max_tokens=4)  # warm-up
    steps0, busy0 = llm.core.metrics.steps, llm.core.metrics.busy_time_s
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], SamplingParams(ignore_eos=True), max_tokens=[m for _, m in workload])
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = llm.core.metrics.steps - steps0
    return {"output_tokens": tokens, "wall_s": wall, "output_tps": tokens / wall, "steps": steps,
            "step_ms": 1e3 * (llm.core.metrics.busy_time_s - busy0) / max(steps, 1)}


def bench_static(model, workload, batch: int, device) -> dict:
    """model.generate on fixed batches: left-padded prompts, every row runs to the batch's longest output."""
    config = GenerationConfig(do_sample=False, eos_token_id=[], pad_token_id=0)
    useful = 0
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch):
        chunk = workload[start:start + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        longest = max(m for _, m in chunk)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config,
                           max_new_tokens=longest)
        useful += sum(m for _, m in chunk)  # tokens past a row's own length are waste
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"output_tokens": useful, "wall_s": wall, "output_tps": useful / wall}


def work_ratio(workload, batch: int) -> float:
    """Token positions run through the model: static batches over continuous batching."""
    static = 0
    for start in range(0, len(workload), batch):
        chunk = workload[start:start + batch]
        static += len(chunk) * (max(len(p) for p, _ in chunk) + max(m for _, m in chunk) - 1)
    continuous = sum(len(p) + m - 1 for p, m in workload)
    return static / continuous


def bench_overhead(model, tokenizer, batch: int, device, steps: int = 60) -> dict:
    """Steady decode at ``batch`` requests: share of each step outside the model forward."""
    llm = LLM(model_and_tokenizer=(model, tokenizer), kv_capacity_tokens=32768, device=device,
              max_num_seqs=batch, record_steps=False)
    rng = random.Random(1)
    for _ in range(batch):
        llm.add_request([1] + [rng.randrange(3, 259) for _ in range(127)], SamplingParams(ignore_eos=True),
                        max_tokens=steps + 20)
    for _ in range(12):  # prefills and warm-up
        llm.step()
    assert len(llm.core.running) == batch and all(not r.is_prefilling for r in llm.core.running)
    ex = llm.executor
    ex.time_forward, ex.forward_time_s = True, 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    ex.time_forward = False
    return {"batch": batch, "steps": steps, "step_ms": 1e3 * total / steps,
            "forward_ms": 1e3 * ex.forward_time_s / steps, "overhead_share": 1 - ex.forward_time_s / total}


def big_model(device, dtype):
    """The ``llama-1b`` shape of ``engine/bench/vllm/model.py`` (TinyLlama-1.1B's layers) with random weights and
    the byte tokenizer's vocabulary, so every token it samples decodes (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidegate.engine.bench.vllm.model import SHAPES
    from tidegate.engine.real.model import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, TINY_CONFIG, ByteTokenizer
    config = LlamaConfig(**{**TINY_CONFIG, **SHAPES["llama-1b"]}, attn_implementation="sdpa",
                         pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model, ByteTokenizer()


def machine() -> str:
    name = platform.processor()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def _median_run(runs: list[dict]) -> dict:
    """The run whose output tokens per second is closest to the median of ``runs``."""
    mid = statistics.median(r["output_tps"] for r in runs)
    return min(runs, key=lambda r: abs(r["output_tps"] - mid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", choices=("a", "b", "c"), default=None)
    ap.add_argument("--repeats", type=int, default=1, help="Runs of (a) and (b); medians are reported.")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    cpu = torch.device("cpu")
    if args.only in (None, "a", "b"):
        model, tok = build_tiny_model(dtype=torch.float32)
    if args.only in (None, "a"):
        work = mixed_workload(args.requests)
        runs = []
        for _ in range(args.repeats):
            runs.append((bench_continuous(model, tok, work, args.batch, cpu),
                         bench_static(model, work, args.batch, cpu)))
        ratios = [c["output_tps"] / s["output_tps"] for c, s in runs]
        cont = _median_run([c for c, _ in runs])
        static = _median_run([s for _, s in runs])
        print(f"(a) {args.requests} requests, prompts 16-256, outputs 8-128 tokens, batch {args.batch}, tiny fp32 CPU"
              f" ({args.repeats} run{'s' if args.repeats > 1 else ''}, medians)")
        print(f"    continuous batching: {cont['output_tokens']} tokens in {cont['wall_s']:.1f}s = "
              f"{cont['output_tps']:.0f} tok/s")
        print(f"    static model.generate: {static['output_tokens']} useful tokens in {static['wall_s']:.1f}s = "
              f"{static['output_tps']:.0f} tok/s")
        print(f"    ratio: {statistics.median(ratios):.2f}x (runs: {', '.join(f'{r:.2f}' for r in ratios)}; "
              "target >= 3x); "
              f"work ratio (token positions static / continuous): {work_ratio(work, args.batch):.2f}x")
    if args.only in (None, "b"):
        runs = [bench_overhead(model, tok, args.batch, cpu) for _ in range(args.repeats)]
        o = sorted(runs, key=lambda r: r["overhead_share"])[len(runs) // 2]
        shares = ", ".join(f"{100 * r['overhead_share']:.1f}%" for r in runs)
        print(f"(b) decode batch {o['batch']}, context ~128-200: step {o['step_ms']:.2f} ms, "
              f"forward {o['forward_ms']:.2f} ms, "
              f"outside the forward {100 * o['overhead_share']:.1f}% "
              f"(runs: {shares}; target <= 5%)")
    if args.only in (None, "c"):
        if not torch.cuda.is_available():
            print("(c) skipping the CUDA benchmark: no GPU on this machine")
            return
        dev = torch.device("cuda")
        model, tok = big_model(dev, torch.bfloat16)
        print(f"(c) {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B-parameter random Llama, bf16, "
              f"{torch.cuda.get_device_name(dev)}")
        work = mixed_workload(args.requests)
        cont = bench_continuous(model, tok, work, args.batch, dev)
        static = bench_static(model, work, args.batch, dev)
        print(f"    continuous {cont['output_tps']:.0f} tok/s ({cont['output_tokens']} tokens, {cont['steps']} "
              f"steps of {cont['step_ms']:.1f} ms on average in {cont['wall_s']:.1f} s), "
              f"static {static['output_tps']:.0f} tok/s ({static['wall_s']:.1f} s), "
              f"ratio {cont['output_tps'] / static['output_tps']:.2f}x; work ratio {work_ratio(work, args.batch):.2f}x")
        o = bench_overhead(model, tok, args.batch, dev)
        print(f"    batch {o['batch']}: step {o['step_ms']:.2f} ms, forward {o['forward_ms']:.2f} ms, "
              f"outside the forward {100 * o['overhead_share']:.1f}%")


if __name__ == "__main__":
    main()
