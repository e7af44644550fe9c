"""Automatic prefix caching: the block hashes, the pool's cache, the scheduler's use of it in the
simulator and in the real engine (token-exact with caching on and off), and the workloads that
describe shared prefixes."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.prefix import content_block_hashes, token_block_hashes
from tidegate.engine.core.profile import load_profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.real.llm import LLM
from tidegate.engine.real.model import build_tiny_model
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import WorkloadError, load_synthetic, read_trace

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------- hashes
def test_token_hashes_are_chained_over_full_blocks_and_salted():
    a = list(range(40))
    b = a[:16] + [99] + a[17:]
    ha, hb = token_block_hashes(a, 16), token_block_hashes(b, 16)
    assert len(ha) == 2  # 40 tokens: two full blocks, the partial third has none
    assert ha[0] != hb[0] and ha[1] != hb[1] or ha[0] == hb[0]
    assert token_block_hashes(a[:16] + [7] * 16, 16)[0] == ha[0]  # the first block is the same
    assert token_block_hashes(a[:16] + [7] * 16, 16)[1] != ha[1]
    c = [7] * 16 + a[16:32]
    assert token_block_hashes(c, 16)[1] != ha[1]  # same second block after a different first one
    assert token_block_hashes(a, 16, cache_salt="tenant-a")[0] != ha[0]
    assert token_block_hashes(a, 16, cache_salt="tenant-a") == token_block_hashes(a, 16, cache_salt="tenant-a")
    salted = token_block_hashes(a, 16, cache_salt="tenant-a")
    assert token_block_hashes(a, 16, known=ha[:1]) == ha  # the chain goes on from hashes already made
    assert token_block_hashes(a, 16, cache_salt="tenant-a", known=salted[:1]) == salted


def test_content_hashes_map_runs_of_any_size_onto_blocks():
    # Mooncake's 512-token runs on 16-token blocks: the first run covers 32 blocks
    one = content_block_hashes([5, 6], 512.0, 1024, 16)
    two = content_block_hashes([5, 7], 512.0, 1024, 16)
    assert len(one) == 64 and one[:32] == two[:32] and not set(one[32:]) & set(two[32:])
    # a block that spans two runs changes with either
    assert content_block_hashes([1, 2], 8.0, 16, 16) != content_block_hashes([3, 2], 8.0, 16, 16)
    # blocks past the described runs get no hash
    assert len(content_block_hashes([1], 16.0, 64, 16)) == 1


# ---------------------------------------------------------------------------------------- the pool
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "compute", "free", "add_one"]), st.integers(0, 5),
                          st.integers(0, 3), st.integers(1, 80)), max_size=120),
       st.sampled_from([4, 16]), st.integers(64, 400))
def test_cached_blocks_hold_what_their_readers_expect(ops, block_size, capacity):
    """Blocks are conserved and shared blocks counted once; every block a request reads from the cache
    holds the content its own hashes say (tracked here per block as the hash it was computed for)."""
    pool = BlockPool(max(capacity, block_size), block_size, prefix_caching=True)
    reqs = [Request(str(i), 0, 1, 1) for i in range(6)]
    content: dict[int, int | None] = {}
    for op, i, family, n in ops:
        r = reqs[i]
        if op == "start" and not r.block_ids:
            r.prompt_len = n
            # prompts of one family share their content up to a point that depends on the request
            r.block_hashes = [hash((family, k)) if k < 2 + i % 3 else hash((family, i, k))
                              for k in range(n // block_size)]
            hits = pool.cached_prefix(r.block_hashes, (n - 1) // block_size)
            free_before = set(pool._free) | set(pool._evictable)
            if pool.allocate(r, n, hits):
                assert r.block_ids[:len(hits)] == hits
                for k, b in enumerate(r.block_ids):
                    if k >= len(hits):
                        assert b in free_before
                        content[b] = None  # a reused block's old content is gone
                    else:
                        assert content[b] == r.block_hashes[k]
                r.num_computed_tokens = len(hits) * block_size
            else:
                assert r.block_ids == []
        elif op == "compute" and r.block_ids:
            before = r.num_computed_tokens
            r.num_computed_tokens = min(r.prompt_len, before + n)
            for k in range(before // block_size, r.num_computed_tokens // block_size):
                if k < len(r.block_hashes):
                    content[r.block_ids[k]] = r.block_hashes[k]
            pool.register(r)
        elif op == "add_one" and r.block_ids and pool.num_free_blocks:
            pool.add_one_block([r])
            content[r.block_ids[-1]] = None
        elif op == "free":
            pool.free(r)
            r.num_computed_tokens = 0
        _check_pool(pool, reqs, content)


def _check_pool(pool: BlockPool, reqs: list[Request], content: dict[int, int | None]) -> None:
    held = [b for q in reqs for b in q.block_ids]
    distinct = set(held)
    for b in distinct:
        holders = sum(b in q.block_ids for q in reqs)
        assert holders == 1 or pool._refs.get(b) == holders, "a shared block is not counted per holder"
    assert len(distinct) + pool.num_free_blocks == pool.num_blocks
    assert pool.used_tokens == len(distinct) * pool.block_size <= pool.capacity_tokens
    for h, b in pool._cached.items():
        assert pool._hash_of[b] == h and content[b] == h
    for q in reqs:  # what a request has computed is what its hashes say
        for k in range(min(q.num_computed_tokens // pool.block_size, len(q.block_hashes or []))):
            if q.block_ids and content.get(q.block_ids[k]) is not None:
                assert content[q.block_ids[k]] == q.block_hashes[k]


def test_a_freed_prefix_is_reused_until_its_blocks_are_needed():
    pool = BlockPool(64, 16, prefix_caching=True)  # 4 blocks
    a = Request("a", 0, 48, 1)
    a.block_hashes = [1, 2, 3]
    assert pool.allocate(a, 48, [])
    a.num_computed_tokens = 48
    pool.register(a)
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    b = Request("b", 0, 40, 1)
    b.block_hashes = [1, 2]
    hits = pool.cached_prefix(b.block_hashes, (40 - 1) // 16)
    assert len(hits) == 2
    assert pool.allocate(b, 40, hits) and b.block_ids[:2] == hits
    # b's third block came from the never-used one; the cached block 3 is the only one left to take
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 3
    c = Request("c", 0, 16, 1)
    assert pool.grow(c, 16) and pool.num_cached_blocks == 2 and pool.num_free_blocks == 0
    assert not pool.grow(Request("d", 0, 1, 1), 1)


# ---------------------------------------------------------------------------------------- simulation
def _mooncake(tmp_path, n: int = 120, system_runs: int = 2, seed: int = 0) -> str:
    """A Mooncake-format trace: conversations behind a shared system prompt, later turns resending
    their history."""
    rng = random.Random(seed)
    lines, next_id, t = [], 100, 0
    for _ in range(n // 3):
        history = list(range(system_runs))
        for _turn in range(3):
            new = rng.randint(1, 2)
            ids = history + list(range(next_id, next_id + new))
            next_id += new
            lines.append({"timestamp": t, "input_length": 512 * len(ids) - rng.randint(0, 100),
                          "output_length": rng.randint(20, 200), "hash_ids": ids})
            history = ids[:-1] + [next_id]
            next_id += 1
            t += rng.randint(50, 400)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_mooncake_hash_ids_become_prefix_ids(tmp_path):
    arrivals = read_trace(_mooncake(tmp_path, n=6), length_scale=0.125)
    assert arrivals[0].prefix_ids[:2] == (0, 1) and arrivals[0].prefix_block_tokens == 64.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": "x"}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:1: hash_ids is 'x', expected a list of integers"):
        read_trace(bad)


def test_simulator_prefills_only_what_the_cache_lacks(tmp_path):
    profile = load_profile("a100-llama2-7b")
    arrivals = read_trace(_mooncake(tmp_path), length_scale=0.25)
    runs = {}
    for caching in (True, False):
        controller = build_controller("greedy", profile, arrivals)
        result = simulate(arrivals, profile, controller, prefix_caching=caching)
        s = result.summary
        assert s["completed"] == len(arrivals) and s["evictions"] == 0
        ends = [r for r in result.core.metrics.terminal]
        assert len(ends) == len(arrivals) and all(r.state is RequestState.FINISHED for r in ends)
        assert result.core.pool.num_free_blocks == result.core.pool.num_blocks
        runs[caching] = s
    on, off = runs[True], runs[False]
    assert off["cached_prompt_tokens"] == 0 and on["cached_prompt_tokens"] > 0
    # without evictions each prompt token is either computed or found in the cache
    assert on["prefill_tokens"] + on["cached_prompt_tokens"] == off["prefill_tokens"]
    assert on["prefill_tokens"] < 0.7 * off["prefill_tokens"]
    assert on["ttft_p50_s"] < off["ttft_p50_s"]


def test_simulator_with_evictions_ends_every_request_once_and_frees_every_block(tmp_path):
    profile = dataclasses.replace(load_profile("a100-llama2-7b"), kv_capacity_tokens=6000)
    arrivals = read_trace(_mooncake(tmp_path, n=90), length_scale=0.25, rate_scale=20.0)
    result = simulate(arrivals, profile, build_controller("greedy", profile, arrivals))
    s = result.summary
    assert s["evictions"] > 0 and s["cached_prompt_tokens"] > 0
    ended = result.core.metrics.terminal
    assert len(ended) == len({id(r) for r in ended}) == len(arrivals)
    assert result.core.pool.num_free_blocks == result.core.pool.num_blocks
    assert result.core.pool.used_tokens == 0


def test_synthetic_shared_prefixes_and_conversations():
    spec = {"arrival": {"process": "poisson"}, "duration_s": 50, "seed": 3,
            "classes": [{"rate_rps": 1.0, "prompt_tokens": 40, "output_tokens": 10, "shared_prefix_tokens": 100},
                        {"rate_rps": 0.2, "prompt_tokens": {"dist": "uniform", "low": 5, "high": 60},
                         "output_tokens": 30, "turns": 4, "think_time_s": 2.0}]}
    arrivals = load_synthetic(spec)
    system = [a for a in arrivals if a.class_id == 0]
    assert all(a.prompt_tokens == 140 and a.prefix_ids[:6] == system[0].prefix_ids[:6] for a in system)
    assert len({a.prefix_ids[6] for a in system}) == len(system)  # the rest is each request's own
    chats = [a for a in arrivals if a.class_id == 1]
    # a later turn's prompt starts with every full run of the turn before
    by_start: dict[int, list] = {}
    for a in chats:
        by_start.setdefault(a.prefix_ids[0], []).append(a)
    for turns in by_start.values():
        turns.sort(key=lambda a: a.prompt_tokens)
        for before, after in zip(turns, turns[1:]):
            full = before.prompt_tokens // 16
            assert after.prefix_ids[:full] == before.prefix_ids[:full]
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
    with pytest.raises(WorkloadError, match="think_time_s only with turns"):
        load_synthetic({"duration_s": 1, "classes": [{"rate_rps": 1, "prompt_tokens": 1, "output_tokens": 1,
                                                      "think_time_s": 1}]})


def test_workloads_without_prefixes_sample_as_before():
    spec = {"duration_s": 30, "classes": [{"rate_rps": 2, "prompt_tokens": {"dist": "geometric", "mean": 50},
                                           "output_tokens": 20}, {"rate_rps": 1, "prompt_tokens": 7,
                                                                  "output_tokens": 3}]}
    arrivals = load_synthetic(spec, seed=1)
    assert all(a.prefix is None for a in arrivals)
    assert [a.arrival_time_s for a in arrivals] == sorted(a.arrival_time_s for a in arrivals)


# ---------------------------------------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0, dtype=torch.float32, device="cpu")


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int, sampling=None) -> list[Request]:
    reqs = []
    for p in prompts:  # one after another, so later ones find the earlier ones' blocks
        r = llm.core
        req = Request(str(len(reqs)), r.clock.now(), len(p), max_tokens, prompt_token_ids=p,
                      sampling=sampling or SamplingParams(ignore_eos=True),
                      skip_reading_prefix_cache=sampling is not None and sampling.prompt_logprobs is not None)
        r.add_request(req)
        while r.has_unfinished:
            r.step()
        reqs.append(req)
    return reqs


def test_real_engine_gives_the_same_tokens_with_and_without_the_cache(tiny):
    rng = random.Random(4)
    system = [1] + [rng.randint(3, 258) for _ in range(70)]
    prompts = [system + [rng.randint(3, 258) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    prompts.append(list(prompts[2]))  # a prompt sent twice
    outs = {}
    for caching in (True, False):
        llm = LLM(kv_capacity_tokens=2048, model_and_tokenizer=tiny, device="cpu", prefix_caching=caching)
        reqs = _run(llm, prompts, 12)
        outs[caching] = [r.output_token_ids for r in reqs]
        cached = [r.num_cached_tokens for r in reqs]
        if caching:
            assert cached[0] == 0 and all(c == 64 for c in cached[1:5])  # 71 shared tokens: 4 full blocks
            assert cached[5] == 16 * ((len(prompts[5]) - 1) // 16)
            assert llm.core.metrics.prefill_tokens < sum(map(len, prompts))
        else:
            assert cached == [0] * 6
    assert outs[True] == outs[False]


def test_prompt_logprobs_compute_the_whole_prompt_and_still_fill_the_cache(tiny):
    llm = LLM(kv_capacity_tokens=2048, model_and_tokenizer=tiny, device="cpu")
    prompt = [1] + list(range(3, 60))
    first = _run(llm, [prompt], 2, SamplingParams(ignore_eos=True, prompt_logprobs=0))[0]
    again = _run(llm, [prompt], 2, SamplingParams(ignore_eos=True, prompt_logprobs=0))[0]
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    assert len(again.prompt_logprobs) == len(prompt) and again.prompt_logprobs == first.prompt_logprobs
    plain = _run(llm, [prompt], 2)[0]
    assert plain.num_cached_tokens == 48 and plain.output_token_ids == first.output_token_ids


# ---------------------------------------------------------------------------------------- the twin
def test_real_prompts_share_tokens_exactly_where_content_ids_do():
    from tidegate.engine.twin.replay import random_prompts
    from tidegate.engine.workloads import Arrival

    arrivals = [Arrival(0.0, 50, 1, 1, prefix_ids=(7, 8, 9), prefix_block_tokens=16.0),
                Arrival(0.0, 40, 1, 1, prefix_ids=(7, 8, 5), prefix_block_tokens=16.0),
                Arrival(0.0, 40, 1, 1)]
    a, b, c = random_prompts(arrivals, 300, seed=1)
    assert [len(a), len(b), len(c)] == [50, 40, 40]
    assert a[:32] == b[:32] and a[32:40] != b[32:40] and a[:32] != c[:32]
    assert random_prompts(arrivals, 300, seed=1)[0] == a and random_prompts(arrivals, 300, seed=2)[0] != a


@pytest.mark.slow
def test_twin_check_of_a_shared_prefix_workload_finds_the_cache_in_both_engines(tmp_path):
    from tidegate.engine.twin.check import run_twin_check

    report = run_twin_check(model="tiny", trace="shared_prefix_chat", first_n=24, length_scale=1.0,
                            rate_scale=4.0, max_tokens=8, profile_name="tiny-cpu", device="cpu", out_dir=tmp_path,
                            noise_seeds=1)
    real, sim = report["real_summary"], report["sim_summary"]
    assert report["prefix_caching"] and real["completed"] == sim["completed"] == 24
    assert real["cached_prompt_tokens"] > 0 and sim["cached_prompt_tokens"] > 0
    # the same requests find much the same prefixes cached (when each starts can differ a little)
    assert abs(real["cached_prompt_tokens"] - sim["cached_prompt_tokens"]) <= 0.2 * sim["cached_prompt_tokens"]


def test_admission_and_the_queue_count_only_what_the_cache_lacks():
    from tidegate.ctrl.greedy import GreedyController
    from tidegate.engine.sim.simulate import make_request, make_sim_engine
    from tidegate.engine.workloads import Arrival

    told = []

    class Recording(GreedyController):
        def admit(self, obs, prompt_tokens, max_tokens):
            told.append(prompt_tokens)
            return super().admit(obs, prompt_tokens, max_tokens)

    profile = load_profile("tiny-cpu")
    core = make_sim_engine(profile, Recording())
    system = tuple(range(8))  # 128 shared tokens
    first = Arrival(0.0, 200, 4, 4, prefix_ids=system + (100, 101, 102, 103, 104), prefix_block_tokens=16.0)
    core.add_request(make_request(0, first))
    while core.has_unfinished:
        core.step()
    second = Arrival(core.clock.now(), 160, 4, 4, prefix_ids=system + (200, 201), prefix_block_tokens=16.0)
    core.add_request(make_request(1, second))
    assert told == [200, 160 - 128]
    assert core.scheduler.waiting_prompt_tokens == 32 and core.observe().waiting_prompt_tokens == 32
    while core.has_unfinished:
        core.step()
    ends = core.metrics.terminal
    assert [r.num_cached_tokens for r in ends] == [0, 128]
    assert core.metrics.prefill_tokens == 200 + 32 and core.metrics.cached_prompt_tokens == 128


def test_profiling_slices_of_a_synthetic_workload_are_its_later_requests():
    from tidegate.engine.twin.fit import serving_arrivals
    from tidegate.engine.workloads import load_workload

    whole = load_workload("shared_prefix_chat", seed=3, max_tokens_cap=64)
    part = serving_arrivals("shared_prefix_chat", skip=10, first_n=5, length_scale=1.0, max_tokens=64, seed=3)
    assert len(part) == 5 and part[0].arrival_time_s == 0.0
    assert [a.prefix_ids for a in part] == [a.prefix_ids for a in whole[10:15]]


def test_a_finished_answer_is_cached_for_the_turn_that_resends_it(tiny):
    llm = LLM(kv_capacity_tokens=2048, model_and_tokenizer=tiny, device="cpu")
    prompt = [1] + list(range(3, 40))  # 38 tokens: two full blocks
    first = _run(llm, [prompt], 30)[0]
    computed = len(prompt) + 30 - 1  # the last token sampled has no KV
    follow_up = prompt + first.output_token_ids + [7, 8, 9]
    second = _run(llm, [follow_up], 4)[0]
    assert second.num_cached_tokens == 16 * (computed // 16) > 16 * (len(prompt) // 16)
    plain = LLM(kv_capacity_tokens=2048, model_and_tokenizer=tiny, device="cpu", prefix_caching=False)
    assert _run(plain, [follow_up], 4)[0].output_token_ids == second.output_token_ids
