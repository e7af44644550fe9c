"""Steady decodes counted in aggregate schedule exactly as listing every decode does.

The simulator's executor reads only a batch's counts, so the engine counts a request that has
started to decode in aggregate (``SteadyDecodes.join``). The same run with an executor that
asks for every request listed (as the real engine's does) must agree at every step: clock, KV
blocks (block tables included), every request's counts and ending, and the observation; and at
the end on the metrics' summary and step records (both record modes).
"""

from __future__ import annotations

import random

from hypothesis import event, example, given
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import Controller, Decision
from tidegate.engine.core.request import RequestState
from tidegate.engine.sim.executor import SimExecutor
from tests.helpers import make_engine, req, step_profile

SPECS = ["greedy", "no-evict", "sglang", "watermark", "flow", "slo-flow", "class-budgets:budgets=2/3", "budgets"]

# (arrival step, prompt tokens, output tokens, max_tokens - output tokens, class)
workloads = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40), st.integers(1, 60), st.integers(0, 4),
                               st.integers(0, 1)), min_size=1, max_size=30)


class Listed(SimExecutor):
    """The simulator's step time, every scheduled request listed in the batch."""

    reads_requests = True


class Failing(SimExecutor):
    """The simulator's executor, raising at chosen calls (one call per step)."""

    def __init__(self, profile, fail_at: frozenset[int]) -> None:
        super().__init__(profile)
        self.fail_at = fail_at
        self.calls = 0

    def execute(self, batch):
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError("device lost")
        return super().execute(batch)


class ListedFailing(Failing):
    reads_requests = True


class Budgets(Controller):
    """Greedy activation with a token budget that moves every step, so decodes rotate at times."""

    def __init__(self, budgets: list[int]) -> None:
        super().__init__()
        self.budgets = budgets

    def decide(self, obs):
        return Decision(token_budget=self.budgets[obs.step_index % len(self.budgets)])


def _controller(spec: str, profile, seed: int) -> Controller:
    if spec.startswith("budgets"):  # "budgets:5/3" cycles 5, 3; plain "budgets" draws them from the seed
        rng = random.Random(seed)
        given = spec.partition(":")[2]
        return Budgets([int(b) for b in given.split("/")] if given
                       else [rng.choice([2, 3, 5, 64]) for _ in range(rng.randint(2, 4))])
    return build_controller(spec, profile)


def _run(spec, workload, capacity, eviction, listed, cancels, fail_at, seed, sync, record=True, shared=False):
    """Drive one engine; the state after every step, and the requests and the metrics at the end. With
    ``shared``, the prompts of a class share their first 12 tokens, and a request's next 8 those of the
    request with the same class and index parity (content ids of 4 tokens each)."""
    profile = step_profile(kv_capacity_tokens=capacity, noise_sigma=0.3, per_token_s=0.05, per_kv_token_s=0.01,
                           per_prefill_s=0.2, per_prefill_pair_s=0.001, per_first_decode_s=0.5,
                           per_prefill_alone_s=0.3)
    core = make_engine(_controller(spec, profile, seed), capacity, eviction=eviction, record_steps=record)
    executor = (ListedFailing if listed else Failing)(profile, fail_at)
    executor.noise = SimExecutor(profile, seed).noise
    core.executor = executor
    pending = sorted(enumerate(workload), key=lambda x: x[1][0])
    requests, states = [], []
    for step in range(2000):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, out, slack, cls) = pending.pop(0)
            r = req(i, prompt, out, out + slack, arrival=core.clock.now(), class_id=cls)
            if shared:
                r.prefix = ((cls, cls + 10, cls + 20, 100 + 2 * cls + i % 2, 200 + 2 * cls + i % 2)
                            + tuple(range(1000 * (i + 1), 1000 * (i + 1) + 10)), 4.0)
            requests.append(r)
            core.add_request(r)
        for k in cancels.get(step, ()):
            if k < len(requests):
                core.cancel(requests[k])
        if not core.has_unfinished and not pending:
            break
        ended = core.step(sync=sync)
        counts = [(r.num_output_tokens, r.num_computed_tokens) for r in requests] if sync else None
        states.append((core.clock.now(), core.pool.num_free_blocks, [list(r.block_ids) for r in requests],
                       [(r.request_id, r.state, r.finish_reason, r.num_output_tokens) for r in ended],
                       core.obs.as_dict(), len(core.running), len(core.waiting), counts))
    core.sync()
    final = [(r.state, r.finish_reason, r.num_output_tokens, r.num_computed_tokens, r.num_evictions,
              r.wasted_tokens, r.first_token_time_s, r.finish_time_s, r.activation_seq) for r in requests]
    metrics = core.metrics
    final.append(sorted((k, repr(v)) for k, v in metrics.summary(capacity, 20.0, 2.0).items()))
    final.append([list(getattr(metrics, k)) for k in ("step_time_s", "step_duration_s", "step_kv_tokens",
                                                      "step_waiting", "step_running", "step_tokens")])
    return states, final, core


@given(spec=st.sampled_from(SPECS), workload=workloads, capacity=st.sampled_from([32, 48, 64, 128, 512]),
       eviction=st.sampled_from(["recompute", "reset"]), sync=st.booleans(),
       cancels=st.dictionaries(st.integers(0, 80), st.lists(st.integers(0, 29), max_size=2), max_size=4),
       fail_at=st.frozensets(st.integers(1, 120), max_size=2), seed=st.integers(0, 3), record=st.booleans())
@example(spec="budgets:5/3", workload=[(6, 14, 6, 0, 0), (2, 17, 35, 0, 0), (3, 10, 34, 0, 0), (2, 19, 17, 0, 0),
                                   (4, 5, 22, 0, 0)],
         capacity=32, eviction="recompute", sync=True, cancels={}, fail_at=frozenset(), seed=0, record=True)
# (a recomputed request whose prefill ends one token short of its sequence decodes that token:
# it joins the steady decodes holding the block its next token would otherwise start)
def test_steady_decodes_schedule_exactly_as_listed_ones(spec, workload, capacity, eviction, sync, cancels,
                                                        fail_at, seed, record):
    steady, steady_final, core = _run(spec, workload, capacity, eviction, False, cancels, fail_at, seed, sync, record)
    listed, listed_final, _ = _run(spec, workload, capacity, eviction, True, cancels, fail_at, seed, sync, record)
    event(f"evictions: {core.metrics.evictions > 0}")
    assert len(steady) == len(listed)
    for i, (a, b) in enumerate(zip(steady, listed)):
        assert a == b, f"step {i} differs"
    assert steady_final == listed_final
    assert all(state.is_terminal for state, *_ in steady_final[:-2])
    # the step records, kept only when asked for (none when every request was refused on arrival)
    assert bool(steady_final[-1][0]) == (record and core.metrics.steps > 0)
    assert core.pool.num_free_blocks == core.pool.num_blocks
    assert core.scheduler.steady.count == 0 and core.scheduler.steady.base == 0


def test_steady_decodes_are_counted_not_listed():
    """Once decoding, a simulated request leaves the batch's list; its counts catch up on ``sync``."""
    seen = []

    class Spy(SimExecutor):
        def execute(self, batch):
            seen.append((len(batch.requests), batch.num_decodes, batch.num_tokens))
            return super().execute(batch)

    profile = step_profile()
    core = make_engine(build_controller("greedy", profile))
    core.executor = Spy(profile)
    r = req("a", 5, 10)
    core.add_request(r)
    core.step(sync=False)  # the prefill: listed, samples the first token
    core.step(sync=False)
    core.step(sync=False)
    assert seen == [(1, 0, 5), (0, 1, 1), (0, 1, 1)]
    assert r.num_output_tokens == 1, "the counts lag without sync"
    core.sync()
    assert (r.num_output_tokens, r.num_computed_tokens) == (3, 7)
    while core.has_unfinished:
        core.step()
    assert r.state is RequestState.FINISHED and r.num_output_tokens == 10


def test_blocks_of_steady_requests_grow_when_their_token_starts_one():
    """Block size 4, prompt 3: the 2nd, 6th and 10th output tokens start blocks 2, 3 and 4."""
    profile = step_profile()
    core = make_engine(build_controller("greedy", profile))
    r = req("a", 3, 12)
    core.add_request(r)
    held = []
    while core.has_unfinished:
        core.step(sync=False)
        held.append(len(r.block_ids))
    # before step k+1 the request holds blocks for its k tokens committed so far (plus the prompt)
    assert held[:11] == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert held[-1] == 0  # freed at the end


def _lines_per_decode_step(running: int) -> float:
    """Python lines a step executes, on average, while ``running`` requests decode together
    (counted, not timed; the simulator, on the A100 preset)."""
    import sys

    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.sim.simulate import make_sim_engine

    profile = load_profile("a100-llama2-7b")
    core = make_sim_engine(profile, build_controller("greedy", profile), record_steps=False)
    for i in range(running):
        core.add_request(req(i, 100, 400))
    for _ in range(20):  # the prefills, and every request decoding
        core.step(sync=False)
    lines = [0]

    def trace(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return trace

    steps = 160  # ten blocks' worth of decodes for each request
    sys.settrace(trace)
    try:
        for _ in range(steps):
            core.step(sync=False)
    finally:
        sys.settrace(None)
    assert len(core.running) == running and core.scheduler.steady.count == running
    return lines[0] / steps


def test_a_decode_step_does_not_walk_the_running_requests():
    """16 x more requests decoding: a step still does about the same work (one block per request
    every block_size steps is all that grows with them)."""
    few, many = _lines_per_decode_step(8), _lines_per_decode_step(128)
    assert many < 1.5 * few, (few, many)


crowded = st.lists(st.tuples(st.integers(0, 8), st.integers(3, 24), st.integers(12, 40), st.integers(0, 2),
                             st.just(0)), min_size=3, max_size=8)


@given(workload=crowded, budgets=st.lists(st.sampled_from([3, 5, 7, 64]), min_size=2, max_size=4),
       capacity=st.sampled_from([32, 48]), seed=st.integers(0, 3))
def test_steady_decodes_schedule_exactly_under_evictions_and_chunked_recompute(workload, budgets, capacity, seed):
    # (the test below runs these workloads again with shared prefixes)
    """Crowded memory and small, moving token budgets: evictions, recomputes whose prefill is
    chunked, and decodes that rotate, all the time."""
    spec = "budgets:" + "/".join(map(str, budgets))
    steady, steady_final, core = _run(spec, workload, capacity, "recompute", False, {}, frozenset(), seed, True)
    listed, listed_final, _ = _run(spec, workload, capacity, "recompute", True, {}, frozenset(), seed, True)
    event(f"evictions: {core.metrics.evictions > 0}")
    assert steady == listed and steady_final == listed_final


def test_a_requests_first_decode_is_counted_once_listed_or_steady():
    """Each request's decode right after its prefill is a first decode, whichever way it is counted."""
    seen = {}

    class Spy(SimExecutor):
        def execute(self, batch):
            seen.setdefault(type(self).__name__, []).append(batch.first_decodes)
            return super().execute(batch)

    class ListedSpy(Spy):
        reads_requests = True

    profile = step_profile()
    for executor in (Spy, ListedSpy):
        core = make_engine(build_controller("greedy", profile))
        core.executor = executor(profile)
        for i, arrival in enumerate((0.0, 0.0, 2.0)):
            core.add_request(req(i, 5, 6, arrival=arrival))
            if i == 1:  # two prefill together, one first decode each next step
                core.step()
                core.step()
        while core.has_unfinished:
            core.step()
    assert seen["Spy"] == seen["ListedSpy"]
    assert sum(seen["Spy"]) == 3 and seen["Spy"][:2] == [0, 2]


@given(spec=st.sampled_from(SPECS), workload=workloads, capacity=st.sampled_from([32, 48, 128]),
       eviction=st.sampled_from(["recompute", "reset"]),
       cancels=st.dictionaries(st.integers(0, 80), st.lists(st.integers(0, 29), max_size=2), max_size=3),
       seed=st.integers(0, 3))
def test_steady_decodes_schedule_exactly_with_shared_prefixes(spec, workload, capacity, eviction, cancels, seed):
    """Prompts that share prefixes, so that requests start with cached blocks that others hold or that
    wait to be reused: the steady decodes still schedule exactly as listed ones, and every block comes
    back."""
    steady, steady_final, core = _run(spec, workload, capacity, eviction, False, cancels, frozenset(), seed, True,
                                      shared=True)
    listed, listed_final, _ = _run(spec, workload, capacity, eviction, True, cancels, frozenset(), seed, True,
                                   shared=True)
    event(f"cached tokens: {core.metrics.cached_prompt_tokens > 0}")
    assert steady == listed and steady_final == listed_final
    assert all(state.is_terminal for state, *_ in steady_final[:-2])
    assert core.pool.num_free_blocks == core.pool.num_blocks and core.pool.used_tokens == 0
