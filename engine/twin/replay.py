"""Replay a workload through the real engine in wall-clock time, recording every step's work.

The same ``EngineCore`` (``build_engine``) and arrival loop (``engine.core.driver.replay``) as
``simulate``, with a ``TorchExecutor`` and a ``WallClock``: the real half of the twin check, of
``tidegate profile --from-twin`` and of the sim-to-real check. Each request gets random prompt
tokens of the trace's length, ignores EOS and ends at the trace's output length, exactly as in
the simulator. Where the workload says which prompts share content (``Arrival.prefix_ids``), equal
content ids get equal tokens, so the real engine's prefix cache finds what the simulator's does.
"""

from __future__ import annotations

import random
from typing import Callable

from tidegate.engine.core.builder import build_engine
from tidegate.engine.core.clock import WallClock
from tidegate.engine.core.driver import replay
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.core.executor import Batch, StepResult
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request
from tidegate.engine.real.executor import TorchExecutor
from tidegate.engine.real.model import load_model
from tidegate.engine.real.sampling import SamplingParams

_IGNORE_EOS = SamplingParams(ignore_eos=True)
LOG_EVERY_S = 10.0


class RecordingExecutor:
    """Wraps an executor and records the work (T, K, the decodes D among T, the prefill chunks C,
    their attention's query-key pairs Q and the first decodes F) of every step it runs."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []
        self.kv_tokens_read: list[int] = []
        self.decodes: list[int] = []
        self.prefills: list[int] = []
        self.prefill_pairs: list[int] = []
        self.first_decodes: list[int] = []

    def execute(self, batch: Batch) -> StepResult:
        self.tokens.append(batch.num_tokens)
        self.kv_tokens_read.append(batch.kv_tokens_read)
        self.decodes.append(batch.num_decodes)
        self.prefills.append(batch.num_prefills)
        self.prefill_pairs.append(batch.prefill_pairs)
        self.first_decodes.append(batch.first_decodes)
        return self.inner.execute(batch)

    def release(self, request: Request) -> None:
        self.inner.release(request)

    def clear(self) -> None:
        """Forget the steps recorded so far."""
        self.tokens.clear()
        self.kv_tokens_read.clear()
        self.decodes.clear()
        self.prefills.clear()
        self.prefill_pairs.clear()
        self.first_decodes.clear()


def replay_real(arrivals, profile: Profile, controller, model: str = "tiny", device=None, dtype=None,
                seed: int = 0, log: Callable[[str], None] | None = None,
                prefix_caching: bool = True) -> tuple[EngineCore, RecordingExecutor]:
    """Replay ``arrivals`` through the real engine in wall-clock time.

    :param arrivals: time-sorted ``engine.workloads.Arrival`` items.
    :param profile: the replica's KV capacity and block size (and rate window).
    :param controller: the controller under test; it is reset first.
    :param seed: seeds the random prompt tokens.
    :param log: gets a progress line every ten seconds of replay.
    :param prefix_caching: the engine's prefix cache (``EngineCore``).
    :return: the engine (metrics, finished requests) and the recorder of every step's (T, K).
    """
    hf_model, tokenizer = load_model(model, device, dtype)
    executor = TorchExecutor(hf_model, tokenizer, device=device, dtype=dtype)
    recorder = RecordingExecutor(executor)
    prompts = random_prompts(arrivals, executor.vocab_size, seed)
    _warm_up(profile, controller, recorder, prompts[0])
    controller.reset()
    core = build_engine(profile, controller, recorder, WallClock(), prefix_caching=prefix_caching)
    executor.attach_pool(core.pool)
    recorder.clear()

    def make_request(i: int) -> Request:
        a = arrivals[i]
        # max_tokens and target_output_len exactly as the simulator sets them.
        return Request(str(i), a.arrival_time_s, a.prompt_tokens, a.max_tokens, target_output_len=a.output_tokens,
                       prompt_token_ids=prompts[i], sampling=_IGNORE_EOS, class_id=a.class_id)

    on_step = None if log is None else _progress_logger(core, len(arrivals), log)
    replay(core, [a.arrival_time_s for a in arrivals], make_request, on_step)
    return core, recorder


def random_prompts(arrivals, vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompt token ids of each arrival's length (special ids 0-2 left out when the vocabulary
    allows). The tokens of a run an arrival's ``prefix_ids`` describe are drawn from the run's content
    id and its place in the prompt: equal prefixes get equal tokens."""
    rng = random.Random(seed)
    low = 3 if vocab_size > 3 else 0
    prompts = []
    for a in arrivals:
        ids = [rng.randrange(low, vocab_size) for _ in range(a.prompt_tokens)]
        per_id = a.prefix_block_tokens
        for j, content in enumerate(a.prefix_ids):
            start, end = int(j * per_id), min(int((j + 1) * per_id), a.prompt_tokens)
            if start >= end:
                break
            run = random.Random(f"{seed}:{content}:{j}")
            ids[start:end] = [run.randrange(low, vocab_size) for _ in range(end - start)]
        prompts.append(ids)
    return prompts


def _warm_up(profile: Profile, controller, recorder: RecordingExecutor, prompt: list[int]) -> None:
    """Run one short request on a throw-away engine so the kernels' first calls (which allocate)
    happen before the clock starts to matter."""
    controller.reset()
    core = build_engine(profile, controller, recorder, WallClock())
    recorder.inner.attach_pool(core.pool)
    ids = (prompt * 16)[:16] or [0] * 16  # 16 tokens, also from a shorter first prompt
    core.add_request(Request("warm-up", 0.0, len(ids), 2, prompt_token_ids=ids, sampling=_IGNORE_EOS))
    while core.has_unfinished:
        core.step()


def _progress_logger(core: EngineCore, n: int, log: Callable[[str], None]) -> Callable[[int], None]:
    """An ``on_step`` hook that logs the replay's progress every ``LOG_EVERY_S`` seconds."""
    next_log = [0.0]

    def on_step(arrived: int) -> None:
        now = core.clock.now()
        if now >= next_log[0]:
            log(f"  real engine: t={now:6.1f}s arrived={arrived}/{n} running={len(core.running)} "
                f"waiting={len(core.waiting)} kv={core.pool.used_tokens}/{core.pool.capacity_tokens}")
            next_log[0] = now + LOG_EVERY_S

    return on_step
