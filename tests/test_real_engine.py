"""The real engine on the tiny model (fp32, CPU): the same EngineCore as the simulator with a
TorchExecutor. Greedy outputs must match ``model.generate`` run on each request alone, whatever
the batching, chunking and evictions did."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from tidegate.ctrl import ControllerSpecError, build_controller
from tidegate.engine.core.clock import WallClock
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.real.llm import LLM
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.real.model import (
    ByteTokenizer, IncrementalDetokenizer, ModelLoadError, build_tiny_model, load_model,
)
from tidegate.engine.real.executor import TorchExecutor
from tidegate.engine.real.sampling import SamplingParams

torch.set_num_threads(1)  # 2 threads stall badly when the 2 cores are shared


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0, dtype=torch.float32, device="cpu")


def _workload(n: int, seed: int, max_prompt: int = 120, max_out: int = 40):
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        plen = rng.randint(1, max_prompt)
        items.append(([1] + [rng.randint(3, 258) for _ in range(plen - 1)], rng.randint(1, max_out)))
    return items


def _reference(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    config = GenerationConfig(do_sample=False, eos_token_id=[], pad_token_id=0, max_new_tokens=max_tokens)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def workload(tiny):
    model, _ = tiny
    items = _workload(18, seed=1)
    return [(p, m, _reference(model, p, m)) for p, m in items]


def _engine(tiny, kv_capacity_tokens: int, block_size: int = 16, max_num_batched_tokens: int = 4096,
            eviction: str = "recompute"):
    model, tok = tiny
    executor = TorchExecutor(model, tok)
    core = EngineCore(build_controller(f"greedy:max_num_batched_tokens={max_num_batched_tokens}"), executor,
                      WallClock(), kv_capacity_tokens=kv_capacity_tokens, block_size=block_size, eviction=eviction)
    executor.attach_pool(core.pool)
    return core


def _run_staggered(core, workload, sampling=None) -> list[Request]:
    """Requests join every other step, so batches mix prefills, chunks and decodes of all ages."""
    sampling = sampling or SamplingParams(ignore_eos=True)
    reqs = [Request(str(i), 0.0, len(p), m, prompt_token_ids=p, sampling=sampling)
            for i, (p, m, *_) in enumerate(workload)]
    pending = list(reqs)
    step = 0
    while pending or core.has_unfinished:
        if pending and step % 2 == 0:
            assert core.add_request(pending.pop(0)) is None
        core.step()
        step += 1
    return reqs


def _assert_matches(reqs, workload):
    for r, (_, _, expected) in zip(reqs, workload):
        assert r.state is RequestState.FINISHED, r
        assert r.output_token_ids == expected, f"request {r.request_id} diverged"


def test_greedy_matches_generate_with_continuous_batching(tiny, workload):
    core = _engine(tiny, kv_capacity_tokens=8192)
    reqs = _run_staggered(core, workload)
    _assert_matches(reqs, workload)
    assert core.metrics.evictions == 0
    assert max(core.metrics.step_running) > 8  # requests really shared steps
    assert core.pool.num_free_blocks == core.pool.num_blocks


@pytest.mark.parametrize("eviction, token_budget", [("recompute", 4096), ("reset", 4096), ("recompute", 6)])
def test_greedy_matches_generate_under_evictions(tiny, workload, eviction, token_budget):
    """Also with re-prefills chunked across the prompt/output boundary and decodes cut by the budget."""
    core = _engine(tiny, kv_capacity_tokens=256, block_size=8, eviction=eviction,
                   max_num_batched_tokens=token_budget)
    reqs = _run_staggered(core, [w for w in workload if len(w[0]) + w[1] <= 256])
    assert core.metrics.evictions > 0
    assert max(core.metrics.step_tokens) <= token_budget
    _assert_matches(reqs, [w for w in workload if len(w[0]) + w[1] <= 256])
    assert core.pool.num_free_blocks == core.pool.num_blocks


def test_decodes_cut_by_the_token_budget_give_the_same_tokens(tiny):
    from tidegate.ctrl.base import Controller, Decision

    class Shrinking(Controller):  # every prompt in the first step, then 4 tokens a step for 8 decodes
        def decide(self, obs):
            return Decision(token_budget=100 if obs.step_index == 0 else 4)

    model, tok = tiny
    items = [([1, 5 + i], 10) for i in range(8)]
    executor = TorchExecutor(model, tok)
    core = EngineCore(Shrinking(), executor, WallClock(), kv_capacity_tokens=2048)
    executor.attach_pool(core.pool)
    reqs = [Request(str(i), 0.0, len(p), m, prompt_token_ids=p, sampling=SamplingParams(ignore_eos=True))
            for i, (p, m) in enumerate(items)]
    for r in reqs:
        core.add_request(r)
    cut = 0
    while core.has_unfinished:
        decoding = sum(not r.is_prefilling for r in core.running)
        core.step()
        cut += decoding > core.metrics.step_tokens[-1]
    assert cut > 0 and max(core.metrics.step_tokens[1:]) <= 4
    _assert_matches(reqs, [(p, m, _reference(model, p, m)) for p, m in items])


def test_chunked_prefill_gives_the_same_tokens(tiny, workload):
    core = _engine(tiny, kv_capacity_tokens=8192, max_num_batched_tokens=24)
    reqs = _run_staggered(core, workload)
    _assert_matches(reqs, workload)
    assert max(core.metrics.step_tokens) <= 24


def test_blocks_free_when_idle_and_after_cancel(tiny):
    core = _engine(tiny, kv_capacity_tokens=2048)
    items = _workload(4, seed=5, max_prompt=60)
    reqs = [Request(str(i), 0.0, len(p), 200, prompt_token_ids=p, sampling=SamplingParams(ignore_eos=True))
            for i, (p, _) in enumerate(items)]
    for r in reqs:
        core.add_request(r)
    for _ in range(3):
        core.step()
    victim = reqs[1]
    held = len(victim.block_ids)
    assert held > 0
    free_before = core.pool.num_free_blocks
    core.cancel(victim)
    ended = core.step()
    assert victim in ended and victim.state is RequestState.CANCELLED
    assert victim.block_ids == []
    assert core.pool.num_free_blocks >= free_before + held - (len(reqs) - 1)  # others may grow by a block
    for r in reqs:
        if r is not victim:
            core.cancel(r)
    core.step()
    assert not core.has_unfinished
    assert core.pool.num_free_blocks == core.pool.num_blocks


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(kv_capacity_tokens=4096, model_and_tokenizer=tiny, device="cpu")


def test_seeded_sampling_reproduces_also_across_evictions(tiny, llm):
    prompts = ["The tide", "gates open at dawn", "x" * 50]
    sp = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    first = [o.token_ids for o in llm.generate(prompts, sp, max_tokens=30)]
    again = [o.token_ids for o in llm.generate(prompts, sp, max_tokens=30)]
    assert first == again
    other = llm.generate(prompts[0], SamplingParams(temperature=0.9, seed=99, ignore_eos=True), max_tokens=30)
    assert other[0].token_ids != first[0]
    small = LLM(kv_capacity_tokens=96, block_size=8, model_and_tokenizer=tiny, device="cpu")
    squeezed = [o.token_ids for o in small.generate(prompts, sp, max_tokens=30)]
    assert small.core.metrics.evictions > 0
    assert squeezed == first


def test_stop_strings_and_stop_tokens(tiny, llm):
    prompt = "stop here please"
    greedy = llm.generate(prompt, SamplingParams(ignore_eos=True), max_tokens=40)[0]
    ids = greedy.token_ids
    # A printable ASCII byte the greedy output produces after its third token.
    k = next(i for i in range(3, len(ids)) if 3 + 33 <= ids[i] <= 3 + 126 and ids[i] not in ids[:i])
    stop = chr(ids[k] - 3)
    out = llm.generate(prompt, SamplingParams(ignore_eos=True, stop=[stop]), max_tokens=40)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:k + 1]
    assert out.text == ByteTokenizer().decode(ids[:k])
    out = llm.generate(prompt, SamplingParams(ignore_eos=True, stop_token_ids=[ids[k]]), max_tokens=40)[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:k + 1]
    deltas = []
    r = llm.add_request(prompt, SamplingParams(ignore_eos=True, stop=[stop]), max_tokens=40,
                        on_delta=lambda _r, d, done: deltas.append(d))
    while not r.state.is_terminal:
        llm.step()
    assert "".join(deltas) == ByteTokenizer().decode(ids[:k])


def test_streaming_deltas_add_up_under_evictions(tiny):
    small = LLM(kv_capacity_tokens=128, block_size=8, model_and_tokenizer=tiny, device="cpu")
    got: dict[str, list[str]] = {}
    reqs = [small.add_request(p, SamplingParams(ignore_eos=True), max_tokens=40,
                              on_delta=lambda r, d, done: got.setdefault(r.request_id, []).append(d))
            for p in ("one", "two two", "three three three")]
    outs = {}
    while small.has_unfinished:
        for o in small.step():
            outs[o.request_id] = o
    assert small.core.metrics.evictions > 0
    for r in reqs:
        assert "".join(got[r.request_id]) == outs[r.request_id].text
        assert outs[r.request_id].text == ByteTokenizer().decode(r.output_token_ids)


def test_unseeded_sampling_streams_each_token_once_under_evictions(tiny):
    """Temperature 1 without a seed: a token regenerated after an eviction would differ, so the
    text a client was streamed survives evictions only because evicted requests keep their tokens."""
    small = LLM(kv_capacity_tokens=96, block_size=8, model_and_tokenizer=tiny, device="cpu")
    kept = []
    evict = small.core.scheduler.evict

    def spy(r):
        kept.append((r, list(r.output_token_ids)))
        evict(r)
    small.core.scheduler.evict = spy
    got: dict[str, list[str]] = {}
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    reqs = [small.add_request(p, sampling, max_tokens=40,
                              on_delta=lambda r, d, done: got.setdefault(r.request_id, []).append(d))
            for p in ("one", "two two", "three three", "four four four")]
    outs = {}
    while small.has_unfinished:
        for o in small.step():
            outs[o.request_id] = o
    assert small.core.metrics.evictions > 0
    for r, before in kept:
        assert r.output_token_ids[:len(before)] == before
    for r in reqs:
        out = outs[r.request_id]
        assert out.state == "finished" and len(out.token_ids) == 40
        assert "".join(got[r.request_id]) == out.text


def test_incremental_detokenizer_holds_partial_utf8():
    tok = ByteTokenizer()
    text = "héllo € 😀"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([t]) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert tok.decode(tok.encode(text)) == text


def test_user_errors_are_clear_and_leave_nothing_queued(llm):
    with pytest.raises(ValueError, match="model context of 2048 tokens"):
        llm.generate([1] * 3000, max_tokens=4)
    with pytest.raises(ValueError, match="prompt 1: .*KV capacity of 512 tokens"):
        small = LLM(kv_capacity_tokens=512, model_and_tokenizer=(llm.model, llm.tokenizer), device="cpu")
        try:
            small.generate(["fine", "x" * 500], max_tokens=100)
        finally:
            assert not small.core.has_unfinished and small.core.metrics.arrived == 0
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], max_tokens=4)
    with pytest.raises(ControllerSpecError):
        LLM(controller="nonsense", model_and_tokenizer=(llm.model, llm.tokenizer))
    with pytest.raises(ModelLoadError, match="/no/such/model"):
        load_model("/no/such/model")
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


class _FailOnce:
    """Stands in for the model: the first forward raises, later ones run the real model."""

    def __init__(self, model) -> None:
        self.model, self.config, self.failed = model, model.config, False

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **kwargs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")
        return self.model(**kwargs)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny, workload):
    model, tok = tiny
    llm = LLM(kv_capacity_tokens=4096, model_and_tokenizer=tiny, device="cpu")
    llm.executor.model = _FailOnce(model)
    a = llm.add_request("first", SamplingParams(ignore_eos=True), max_tokens=5)
    b = llm.add_request("second", SamplingParams(ignore_eos=True), max_tokens=5)
    ended = llm.step()
    assert {o.request_id for o in ended} == {a.request_id, b.request_id}
    assert all(o.state == "failed" and "boom" in o.finish_reason for o in ended)
    assert llm.core.pool.num_free_blocks == llm.core.pool.num_blocks
    prompt, max_tokens, expected = workload[0]
    assert llm.generate([prompt], SamplingParams(ignore_eos=True), max_tokens=max_tokens)[0].token_ids == expected


def test_decode_buckets_cover_every_request_once():
    from tidegate.engine.real.paged_cache import plan_buckets
    lens = [1, 1, 2, 24, 23, 3, 24, 12, 12, 1]
    buckets = plan_buckets(lens)
    assert sorted(i for b in buckets for i in b) == list(range(len(lens)))
    assert len(buckets) > 1  # 1-block and 24-block contexts are not padded to one shape
    assert plan_buckets([5] * 8) == [list(range(8))]
    assert plan_buckets([7]) == [[0]]
    cost = lambda bs: sum(len(b) * max(lens[i] for i in b) + 32 for b in bs)  # noqa: E731
    assert cost(buckets) < cost([list(range(len(lens)))])


def test_batched_paged_attention_matches_per_request_attention(tiny):
    """Decodes of very different lengths (several buckets) and prefill chunks with and without a
    cached prefix, in one step: the logits match each request run alone through model.generate's path."""
    from tidegate.engine.core.block_pool import BlockPool
    from tidegate.engine.real.profiler import batch_of_shape
    model, tok = tiny
    pool = BlockPool(8192, 16)
    ex = TorchExecutor(model, tok, pool)
    rng = random.Random(3)
    from tidegate.engine.core.executor import Batch
    batch = batch_of_shape(pool, [5, 300, 17, 16, 33, 250, 2], [(0, 40), (70, 9), (16, 1)], rng)
    for r in batch.requests:  # fill each request's cached tokens with its own prefill first
        cached = r.num_computed_tokens
        if cached:
            r.num_computed_tokens = 0
            pre = Batch()
            pre.requests, pre.num_new_tokens, pre.num_tokens = [r], [cached], cached
            ex.execute(pre)
            r.num_computed_tokens = cached
    got = {}
    real_sample = ex._sample
    ex._sample = lambda logits, reqs: (got.setdefault("logits", logits.clone()), real_sample(logits, reqs))[1]
    ex.execute(batch)
    rows = []
    for r, n in zip(batch.requests, batch.num_new_tokens):
        ids = (r.prompt_token_ids + r.output_token_ids)[:r.num_computed_tokens + n]
        with torch.inference_mode():
            rows.append(model(torch.tensor([ids])).logits[0, -1])
    torch.testing.assert_close(got["logits"], torch.stack(rows), atol=2e-4, rtol=1e-4)


def test_check_request_is_the_cores_definition_plus_the_vocabulary(llm):
    with pytest.raises(ValueError, match="outside the vocabulary of 259"):
        llm.check_request([1, 9999], 4)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        llm.check_request([1, 9999], 0)  # the core's checks of max_tokens come before the vocabulary
    with pytest.raises(ValueError, match="exceeds the model context of 2048 tokens"):
        llm.check_request([5] * 2000, 100)
    llm.check_request([5] * 100, 100)
    # The engine was built from the profile controllers see: same KV size and block size.
    assert llm.profile.kv_capacity_tokens == llm.core.pool.capacity_tokens
    assert llm.profile.block_size == llm.core.pool.block_size


# --- KV geometry -----------------------------------------------------------------------------

def test_kv_geometry_and_bytes_per_token_of_llama_configs():
    from transformers import LlamaConfig

    from tidegate.engine.real.paged_cache import kv_bytes_per_token, kv_geometry
    from tidegate.engine.sim.roofline import LLAMA2_7B, LLAMA3_8B

    llama2_7b = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32)
    llama3_8b = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336, vocab_size=128256)
    assert kv_geometry(llama2_7b) == (32, 32, 128)
    assert kv_geometry(llama3_8b) == (32, 8, 128)
    # The bytes the roofline presets use (16-bit KV); fp32 doubles them.
    assert kv_bytes_per_token(llama2_7b, torch.float16) == LLAMA2_7B.kv_bytes_per_token == 524_288
    assert kv_bytes_per_token(llama3_8b, torch.bfloat16) == LLAMA3_8B.kv_bytes_per_token == 131_072
    assert kv_bytes_per_token(llama3_8b, torch.float32) == 2 * 131_072


def test_paged_cache_is_shaped_by_the_kv_geometry(tiny):
    from tidegate.engine.core.block_pool import BlockPool
    from tidegate.engine.real.paged_cache import PagedKVCache, kv_bytes_per_token, kv_geometry

    model, _ = tiny
    pool = BlockPool(256, 16)
    cache = PagedKVCache.for_model(model.config, pool, "cpu", torch.float32)
    layers, kv_heads, head_dim = kv_geometry(model.config)
    assert (layers, kv_heads, head_dim) == (4, 2, 64)
    assert cache.key_cache.shape == (layers, kv_heads, pool.num_blocks, 16, head_dim)
    assert cache.bytes == pool.capacity_tokens * kv_bytes_per_token(model.config, torch.float32)


# --- devices ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device, expected", [
    ("nosuchdev", "unknown device 'nosuchdev': expected cpu, cuda or cuda:N."),
    ("cuda", "device 'cuda' is not available"),
])
def test_an_unusable_device_is_one_sentence_and_exit_2(monkeypatch, device, expected):
    from click.testing import CliRunner

    from tidegate.engine.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only torch
    result = CliRunner().invoke(main, ["generate", "--device", device, "--prompt", "hi", "--max-tokens", "2"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def _metaspace_tokenizer():
    """A SentencePiece-style BPE (Metaspace, byte fallback) trained here, as Llama 2's is built."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "héllo wörld, ça va?"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def hf_tokenizers():
    from tests.helpers import byte_level_bpe

    return [byte_level_bpe(), _metaspace_tokenizer()]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_whole_decode_on_hugging_face_tokenizers(hf_tokenizers, data):
    """Token by token (DecodeStream) or in pieces, the deltas of an output that is text (any characters,
    byte-fallback ones split across tokens included) with special tokens among it add up to the
    tokenizer's decode of the whole output, with or without the special tokens."""
    tok = data.draw(st.sampled_from(hf_tokenizers))
    ids: list[int] = []
    for text in data.draw(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=4)):
        if ids:  # between two texts, never inside a character's bytes
            ids.append(data.draw(st.sampled_from([tok.bos_token_id, tok.eos_token_id])))
        ids += tok.encode(text, add_special_tokens=False)
    skip = data.draw(st.booleans())
    assert "".join(_deltas(tok, ids, skip, data)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_token_ids_stream_without_failing(hf_tokenizers, data):
    """Any ids at all (invalid byte runs too, where the tokenizers library's DecodeStream raises) stream
    to an end; what was shown is never taken back."""
    tok = data.draw(st.sampled_from(hf_tokenizers))
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=40))
    deltas = _deltas(tok, ids, data.draw(st.booleans()), data)
    assert all(isinstance(d, str) for d in deltas)


def _deltas(tok, ids: list[int], skip: bool, data) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids), 1)), max_size=5)) | {len(ids)})
    start, deltas = 0, []
    for cut in cuts:
        deltas.append(detok.push(ids[start:cut]))
        start = cut
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return deltas


def test_the_defaults_are_vllms_batch_limits_and_the_cpus_fast_dtype(tiny, monkeypatch):
    from tidegate.engine.real import model as model_module

    assert model_module.default_batch_limits("cpu") == (2048, 128)
    llm = LLM("tiny", device="cpu", kv_capacity_tokens=4096)
    assert (llm.profile.max_num_batched_tokens, llm.profile.max_num_seqs) == (2048, 128)
    assert llm.executor.dtype == model_module.default_dtype(torch.device("cpu"))
    explicit = LLM("tiny", device="cpu", kv_capacity_tokens=4096, max_num_batched_tokens=256, max_num_seqs=8)
    assert (explicit.profile.max_num_batched_tokens, explicit.profile.max_num_seqs) == (256, 8)
    # bf16 only where the CPU multiplies it in hardware
    for amx, avx512_bf16, expected in ((False, False, torch.float32), (True, False, torch.bfloat16),
                                       (False, True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert model_module.default_dtype(torch.device("cpu")) == expected
    # a model handed in keeps its own dtype, whatever the machine's default
    given = LLM("tiny", device="cpu", kv_capacity_tokens=4096, model_and_tokenizer=tiny)
    assert given.executor.dtype == torch.float32 and given.executor.cache.key_cache.dtype == torch.float32
