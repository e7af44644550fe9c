"""What structured output costs the real engine: the same batch of requests decoded free and under a constraint,
interleaved run by run, output tokens per second of each and their ratio.

    python benchmarks/structured_output.py --threads 1 [--requests 32] [--tokens 96] [--repeats 3]

The constraints keep every request generating to ``--tokens`` (a JSON object with one open string, and a regular
expression of letters), so both sides decode the same number of tokens in batches of the same size; what differs
is the grammar's mask at each step and each sampled token's advance of its matcher, on the CPU, per sequence.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tidegate.engine.real.llm import LLM
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.real.structured import StructuredOutput

CONSTRAINTS = {
    "json": StructuredOutput("json", {"type": "object", "properties": {"text": {"type": "string"}},
                                      "required": ["text"]}, flexible_whitespace=False),
    "regex": StructuredOutput("regex", "[a-z ]+"),
}


def run(llm: LLM, prompts: list[str], tokens: int, output: StructuredOutput | None) -> float:
    """Output tokens per second of one batch."""
    sampling = SamplingParams(ignore_eos=True, structured_outputs=output)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling, max_tokens=tokens)
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model="tiny", kv_capacity_tokens=32768, max_num_seqs=args.requests, record_steps=False)
    prompts = [f"request {i}: " + "words " * (8 + i % 16) for i in range(args.requests)]
    for output in (None, *CONSTRAINTS.values()):  # warm-up: the grammar tokenizer and each grammar's matcher
        run(llm, prompts[:2], 4, output)
    rates: dict[str, list[float]] = {"free": [], **{k: [] for k in CONSTRAINTS}}
    for _ in range(args.repeats):
        rates["free"].append(run(llm, prompts, args.tokens, None))
        for name, output in CONSTRAINTS.items():
            rates[name].append(run(llm, prompts, args.tokens, output))
    free = statistics.median(rates["free"])
    print(f"{platform.processor() or platform.machine()}, torch threads {args.threads}, {args.requests} requests x "
          f"{args.tokens} tokens, median of {args.repeats} interleaved runs")
    print("| constraint | output tok/s | against free text | runs |")
    print("|---|---:|---:|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {median / free:.3f}x | {', '.join(f'{v:,.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
