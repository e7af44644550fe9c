"""The OpenAI/vLLM sampling parameters on the real engine (tiny model, fp32, CPU).

Penalties, bias and logprobs are checked against a reference written from the parameters'
definitions over HF's own forward pass on the full sequence, also in batches that mix requests
with and without them, under chunked prefill and under recompute evictions.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from tidegate.engine.real.llm import LLM
from tidegate.engine.real.model import ByteTokenizer, build_tiny_model
from tidegate.engine.real.sampling import SamplingParams

torch.set_num_threads(1)  # 2 threads stall badly when the 2 cores are shared

PROMPT = "The tide gates open at dawn"
EOS = 2


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", kv_capacity_tokens=4096, device="cpu", dtype="float32")  # exact references: fp32 everywhere


@pytest.fixture(scope="module")
def greedy_ids(llm):
    return llm.generate(PROMPT, SamplingParams(ignore_eos=True), max_tokens=40)[0].token_ids


def _small(llm, **kwargs) -> LLM:
    return LLM(model_and_tokenizer=(llm.model, llm.tokenizer), device="cpu", **kwargs)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    """HF's logits at every position of ``ids``, float32 ``[len(ids), vocab]``."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.clone()  # a normal tensor, which the references may change in place


def _reference_greedy(model, prompt: list[int], n: int, process) -> list[int]:
    """Greedy decoding with HF's full forward each step and ``process(logits, prompt, out)`` applied."""
    out: list[int] = []
    for _ in range(n):
        logits = _hf_logits(model, prompt + out)[-1]
        out.append(int(process(logits, prompt, out).argmax()))
    return out


def _openai_penalties(presence: float, frequency: float):
    def process(logits, _prompt, out):
        for t, c in Counter(out).items():
            logits[t] -= presence + frequency * c
        return logits
    return process


def _repetition(penalty: float):
    def process(logits, prompt, out):
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        return logits
    return process


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# --- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be in \[0.01, 100\]"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be in \[0.01, 100\]"),
    (dict(repetition_penalty=1e-300), r"repetition_penalty must be in"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_tokens=-1), r"min_tokens must be an integer >= 0"),
    (dict(logit_bias={5: 101}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias={5: float("nan")}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias={"five": 1}), r"logit_bias keys must be token ids"),
    (dict(logit_bias={-1: 1}), r"logit_bias keys must be token ids"),
    (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
    (dict(logprobs=-1), r"logprobs must be None or an integer in \[0, 20\]"),
    (dict(prompt_logprobs=21), r"prompt_logprobs must be None or an integer in \[0, 20\]"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be token ids"),
])
def test_a_bad_parameter_is_one_sentence_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_takes_json_style_string_keys():
    assert SamplingParams(logit_bias={"5": 10}).logit_bias == {5: 10.0}


def test_token_ids_outside_the_vocabulary_are_refused_at_the_request_check(llm):
    with pytest.raises(ValueError, match="logit_bias holds token ids outside the vocabulary of 259"):
        llm.check_request([1, 5], 4, SamplingParams(logit_bias={9999: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids holds token ids outside the vocabulary of 259"):
        llm.generate("hi", SamplingParams(stop_token_ids=[259]), max_tokens=4)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens"):
        llm.add_request("hi", SamplingParams(min_tokens=5), max_tokens=4)
    assert not llm.has_unfinished


# --- logit_bias, penalties, min_p -----------------------------------------------------------------

def test_logit_bias_forces_or_forbids_a_token(llm, greedy_ids):
    forced = llm.generate(PROMPT, SamplingParams(logit_bias={100: 100}, ignore_eos=True), max_tokens=8)[0]
    assert forced.token_ids == [100] * 8
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={100: 100}, ignore_eos=True)
    assert llm.generate(PROMPT, sampled, max_tokens=8)[0].token_ids == [100] * 8
    first = greedy_ids[0]
    banned = llm.generate(PROMPT, SamplingParams(logit_bias={first: -100}, ignore_eos=True), max_tokens=8)[0]
    assert banned.token_ids[0] != first and first not in banned.token_ids

    def bias(logits, _prompt, _out):
        logits[first] -= 100
        return logits
    prompt = llm.tokenizer.encode(PROMPT)
    assert banned.token_ids == _reference_greedy(llm.model, prompt, 8, bias)


@pytest.mark.parametrize("presence, frequency", [(2.0, 0.0), (0.0, 2.0), (0.5, 0.7), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_are_openais(llm, presence, frequency):
    prompt = llm.tokenizer.encode(PROMPT)
    sampling = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
    out = llm.generate(prompt, sampling, max_tokens=24)[0].token_ids
    assert out == _reference_greedy(llm.model, prompt, 24, _openai_penalties(presence, frequency))


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.8])
def test_repetition_penalty_is_vllms_over_prompt_and_output(llm, penalty):
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate(prompt, SamplingParams(repetition_penalty=penalty, ignore_eos=True), max_tokens=24)[0]
    assert out.token_ids == _reference_greedy(llm.model, prompt, 24, _repetition(penalty))


def test_penalties_reduce_repeats(llm, greedy_ids):
    assert _repeats(greedy_ids) > 0
    for sampling in (SamplingParams(presence_penalty=2.0, ignore_eos=True),
                     SamplingParams(frequency_penalty=2.0, ignore_eos=True),
                     SamplingParams(repetition_penalty=2.0, ignore_eos=True)):
        out = llm.generate(PROMPT, sampling, max_tokens=40)[0].token_ids
        assert _repeats(out) < _repeats(greedy_ids), sampling


def test_min_p_one_is_greedy(llm, greedy_ids):
    sampling = SamplingParams(temperature=1.0, min_p=1.0, seed=7, ignore_eos=True)
    assert llm.generate(PROMPT, sampling, max_tokens=40)[0].token_ids == greedy_ids
    loose = SamplingParams(temperature=1.0, min_p=0.0, seed=7, ignore_eos=True)
    assert llm.generate(PROMPT, loose, max_tokens=40)[0].token_ids != greedy_ids


def test_a_batch_mixing_parameters_gives_each_request_its_own_output(llm):
    """Processing only the rows that ask for it: each request's tokens are the ones it gets alone."""
    prompts = [PROMPT, "gates", "x" * 30, "hello hello", "dawn"]
    samplings = [SamplingParams(ignore_eos=True),
                 SamplingParams(frequency_penalty=1.5, ignore_eos=True),
                 SamplingParams(temperature=0.8, top_k=20, min_p=0.1, seed=5, ignore_eos=True),
                 SamplingParams(repetition_penalty=1.5, logit_bias={70: 5.0}, logprobs=2, ignore_eos=True),
                 SamplingParams(temperature=1.2, top_p=0.9, seed=9, presence_penalty=1.0, ignore_eos=True)]
    together = llm.generate(prompts, samplings, max_tokens=20)
    for p, s, out in zip(prompts, samplings, together):
        alone = llm.generate(p, s, max_tokens=20)[0]
        assert out.token_ids == alone.token_ids


# --- stopping ------------------------------------------------------------------------------------

def test_min_tokens_masks_eos_until_reached(llm):
    forced_eos = {EOS: 100.0}
    out = llm.generate(PROMPT, SamplingParams(logit_bias=forced_eos), max_tokens=20)[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop"
    out = llm.generate(PROMPT, SamplingParams(logit_bias=forced_eos, min_tokens=5), max_tokens=20)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 6
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:5]
    assert out.text == ByteTokenizer().decode(out.token_ids)
    # With ignore_eos, EOS is an ordinary token: min_tokens does not mask it.
    out = llm.generate(PROMPT, SamplingParams(logit_bias=forced_eos, min_tokens=5, ignore_eos=True), max_tokens=8)[0]
    assert out.token_ids == [EOS] * 8 and out.finish_reason == "length"


def test_min_tokens_also_holds_stop_tokens_and_stop_strings(llm, greedy_ids):
    ids = greedy_ids
    # A printable ASCII byte the greedy output produces at least twice, after its first token.
    k1, k2 = next((i, j) for i in range(1, len(ids)) for j in range(i + 1, len(ids))
                  if 3 + 33 <= ids[i] <= 3 + 126 and ids[j] == ids[i] and ids[i] not in ids[:i] + ids[i + 1:j])
    stop = chr(ids[k1] - 3)
    early = llm.generate(PROMPT, SamplingParams(ignore_eos=True, stop=[stop]), max_tokens=40)[0]
    assert early.token_ids == ids[:k1 + 1]
    # A stop string completed within the first min_tokens tokens neither ends the request nor cuts the text.
    deltas: list[str] = []
    sampling = SamplingParams(ignore_eos=True, stop=[stop], min_tokens=k1 + 1)
    r = llm.add_request(PROMPT, sampling, max_tokens=40, on_delta=lambda _r, d, _done: deltas.append(d))
    while not r.state.is_terminal:
        llm.step()
    out = llm.output(r)
    assert out.finish_reason == "stop" and out.token_ids == ids[:k2 + 1]
    assert out.text == ByteTokenizer().decode(ids[:k2]) and stop in out.text
    assert "".join(deltas) == out.text
    # A stop token is masked out until then, so the greedy output takes another token there.
    sampling = SamplingParams(ignore_eos=True, stop_token_ids=[ids[k1]], min_tokens=k1 + 1)
    out = llm.generate(PROMPT, sampling, max_tokens=40)[0]
    assert out.token_ids[:k1] == ids[:k1] and out.token_ids[k1] != ids[k1]
    assert ids[k1] not in out.token_ids[:k1 + 1]


def test_stop_token_ids_end_with_stop_and_hide_the_token_text(llm, greedy_ids):
    ids = greedy_ids
    k = next(i for i in range(3, len(ids)) if 3 + 33 <= ids[i] <= 3 + 126 and ids[i] not in ids[:i])
    tok = ByteTokenizer()
    out = llm.generate(PROMPT, SamplingParams(ignore_eos=True, stop_token_ids=[ids[k]]), max_tokens=40)[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:k + 1]
    assert out.text == tok.decode(ids[:k])
    shown = SamplingParams(ignore_eos=True, stop_token_ids=[ids[k]], include_stop_str_in_output=True)
    out = llm.generate(PROMPT, shown, max_tokens=40)[0]
    assert out.token_ids == ids[:k + 1] and out.text == tok.decode(ids[:k + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(llm, greedy_ids):
    ids = greedy_ids
    k = next(i for i in range(3, len(ids)) if 3 + 33 <= ids[i] <= 3 + 126 and ids[i] not in ids[:i])
    stop = chr(ids[k] - 3)
    deltas: list[str] = []
    sampling = SamplingParams(ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    r = llm.add_request(PROMPT, sampling, max_tokens=40, on_delta=lambda _r, d, _done: deltas.append(d))
    while not r.state.is_terminal:
        llm.step()
    out = llm.output(r)
    assert out.finish_reason == "stop" and out.token_ids == ids[:k + 1]
    assert out.text == ByteTokenizer().decode(ids[:k + 1]) and out.text.endswith(stop)
    assert "".join(deltas) == out.text


def test_every_eos_id_of_the_generation_config_ends_generation():
    model, tok = build_tiny_model(seed=0)
    base = LLM(kv_capacity_tokens=2048, model_and_tokenizer=(model, tok), device="cpu")
    ids = base.generate(PROMPT, SamplingParams(ignore_eos=True), max_tokens=30)[0].token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    model.generation_config.eos_token_id = [EOS, ids[k]]
    llm = LLM(kv_capacity_tokens=2048, model_and_tokenizer=(model, tok), device="cpu")
    assert llm.executor.eos_token_ids == {EOS, ids[k]}
    out = llm.generate(PROMPT, SamplingParams(), max_tokens=30)[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:k + 1]
    assert out.text == tok.decode(ids[:k])
    assert llm.generate(PROMPT, SamplingParams(ignore_eos=True), max_tokens=30)[0].token_ids == ids
    forced = llm.generate(PROMPT, SamplingParams(logit_bias={ids[k]: 100}, min_tokens=3), max_tokens=30)[0]
    assert len(forced.token_ids) == 4 and forced.token_ids[-1] == ids[k] and ids[k] not in forced.token_ids[:3]


# --- logprobs ------------------------------------------------------------------------------------

def _assert_entries_match(entries, logits: torch.Tensor, k: int):
    """Each ``(token, logprob, alternatives)`` against HF's log-softmax of the row that predicted it, and a
    prompt entry's fourth field, the token's rank in the vocabulary, against the row's."""
    for entry, row in zip(entries, torch.log_softmax(logits, -1)):
        tok, lp, alternatives = entry[:3]
        assert lp <= 0 and abs(lp - float(row[tok])) < 1e-4
        if len(entry) > 3:  # the rank, allowing for near ties between the two computations
            at = float(row[tok])
            assert 1 + int((row > at + 1e-4).sum()) <= entry[3] <= 1 + int((row > at - 1e-4).sum())
        assert len(alternatives) == k
        values = [v for _, v in alternatives]
        assert values == sorted(values, reverse=True)
        top = row.topk(k)
        assert [t for t, _ in alternatives] == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(values, top.values.tolist())) < 1e-4 if k else True


@pytest.mark.parametrize("k", [0, 1, 5])
def test_greedy_logprobs_are_hfs_log_softmax(llm, k):
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate(prompt, SamplingParams(logprobs=k, ignore_eos=True), max_tokens=20)[0]
    assert len(out.logprobs) == len(out.token_ids) == 20
    assert [e[0] for e in out.logprobs] == out.token_ids
    logits = _hf_logits(llm.model, prompt + out.token_ids)[len(prompt) - 1:-1]
    _assert_entries_match(out.logprobs, logits, k)
    if k:  # greedy: the sampled token is the most likely one
        assert all(alts[0][0] == tok for tok, _, alts in out.logprobs)


def test_sampled_logprobs_are_before_temperature_and_after_penalties(llm):
    prompt = llm.tokenizer.encode(PROMPT)
    hot = SamplingParams(temperature=1.7, top_k=30, seed=4, logprobs=3, ignore_eos=True)
    out = llm.generate(prompt, hot, max_tokens=16)[0]
    logits = _hf_logits(llm.model, prompt + out.token_ids)[len(prompt) - 1:-1]
    _assert_entries_match(out.logprobs, logits, 3)
    penalized = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={80: 3.0}, logprobs=3,
                               ignore_eos=True)
    out = llm.generate(prompt, penalized, max_tokens=16)[0]
    logits = _hf_logits(llm.model, prompt + out.token_ids)[len(prompt) - 1:-1]
    process = _openai_penalties(1.0, 0.5)
    for j in range(len(out.token_ids)):
        logits[j, 80] += 3.0
        logits[j] = process(logits[j], prompt, out.token_ids[:j])
    _assert_entries_match(out.logprobs, logits, 3)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_prompt_logprobs_are_hfs_log_softmax_also_chunked(llm, max_num_batched_tokens):
    engine = llm if max_num_batched_tokens == 2048 else _small(llm, kv_capacity_tokens=4096,
                                                              max_num_batched_tokens=max_num_batched_tokens)
    prompt = llm.tokenizer.encode(PROMPT)
    out = engine.generate(prompt, SamplingParams(prompt_logprobs=4, ignore_eos=True), max_tokens=3)[0]
    assert max(engine.core.metrics.step_tokens) <= max_num_batched_tokens
    assert out.logprobs is None
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert [e[0] for e in out.prompt_logprobs[1:]] == prompt[1:]
    _assert_entries_match(out.prompt_logprobs[1:], _hf_logits(llm.model, prompt)[:-1], 4)
    one = engine.generate([1], SamplingParams(prompt_logprobs=2), max_tokens=2)[0]
    assert one.prompt_logprobs == [None]


def test_no_logprobs_unless_asked(llm):
    out = llm.generate(PROMPT, SamplingParams(ignore_eos=True), max_tokens=4)[0]
    assert out.logprobs is None and out.prompt_logprobs is None


def test_each_token_gets_one_logprob_entry_across_evictions(llm):
    """Recompute preemption re-prefills prompt and output: no token is sampled or scored twice."""
    prompts = [PROMPT, "gates open", "x" * 40, "at dawn the tide"]
    samplings = [SamplingParams(logprobs=2, prompt_logprobs=1, ignore_eos=True),
                 SamplingParams(logprobs=1, frequency_penalty=1.0, ignore_eos=True),
                 SamplingParams(temperature=1.0, seed=2, logprobs=3, prompt_logprobs=0, ignore_eos=True),
                 SamplingParams(logprobs=0, ignore_eos=True)]
    calm = llm.generate(prompts, samplings, max_tokens=30)
    small = _small(llm, kv_capacity_tokens=96, block_size=8, max_num_batched_tokens=16)
    squeezed = small.generate(prompts, samplings, max_tokens=30)
    assert small.core.metrics.evictions > 0
    for a, b in zip(calm, squeezed):
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(b.token_ids) == 30
        assert [e[0] for e in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x[1] - y[1]) < 1e-4 and [t for t, _ in x[2]] == [t for t, _ in y[2]]
        if a.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
            assert all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))


def test_prompt_logprobs_are_computed_once_when_a_prefill_starts_over(llm):
    """An eviction in the middle of a chunked prefill: the re-prefill adds only the missing entries."""
    from tidegate.engine.core.block_pool import BlockPool
    from tidegate.engine.core.executor import Batch
    from tidegate.engine.core.request import Request
    from tidegate.engine.real.executor import TorchExecutor

    pool = BlockPool(1024, 8)
    executor = TorchExecutor(llm.model, llm.tokenizer, pool)
    prompt = llm.tokenizer.encode(PROMPT)
    r = Request("a", 0.0, len(prompt), 4, prompt_token_ids=prompt, sampling=SamplingParams(prompt_logprobs=3))
    assert pool.grow(r, len(prompt))

    def prefill(n: int) -> None:
        batch = Batch()
        batch.requests, batch.num_new_tokens, batch.num_tokens = [r], [n], n
        executor.execute(batch)
        r.num_computed_tokens += n

    prefill(10)
    assert len(r.prompt_logprobs) == 11  # None, then prompt tokens 1 to 10 from positions 0 to 9
    first = list(r.prompt_logprobs)
    r.num_computed_tokens = 0  # its KV was dropped: it prefills from the start again
    prefill(6)
    prefill(len(prompt) - 6)
    assert r.prompt_logprobs[:11] == first and len(r.prompt_logprobs) == len(prompt)
    _assert_entries_match(r.prompt_logprobs[1:], _hf_logits(llm.model, prompt)[:-1], 3)


def _visible_by_rescanning(text: str, stops: list[str], min_chars: int) -> tuple[str, bool]:
    """What a stream may show of ``text``, searched whole every time: the first stop string ending after
    ``min_chars`` cuts it; else a suffix that may still grow into a stop string is held back."""
    hits = [(at, s) for s in stops if (at := text.find(s, max(0, min_chars - len(s) + 1))) >= 0]
    if hits:
        return text[:min(hits)[0]], True
    hold = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)
    return text[:len(text) - hold], False


@settings(max_examples=300, deadline=None)
@given(st.text("abc", max_size=60), st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4),
       st.integers(0, 10))
def test_a_stream_searches_only_its_new_text_and_shows_what_a_whole_search_shows(text, stops, min_tokens):
    """The stream searches each stop string only where the text grew since its last search, and holds back only
    prefixes ending in the text's last character: token by token, it shows what searching the whole text shows."""
    from tidegate.engine.real.llm import _Stream

    stream = _Stream(ByteTokenizer(), None, SamplingParams(stop=stops, min_tokens=min_tokens), frozenset())
    for i, byte in enumerate(text.encode()):
        stream.push(byte + 3)
        shown, hit = stream.visible()
        min_chars = min_tokens if i + 1 >= min_tokens else None
        if min_chars is None:  # before min_tokens no stop string counts: only the hold applies
            assert shown == _visible_by_rescanning(text[:i + 1], stops, len(text) + 1)[0]
            continue
        assert (shown, hit) == _visible_by_rescanning(text[:i + 1], stops, min_chars)
        if hit:
            break
