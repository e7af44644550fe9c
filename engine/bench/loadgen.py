"""A load generator for OpenAI-compatible streaming servers, in the manner of vLLM's
``benchmark_serving.py``: Poisson, gamma or trace-timed arrivals of streaming completions;
TTFT, TPOT, ITL and E2E percentiles, throughput, goodput, and counts of 429s and errors."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Planned:
    """One request to send: when (seconds from the start), prompt text, max_tokens."""

    at_s: float
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    status: int = 0
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    latency_s: float = 0.0  # until the response ended (for errors and 429s: the answer's latency)


def plan_random(n: int, rate: float, burstiness: float, input_len: int, output_len: int, seed: int,
                duration_s: float | None = None) -> list[Planned]:
    """Random prompts of ``input_len`` characters arriving as a gamma process (burstiness 1 = Poisson)."""
    rng = np.random.default_rng(seed)
    letters = string.ascii_letters + " "
    gen = random.Random(seed)
    out, t = [], 0.0
    shape = 1.0 / burstiness
    while len(out) < n:
        t += rng.gamma(shape, 1.0 / (rate * shape)) if rate > 0 and rate != float("inf") else 0.0
        if duration_s is not None and t > duration_s:
            break
        out.append(Planned(t, "".join(gen.choice(letters) for _ in range(max(1, input_len))), output_len))
    return out


def plan_trace(arrivals, prompt_chars_per_token: float = 1.0) -> list[Planned]:
    """Trace timing and lengths; prompts are random text of the trace's prompt length."""
    gen = random.Random(0)
    letters = string.ascii_letters + " "
    return [Planned(a.arrival_time_s, "".join(gen.choice(letters)
                                             for _ in range(max(1, int(a.prompt_tokens * prompt_chars_per_token)))),
                    a.output_tokens) for a in arrivals]


async def _send(client, url: str, model: str, p: Planned, ignore_eos: bool) -> Outcome:
    body = {"model": model, "prompt": p.prompt, "max_tokens": p.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": ignore_eos}
    out = Outcome()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    out.error = json.loads(text)["error"]["type"]
                except (ValueError, KeyError, TypeError):
                    out.error = f"http {resp.status_code}"
                out.latency_s = time.perf_counter() - start
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = obj["error"].get("type", "error")
                    continue
                if obj.get("usage"):
                    out.output_tokens = obj["usage"]["completion_tokens"]
                    out.prompt_tokens = obj["usage"]["prompt_tokens"]
                for ch in obj.get("choices", ()):
                    if ch.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            out.ttft_s = now - start
                        else:
                            out.itl_s.append(now - last)
                        last = now
    except Exception as exc:  # connection errors count as errors, the run goes on
        out.error = f"{type(exc).__name__}"
    out.latency_s = time.perf_counter() - start
    if out.error is None and last is not None:
        out.e2e_s = last - start
    return out


async def run_load(url: str, plan: list[Planned], model: str | None = None, max_concurrency: int | None = None,
                   ignore_eos: bool = True, timeout_s: float = 600.0,
                   progress: bool = True) -> tuple[list[Outcome], float]:
    """Send the plan; returns the outcomes (in plan order) and the wall time of the run."""
    import httpx
    from tqdm import tqdm

    base = url.rstrip("/")
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        if model is None:
            model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(plan), desc="requests", unit="req", disable=not progress, leave=False)
        start = time.perf_counter()

        async def one(p: Planned) -> Outcome:
            delay = p.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                o = await _send(client, f"{base}/v1/completions", model, p, ignore_eos)
            else:
                async with sem:
                    o = await _send(client, f"{base}/v1/completions", model, p, ignore_eos)
            bar.update(1)
            return o

        outcomes = await asyncio.gather(*(one(p) for p in plan))
        bar.close()
        return list(outcomes), time.perf_counter() - start


def run(coro):
    """asyncio.run on uvloop where it is installed (the client must not be the bottleneck)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def summarize(outcomes: list[Outcome], wall_s: float, ttft_slo_s: float | None = None,
              tpot_slo_s: float | None = None) -> dict:
    """Figures of a run: counts, throughput, goodput and latency percentiles (ms)."""
    ok = [o for o in outcomes if o.status == 200 and o.error is None and o.ttft_s is not None]
    ttft = np.array([o.ttft_s for o in ok])
    tpot = np.array([(o.e2e_s - o.ttft_s) / (len(o.itl_s)) for o in ok if o.itl_s])
    itl = np.array([x for o in ok for x in o.itl_s])
    e2e = np.array([o.e2e_s for o in ok])
    r429 = np.array([o.latency_s for o in outcomes if o.status == 429])

    def good(o: Outcome) -> bool:
        if ttft_slo_s is not None and o.ttft_s > ttft_slo_s:
            return False
        if tpot_slo_s is not None and o.itl_s and (o.e2e_s - o.ttft_s) / len(o.itl_s) > tpot_slo_s:
            return False
        return True

    def ms(x: np.ndarray, q: float) -> float:
        return float(np.percentile(x, q) * 1000) if x.size else float("nan")

    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    return {
        "sent": len(outcomes),
        "completed": len(ok),
        "rejected_429": int(sum(o.status == 429 for o in outcomes)),
        "unavailable_503": int(sum(o.status == 503 for o in outcomes)),
        "server_errors_5xx": int(sum(500 <= o.status < 600 and o.status != 503 for o in outcomes)),
        "stream_errors": int(sum(o.status == 200 and o.error is not None for o in outcomes)),
        "connection_errors": int(sum(o.status == 0 for o in outcomes)),
        "statuses": statuses,
        "duration_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s else 0.0,
        "output_tps": sum(o.output_tokens for o in ok) / wall_s if wall_s else 0.0,
        "goodput_rps": sum(good(o) for o in ok) / wall_s if wall_s else 0.0,
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
        "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
        "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
        "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
        "reject_latency_p50_ms": ms(r429, 50), "reject_latency_p99_ms": ms(r429, 99),
    }


def format_summary(s: dict) -> str:
    rows = [(k, v) for k, v in s.items() if k != "statuses"]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"{'statuses':<{width}}  {json.dumps(s['statuses'])}")
    return "\n".join(lines)


def outcomes_json(outcomes: list[Outcome]) -> list[dict]:
    return [asdict(o) for o in outcomes]
