"""Small engines and workloads for tests."""

from __future__ import annotations

from tidegate.engine.core.clock import VirtualClock
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request
from tidegate.engine.sim.executor import SimExecutor


def step_profile(**overrides) -> Profile:
    """A small real Profile for tests: one time unit per step, 256 tokens of KV in blocks of 4."""
    fields = dict(name="test", description="unit-test engine", base_s=1.0, per_token_s=0.0, per_kv_token_s=0.0,
                  kv_capacity_tokens=256, block_size=4, ttft_slo_s=20.0, tpot_slo_s=2.0, max_num_seqs=64,
                  max_num_batched_tokens=64)
    return Profile(**{**fields, **overrides})


def make_engine(controller, capacity=256, block_size=4, **kwargs) -> EngineCore:
    profile = step_profile(kv_capacity_tokens=capacity, block_size=block_size)
    return EngineCore(controller, SimExecutor(profile), VirtualClock(), capacity, block_size, **kwargs)


def req(i, prompt, out, max_tokens=None, arrival=0.0, class_id=0) -> Request:
    return Request(str(i), arrival, prompt, max_tokens or out, target_output_len=out, class_id=class_id)


def run_until_idle(core: EngineCore, max_steps: int = 100_000, check=None) -> None:
    for _ in range(max_steps):
        if not core.has_unfinished:
            return
        core.step()
        if check is not None:
            check(core)
    raise AssertionError("engine did not drain")


def record_evictions(core: EngineCore) -> list[tuple[Request, int, int, int, int]]:
    """Spy on the core's evictions: (request, its activation_seq, the newest running activation_seq,
    its computed tokens just before eviction, its computed plus output tokens just after),
    appended as they happen."""
    evicted: list[tuple[Request, int, int, int, int]] = []
    evict = core.scheduler.evict

    def spy(r: Request) -> None:
        newest = max(q.activation_seq for q in core.running + [r])
        before = r.num_computed_tokens
        evict(r)
        evicted.append((r, r.activation_seq, newest, before, r.num_computed_tokens + r.num_output_tokens))
    core.scheduler.evict = spy
    return evicted


def byte_level_bpe():
    """A byte-level BPE tokenizer trained here (no files, no network) whose ``add_special_tokens``
    puts a BOS first, like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello there, how are you today",
                             "a continuous batching engine serves many requests", "the end"] * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
