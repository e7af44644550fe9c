"""vLLM's ``allowed_token_ids`` and ``bad_words`` (``bad_words_token_ids``) on the real engine (tiny
model, fp32, CPU), and the tokenization of bad words (``bad_words_token_ids``) as vLLM's
``SamplingParams.update_from_tokenizer`` does it.

Greedy outputs are checked against HF's forward pass with the masks written from vLLM's rules
(``vllm/v1/sample/ops/bad_words.py``); the sampler's masks on random logits and output histories
are checked as a property.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import byte_level_bpe
from tests.test_sampling import PROMPT, _hf_logits, _reference_greedy, greedy_ids, llm  # noqa: F401 (fixtures)
from tidegate.engine.core.request import Request
from tidegate.engine.real.model import ByteTokenizer
from tidegate.engine.real.sampler import RequestSampling, Sampler
from tidegate.engine.real.sampling import SamplingParams, bad_words_token_ids

torch.set_num_threads(1)  # 2 threads stall badly when the 2 cores are shared

EOS = 2
VOCAB = 259
LETTERS = [ord(c) + 3 for c in "abcdefghijklmnopqrstuvwxyz"]  # the byte tokenizer's ids of a-z


def _vllm_masks(allowed: list[int] | None, bad: list[list[int]]):
    """``process`` for ``_reference_greedy``: vLLM's allowed-token mask and bad-words rule."""
    def process(logits, _prompt, out):
        if allowed is not None:
            keep = logits[allowed].clone()
            logits[:] = float("-inf")
            logits[allowed] = keep
        for seq in bad:
            if len(seq) == 1 or out[len(out) - len(seq) + 1:] == seq[:-1]:
                logits[seq[-1]] = float("-inf")
        return logits
    return process


def _bigrams(ids: list[int]) -> set[tuple[int, int]]:
    return set(zip(ids, ids[1:]))


# --- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(allowed_token_ids=[]), r"allowed_token_ids must be None or a non-empty list of token ids"),
    (dict(allowed_token_ids=[5, -1]), r"allowed_token_ids must be None or a non-empty list of token ids"),
    (dict(allowed_token_ids=["5"]), r"allowed_token_ids must be None or a non-empty list of token ids"),
    (dict(allowed_token_ids=[True]), r"allowed_token_ids must be None or a non-empty list of token ids"),
    (dict(allowed_token_ids=5), r"allowed_token_ids must be None or a non-empty list of token ids"),
    (dict(bad_words_token_ids=[[]]), r"bad_words_token_ids must be a list of non-empty lists of token ids"),
    (dict(bad_words_token_ids=[[5], []]), r"bad_words_token_ids must be a list of non-empty lists"),
    (dict(bad_words_token_ids=[[5, -1]]), r"bad_words_token_ids must be a list of non-empty lists"),
    (dict(bad_words_token_ids=[5, 6]), r"bad_words_token_ids must be a list of non-empty lists"),
    (dict(bad_words_token_ids=[[5, 1.5]]), r"bad_words_token_ids must be a list of non-empty lists"),
])
def test_a_bad_mask_parameter_is_one_sentence_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_good_mask_parameters_are_kept_as_lists():
    s = SamplingParams(allowed_token_ids=(5, 6), bad_words_token_ids=[(7,), [5, 6]])
    assert s.allowed_token_ids == [5, 6] and s.bad_words_token_ids == [[7], [5, 6]]
    # A bad word of two tokens leaves its last token allowed on its own: not a contradiction.
    SamplingParams(allowed_token_ids=[6], bad_words_token_ids=[[5, 6]])
    assert SamplingParams().allowed_token_ids is None and SamplingParams().bad_words_token_ids is None


def test_mask_ids_outside_the_vocabulary_are_refused_by_verify(llm):
    SamplingParams(allowed_token_ids=[0, VOCAB - 1], bad_words_token_ids=[[VOCAB - 1, 3]]).verify(VOCAB)
    with pytest.raises(ValueError, match=r"allowed_token_ids holds token ids outside the vocabulary of 259: "
                                         r"\[259, 1000\]\."):
        SamplingParams(allowed_token_ids=[1000, 5, 259]).verify(VOCAB)
    with pytest.raises(ValueError, match=r"^bad_words .*holds token ids outside the vocabulary of 259: \[300\]\."):
        SamplingParams(bad_words_token_ids=[[5], [6, 300]]).verify(VOCAB)
    with pytest.raises(ValueError, match="allowed_token_ids holds token ids outside the vocabulary of 259"):
        llm.check_request([1, 5], 4, SamplingParams(allowed_token_ids=[259]))
    with pytest.raises(ValueError, match=r"^bad_words bans every token of allowed_token_ids, which leaves nothing"):
        llm.check_request([1, 5], 4, SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[6], [5]]))
    with pytest.raises(ValueError, match="bad_words .*outside the vocabulary of 259"):
        llm.generate("hi", SamplingParams(bad_words_token_ids=[[259]]), max_tokens=4)
    assert not llm.has_unfinished


# --- allowed_token_ids -----------------------------------------------------------------------------

def test_greedy_with_allowed_token_ids_generates_only_them(llm, greedy_ids):
    assert not set(greedy_ids) <= set(LETTERS)
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate(prompt, SamplingParams(allowed_token_ids=LETTERS, ignore_eos=True), max_tokens=24)[0]
    assert set(out.token_ids) <= set(LETTERS) and out.text.isalpha() and out.text.islower()
    assert out.token_ids == _reference_greedy(llm.model, prompt, 24, _vllm_masks(LETTERS, []))
    # One allowed token: the output is that token throughout, EOS never comes.
    one = llm.generate(PROMPT, SamplingParams(allowed_token_ids=[100]), max_tokens=6)[0]
    assert one.token_ids == [100] * 6 and one.finish_reason == "length"


@pytest.mark.parametrize("extra", [
    dict(), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2), dict(temperature=3.0), dict(frequency_penalty=2.0),
    dict(logit_bias={ord("!") + 3: 100.0}),
])
def test_sampled_tokens_come_only_from_allowed_token_ids(llm, extra):
    allowed = LETTERS[::3]
    for seed in range(3):
        params = dict(temperature=1.0, seed=seed, allowed_token_ids=allowed, ignore_eos=True) | extra
        out = llm.generate(PROMPT, SamplingParams(**params), max_tokens=16)[0].token_ids
        assert len(out) == 16 and set(out) <= set(allowed), (seed, out)
    # Seeded draws reproduce with the mask.
    again = llm.generate(PROMPT, SamplingParams(**params), max_tokens=16)[0].token_ids
    assert again == out


def test_logprobs_are_taken_after_the_allowed_token_mask(llm):
    """vLLM's processed logprobs: the distribution over the allowed tokens only; the others are -inf."""
    prompt = llm.tokenizer.encode(PROMPT)
    allowed = [50, 80, 120]
    params = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed, logprobs=5, ignore_eos=True)
    out = llm.generate(prompt, params, max_tokens=8)[0]
    logits = _hf_logits(llm.model, prompt + out.token_ids)[len(prompt) - 1:-1]
    for (tok, lp, alternatives), row in zip(out.logprobs, logits):
        expected = torch.log_softmax(row[allowed], -1)
        assert tok in allowed and abs(lp - float(expected[allowed.index(tok)])) < 1e-4
        assert sorted(t for t, _ in alternatives[:3]) == allowed
        assert math.isclose(sum(math.exp(v) for _, v in alternatives[:3]), 1.0, rel_tol=1e-4)
        assert [v for _, v in alternatives[3:]] == [float("-inf")] * 2


# --- bad words -----------------------------------------------------------------------------------

def test_a_one_token_bad_word_never_appears(llm, greedy_ids):
    common = max(set(greedy_ids), key=greedy_ids.count)
    banned = [[greedy_ids[0]], [common]]
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate(prompt, SamplingParams(bad_words_token_ids=banned, ignore_eos=True), max_tokens=40)[0]
    assert greedy_ids[0] not in out.token_ids and common not in out.token_ids
    assert out.token_ids == _reference_greedy(llm.model, prompt, 40, _vllm_masks(None, banned))
    sampled = SamplingParams(temperature=2.0, seed=1, bad_words_token_ids=banned, ignore_eos=True)
    out = llm.generate(prompt, sampled, max_tokens=40)[0].token_ids
    assert greedy_ids[0] not in out and common not in out


def test_a_two_token_bad_word_never_appears_while_its_first_token_may(llm, greedy_ids):
    a, b = greedy_ids[:2]
    prompt = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(bad_words_token_ids=[[a, b]], ignore_eos=True)
    out = llm.generate(prompt, params, max_tokens=40)[0].token_ids
    assert out[0] == a and out[1] != b  # a alone is fine; b only after a is banned
    assert (a, b) not in _bigrams(out)
    assert out == _reference_greedy(llm.model, prompt, 40, _vllm_masks(None, [[a, b]]))
    # b forced by the bias: banned right after a only, and an a at the end of the prompt does not count.
    forced = SamplingParams(bad_words_token_ids=[[a, b]], logit_bias={b: 100.0}, ignore_eos=True)
    assert llm.generate([1, a], forced, max_tokens=6)[0].token_ids == [b] * 6
    # Between two tokens, with b forced and [b, b] bad: b, then a (b is banned), then b again.
    alternate = SamplingParams(allowed_token_ids=[a, b], bad_words_token_ids=[[b, b]], logit_bias={b: 100.0},
                               ignore_eos=True)
    assert llm.generate([1, b], alternate, max_tokens=6)[0].token_ids == [b, a] * 3


def test_longer_bad_words_follow_vllms_rule(llm, greedy_ids):
    """Three- and two-token sequences together, over the output only (never the prompt)."""
    g = greedy_ids
    prompt = llm.tokenizer.encode(PROMPT)
    bad = [g[:3], [g[3], g[4]], [prompt[-1], g[0]], [g[5], g[6], g[7], g[8]]]
    out = llm.generate(prompt, SamplingParams(bad_words_token_ids=bad, ignore_eos=True), max_tokens=40)[0]
    assert out.token_ids[0] == g[0]  # [prompt[-1], g[0]] spans the prompt: not banned
    assert out.token_ids == _reference_greedy(llm.model, prompt, 40, _vllm_masks(None, bad))
    for seq in bad[:2] + bad[3:]:
        n = len(seq)
        assert all(out.token_ids[i:i + n] != seq for i in range(len(out.token_ids))), seq


def test_bad_words_from_text_never_appear_in_the_text(llm, greedy_ids):
    tok = ByteTokenizer()
    text = llm.generate(PROMPT, SamplingParams(ignore_eos=True), max_tokens=40)[0].text
    word = next(text[i:i + 2] for i in range(len(text)) if text[i:i + 2].isascii() and len(text[i:i + 2]) == 2)
    assert word in text
    ids = bad_words_token_ids(tok, [word])
    out = llm.generate(PROMPT, SamplingParams(bad_words_token_ids=ids, ignore_eos=True), max_tokens=40)[0]
    assert word not in out.text and out.text != text


def test_masks_and_plain_requests_batch_together(llm, greedy_ids):
    """Each request's tokens are the ones it gets alone; the plain ones keep the fast path."""
    prompts = [PROMPT, "gates", "x" * 30, "hello hello", "dawn", PROMPT]
    samplings = [SamplingParams(ignore_eos=True),
                 SamplingParams(allowed_token_ids=LETTERS, ignore_eos=True),
                 SamplingParams(temperature=0.9, seed=5, bad_words_token_ids=[[greedy_ids[0]], [70, 71]],
                                ignore_eos=True),
                 SamplingParams(repetition_penalty=1.5, allowed_token_ids=LETTERS[:5], logprobs=2, min_tokens=3,
                                ignore_eos=False),
                 SamplingParams(temperature=1.2, top_p=0.9, seed=9, allowed_token_ids=LETTERS,
                                bad_words_token_ids=[[LETTERS[0], LETTERS[1]]], ignore_eos=True),
                 SamplingParams(bad_words_token_ids=[greedy_ids[:2]], ignore_eos=True)]
    together = llm.generate(prompts, samplings, max_tokens=20)
    assert together[0].token_ids == greedy_ids[:20]
    for p, s, out in zip(prompts, samplings, together):
        alone = llm.generate(p, s, max_tokens=20)[0]
        assert out.token_ids == alone.token_ids
    r = Request("r", 0.0, 2, 4, prompt_token_ids=[1, 5])
    assert RequestSampling(r, SamplingParams(), frozenset({EOS}), torch.device("cpu"), VOCAB).plain
    for s in samplings[1:]:
        assert not RequestSampling(r, s, frozenset({EOS}), torch.device("cpu"), VOCAB).plain


def test_contradictory_masks_lift_for_the_step_instead_of_failing(llm):
    """Where the masks leave no token at a step (a bad word's prefix followed by only banned tokens), that step
    draws from the unmasked logits rather than from nothing; where they leave none at any step (only tokens that
    end the sequence, under ``min_tokens``), the request is refused up front: it answered tokens outside
    ``allowed_token_ids``."""
    a, b = LETTERS[:2]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=2, allowed_token_ids=[a, b],
                                bad_words_token_ids=[[a, a], [a, b]], ignore_eos=True)
        out = llm.generate(PROMPT, params, max_tokens=12)[0].token_ids
        assert len(out) == 12 and out[0] in (a, b)
        assert all(t in (a, b) for prev, t in zip(out, out[1:]) if prev != a)
        only_eos = SamplingParams(temperature=temperature, seed=2, allowed_token_ids=[EOS], min_tokens=3)
        with pytest.raises(ValueError, match="min_tokens masks every token of allowed_token_ids"):
            llm.generate(PROMPT, only_eos, max_tokens=12)
        stops = SamplingParams(temperature=temperature, allowed_token_ids=[a, b], stop_token_ids=[a, b],
                               min_tokens=1, ignore_eos=True)
        with pytest.raises(ValueError, match="leaves nothing to generate"):
            llm.generate(PROMPT, stops, max_tokens=12)
        bad_and_eos = SamplingParams(temperature=temperature, allowed_token_ids=[EOS, a], bad_words_token_ids=[[a]],
                                     min_tokens=2)
        with pytest.raises(ValueError, match="or is a bad word"):
            llm.generate(PROMPT, bad_and_eos, max_tokens=12)
        eos_kept = SamplingParams(temperature=temperature, seed=2, allowed_token_ids=[EOS], min_tokens=3,
                                  ignore_eos=True)  # EOS ends nothing here: it is generated
        assert llm.generate(PROMPT, eos_kept, max_tokens=4)[0].token_ids == [EOS] * 4


# --- the sampler's masks as a property --------------------------------------------------------------

SMALL_VOCAB = 12
_ids = st.integers(0, SMALL_VOCAB - 1)


@st.composite
def _masked_rows(draw):
    """A few requests' sampling parameters and output histories over a small vocabulary."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        allowed = draw(st.none() | st.lists(_ids, min_size=1, max_size=6))
        bad = draw(st.lists(st.lists(_ids, min_size=1, max_size=3), max_size=5))
        if allowed is not None and set(allowed) <= {s[0] for s in bad if len(s) == 1}:
            bad = [s for s in bad if len(s) > 1]
        sampling = SamplingParams(temperature=draw(st.sampled_from([0.0, 0.7, 1.5])), seed=draw(st.integers(0, 99)),
                                  top_k=draw(st.sampled_from([0, 3])), allowed_token_ids=allowed,
                                  bad_words_token_ids=bad or None)
        history = draw(st.lists(_ids, max_size=6))
        if bad and draw(st.booleans()):  # ending with a bad word's prefix, or with the tail of one
            history += draw(st.sampled_from(bad))[draw(st.integers(0, 1)):-1]
        rows.append((sampling, history))
    return rows, draw(st.integers(0, 2**31))


@given(_masked_rows())
def test_the_sampler_never_picks_a_banned_token(case):
    rows, seed = case
    torch.manual_seed(seed)
    logits = torch.randn(len(rows), SMALL_VOCAB) * 3
    reqs, states = [], []
    for i, (sampling, history) in enumerate(rows):
        r = Request(str(i), 0.0, 1, 8, prompt_token_ids=[1], sampling=sampling)
        r.output_token_ids = list(history)
        reqs.append(r)
        states.append(RequestSampling(r, sampling, frozenset({EOS}), torch.device("cpu"), SMALL_VOCAB))
    sampler = Sampler(torch.device("cpu"), seed=seed)
    processed = sampler._process(logits.clone(), reqs, states)
    tokens = sampler.sample(logits.clone(), reqs, states)
    for (sampling, history), token, row, masked in zip(rows, tokens, logits, processed):
        banned = set(range(SMALL_VOCAB)) - set(sampling.allowed_token_ids or range(SMALL_VOCAB))
        for seq in sampling.bad_words_token_ids or ():
            if len(seq) == 1 or history[len(history) - len(seq) + 1:] == seq[:-1]:
                banned.add(seq[-1])
        if len(banned) == SMALL_VOCAB:  # contradictory: the masks are lifted for the step
            assert torch.equal(masked, row)
            continue
        assert set(torch.isinf(masked).nonzero().flatten().tolist()) == banned, (sampling, history)
        assert token not in banned, (sampling, history, token, banned)
        if sampling.greedy:
            best = max((t for t in range(SMALL_VOCAB) if t not in banned), key=lambda t: float(row[t]))
            assert token == best


# --- bad_words_token_ids: vLLM's tokenization of bad words --------------------------------------------

def _vllm_update_from_tokenizer(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """vLLM's ``SamplingParams.update_from_tokenizer``, as written there."""
    bad_words_token_ids: list[list[int]] = []
    for bad_word in bad_words:
        for add_prefix_space in [False, True]:
            prefix = " " if add_prefix_space else ""
            prompt = prefix + bad_word.lstrip()
            prompt_token_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
            if (not add_prefix_space) or (add_prefix_space and prompt_token_ids[0] != bad_words_token_ids[-1][0]
                                          and len(prompt_token_ids) == len(bad_words_token_ids[-1])):
                bad_words_token_ids.append(prompt_token_ids)
    return bad_words_token_ids


def test_bad_words_on_the_byte_tokenizer_are_their_bytes():
    tok = ByteTokenizer()
    # A leading space is one more byte, so the spaced form is never kept.
    assert bad_words_token_ids(tok, ["hello", "  x", "é"]) == [
        [ord(c) + 3 for c in "hello"], [ord("x") + 3], [0xC3 + 3, 0xA9 + 3]]
    assert bad_words_token_ids(tok, "hi") == [[ord("h") + 3, ord("i") + 3]]
    assert bad_words_token_ids(tok, []) == []
    words = ["hello", " there", "a b", "é"]
    assert bad_words_token_ids(tok, words) == _vllm_update_from_tokenizer(tok, words)
    for word in ("", "   "):
        with pytest.raises(ValueError, match="bad_words must hold words with at least one token"):
            bad_words_token_ids(tok, ["ok", word])


@pytest.fixture(scope="module")
def bpe_tokenizer():
    return byte_level_bpe()


def test_bad_words_on_a_bpe_tokenizer_are_vllms(bpe_tokenizer):
    tok = bpe_tokenizer
    assert tok.encode("the")[0] == tok.bos_token_id  # special tokens are there to be left out
    the, spaced_the = tok.convert_tokens_to_ids(["the", "Ġthe"])
    assert the != spaced_the
    # A word has a token of its own at the start of text and another after a space: both banned.
    assert bad_words_token_ids(tok, ["the"]) == [[the], [spaced_the]]
    assert bad_words_token_ids(tok, ["  the"]) == [[the], [spaced_the]]
    lazy_dog = bad_words_token_ids(tok, ["the lazy dog"])
    assert [tok.convert_ids_to_tokens(ids) for ids in lazy_dog] == [["the", "Ġlazy", "Ġdog"],
                                                                    ["Ġthe", "Ġlazy", "Ġdog"]]
    words = ["the", "quick brown", "hello there", "zebra", "x", "end", "the lazy dog", "é"]
    sequences = bad_words_token_ids(tok, words)
    assert sequences == _vllm_update_from_tokenizer(tok, words)
    assert all(tok.bos_token_id not in seq for seq in sequences)
    SamplingParams(bad_words_token_ids=sequences).verify(len(tok))
    # A word that splits differently after a space (another length) keeps only its plain form.
    uneven = [w for w in words if len(tok.encode(w, add_special_tokens=False))
              != len(tok.encode(" " + w, add_special_tokens=False))]
    assert uneven, "the corpus should give at least one word of uneven lengths"
    for w in uneven:
        assert bad_words_token_ids(tok, [w]) == [tok.encode(w, add_special_tokens=False)]


# ---------------------------------------------------------------------------------- logprob_token_ids
def test_logprob_token_ids_replace_the_most_likely_alternatives(llm):
    named = [LETTERS[0], LETTERS[5], EOS]
    top = llm.generate(PROMPT, SamplingParams(logprobs=3, ignore_eos=True), max_tokens=6)[0]
    out = llm.generate(PROMPT, SamplingParams(logprobs=3, logprob_token_ids=named, ignore_eos=True), max_tokens=6)[0]
    assert out.token_ids == top.token_ids  # the tokens do not change, only what the entries name
    for (tok, lp, alts), (tok_top, lp_top, alts_top) in zip(out.logprobs, top.logprobs):
        assert (tok, lp) == (tok_top, pytest.approx(lp_top, abs=1e-5))
        assert [a for a, _ in alts] == named
        for a, alp in alts_top:  # where a named id is among the most likely, the two agree
            if a in named:
                assert dict(alts)[a] == pytest.approx(alp, abs=1e-5)
        assert all(alp <= max(v for _, v in alts_top) + 1e-6 for _, alp in alts)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprobs=1, logprob_token_ids=[]), "logprob_token_ids must be None or a list of 1 to"),
    (dict(logprobs=1, logprob_token_ids=[-1]), "logprob_token_ids must be None or a list of 1 to"),
    (dict(logprob_token_ids=[5]), "logprob_token_ids needs logprobs"),
])
def test_bad_logprob_token_ids_are_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logprob_token_ids_outside_the_vocabulary_are_refused_by_verify():
    with pytest.raises(ValueError, match="logprob_token_ids holds token ids outside the vocabulary of 259"):
        SamplingParams(logprobs=0, logprob_token_ids=[5, 300]).verify(VOCAB)


# ---------------------------------------------------------------------------------- skip_special_tokens
@pytest.mark.parametrize("skip, shown", [(True, ""), (False, "<s>")])
def test_skip_special_tokens_decides_whether_a_special_tokens_text_shows(llm, skip, shown):
    """Only BOS (id 1, text ``<s>``) and ``a`` may be drawn: the special token's text shows only without
    ``skip_special_tokens``, in the whole text and in the streamed deltas alike."""
    sampling = SamplingParams(allowed_token_ids=[1, LETTERS[0]], logit_bias={1: 100.0}, ignore_eos=True,
                              skip_special_tokens=skip)
    out = llm.generate(PROMPT, sampling, max_tokens=3)[0]
    assert out.token_ids == [1, 1, 1]
    assert out.text == shown * 3
    assert "".join(llm.stream(PROMPT, sampling, max_tokens=3)) == shown * 3
