"""Trace readers, options, synthetic workloads and their errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.engine.workloads import (
    DEFAULT_MAX_TOKENS,
    Arrival,
    WorkloadError,
    load_synthetic,
    load_workload,
    read_trace,
    resolve_trace,
    trace_stats,
)

VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens"
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURSTGPT = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def write(tmp_path, name, *lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def triples(arrivals):
    return [(a.arrival_time_s, a.prompt_tokens, a.output_tokens) for a in arrivals]


# --- formats ---------------------------------------------------------------------------------

def test_vidur_csv(tmp_path):
    path = write(tmp_path, "t.csv", VIDUR, "0.0,10,5", "1.5,20,7")
    arrivals = read_trace(path)
    assert triples(arrivals) == [(0.0, 10, 5), (1.5, 20, 7)]
    assert all(a.max_tokens == DEFAULT_MAX_TOKENS and a.class_id == 0 for a in arrivals)


def test_azure_csv_relative_to_first_row(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE,
                 "2023-11-16 18:15:46.6805900,100,10",
                 "2023-11-16 18:15:48.1805900,200,20",
                 "2023-11-16 18:16:46.6805901,300,30")
    arrivals = read_trace(path)
    assert [a.prompt_tokens for a in arrivals] == [100, 200, 300]
    assert [a.arrival_time_s for a in arrivals] == pytest.approx([0.0, 1.5, 60.0], abs=1e-6)


def test_mooncake_jsonl(tmp_path):
    records = [{"timestamp": 1000, "input_length": 50, "output_length": 4, "hash_ids": [1, 2]},
               {"timestamp": 3500, "input_length": 60, "output_length": 8, "hash_ids": []}]
    path = write(tmp_path, "trace.jsonl", *(json.dumps(r) for r in records))
    assert triples(read_trace(path)) == [(0.0, 50, 4), (2.5, 60, 8)]


def test_burstgpt_skips_failed_requests(tmp_path):
    path = write(tmp_path, "burst.csv", BURSTGPT,
                 "5,ChatGPT,100,20,120,Conversation log",
                 "6,ChatGPT,80,0,80,Conversation log",
                 "9,GPT-4,30,3,33,API log")
    assert triples(read_trace(path)) == [(0.0, 100, 20), (4.0, 30, 3)]


def test_format_comes_from_the_header_not_the_extension(tmp_path):
    path = write(tmp_path, "trace.txt", VIDUR, "0,1,1")
    assert len(read_trace(path)) == 1


def test_unsorted_rows_come_out_sorted_stably(tmp_path):
    path = write(tmp_path, "t.csv", VIDUR, "2,1,1", "1,2,1", "1,3,1", "0,4,1")
    assert [a.prompt_tokens for a in read_trace(path)] == [4, 2, 3, 1]


# --- malformed traces ------------------------------------------------------------------------

@pytest.mark.parametrize("lines, line_no, words", [
    ((VIDUR, "0,10,5", "1,abc,5"), 3, "num_prefill_tokens"),
    ((VIDUR, "0,10,5", "1,10"), 3, "num_decode_tokens"),
    ((VIDUR, "0,10,5", "", "1,10,0"), 4, "num_decode_tokens"),
    ((VIDUR, "-1,10,5"), 2, "arrived_at"),
    ((AZURE, "2023-11-16 18:15:46.6805900,1,1", "yesterday,1,1"), 3, "TIMESTAMP"),
    ((BURSTGPT, "1,m,0,5,5,x"), 2, "Request tokens"),
    (("id,prompt,output", "0,1,1"), 1, "unknown header"),
])
def test_malformed_csv_names_file_and_line(tmp_path, lines, line_no, words):
    path = write(tmp_path, "bad.csv", *lines)
    with pytest.raises(WorkloadError) as err:
        read_trace(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line_no}: ")
    assert words in message and "\n" not in message


def test_unknown_header_lists_the_accepted_ones(tmp_path):
    path = write(tmp_path, "bad.csv", "a,b,c", "1,2,3")
    message = str(pytest.raises(WorkloadError, read_trace, path).value)
    for header in (VIDUR, AZURE, BURSTGPT, "input_length"):
        assert header in message


@pytest.mark.parametrize("line, words", [
    ('{"timestamp": 0, "input_length": 5', "bad JSON"),
    ('{"timestamp": 0, "input_length": 5}', "output_length"),
    ('{"timestamp": -3, "input_length": 5, "output_length": 1}', "timestamp"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
    ('[1, 2, 3]', "JSON object"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, words):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1}'
    path = write(tmp_path, "bad.jsonl", good, good, line)
    message = str(pytest.raises(WorkloadError, read_trace, path).value)
    assert message.startswith(f"{path}:3: ") and words in message


@pytest.mark.parametrize("lines", [(), ("",), (VIDUR,), (BURSTGPT, "1,m,5,0,5,x")])
def test_empty_trace(tmp_path, lines):
    path = write(tmp_path, "empty.csv", *lines)
    message = str(pytest.raises(WorkloadError, read_trace, path).value)
    assert message.startswith(f"{path}: ")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.csv"
    assert str(pytest.raises(WorkloadError, read_trace, path).value) == f"{path}: no such file"


def test_integral_float_counts_are_accepted(tmp_path):
    path = write(tmp_path, "t.csv", VIDUR, "0,10.0,5")
    assert triples(read_trace(path)) == [(0.0, 10, 5)]


# --- options ---------------------------------------------------------------------------------

@pytest.fixture
def five(tmp_path):
    return write(tmp_path, "five.csv", VIDUR, "10,100,50", "12,200,60", "16,300,70",
                 "20,400,80", "30,500,3000")


def test_rate_scale_divides_gaps(five):
    times = [a.arrival_time_s for a in read_trace(five, rate_scale=2.0)]
    assert times == pytest.approx([0, 1, 3, 5, 10])


def test_first_n(five):
    assert [a.prompt_tokens for a in read_trace(five, first_n=2)] == [100, 200]


def test_window_on_trace_time_then_rebased(five):
    arrivals = read_trace(five, start_s=12, end_s=20, rate_scale=2.0)
    assert [a.prompt_tokens for a in arrivals] == [200, 300]
    assert [a.arrival_time_s for a in arrivals] == pytest.approx([0, 2])


def test_empty_window(five):
    with pytest.raises(WorkloadError, match="no requests between"):
        read_trace(five, start_s=100)


def test_length_scale_rounds_and_keeps_one(tmp_path):
    path = write(tmp_path, "t.csv", VIDUR, "0,100,3", "1,7,1")
    arrivals = read_trace(path, length_scale=0.1)
    assert [(a.prompt_tokens, a.output_tokens) for a in arrivals] == [(10, 1), (1, 1)]


def test_max_tokens_cap_cuts_outputs(five):
    arrivals = read_trace(five, max_tokens_cap=65)
    assert [a.output_tokens for a in arrivals] == [50, 60, 65, 65, 65]
    assert {a.max_tokens for a in arrivals} == {65}
    assert read_trace(five)[-1].output_tokens == 2048


@pytest.mark.parametrize("options, name", [
    ({"rate_scale": 0}, "rate_scale"), ({"rate_scale": -1}, "rate_scale"),
    ({"length_scale": 0}, "length_scale"), ({"max_tokens_cap": 0}, "max_tokens_cap"),
    ({"first_n": 0}, "first_n"), ({"start_s": 5, "end_s": 5}, "end_s"),
])
def test_bad_options(five, options, name):
    with pytest.raises(WorkloadError, match=name):
        read_trace(five, **options)


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.integers(1, 10**5),
                               st.integers(1, 10**5)), min_size=1, max_size=30),
       cap=st.none() | st.integers(1, 5000),
       length_scale=st.floats(0.01, 3.0))
def test_any_valid_csv_reads_sorted_and_capped(tmp_path_factory, rows, cap, length_scale):
    path = tmp_path_factory.mktemp("prop") / "t.csv"
    path.write_text(VIDUR + "\n" + "".join(f"{t!r},{p},{o}\n" for t, p, o in rows))
    arrivals = read_trace(path, max_tokens_cap=cap, length_scale=length_scale)
    assert len(arrivals) == len(rows)
    times = [a.arrival_time_s for a in arrivals]
    assert times == sorted(times) and times[0] == 0
    assert all(1 <= a.output_tokens <= a.max_tokens and a.prompt_tokens >= 1 for a in arrivals)


# --- shipped workloads -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["splitwise_conv", "splitwise_conv.csv", "splitwise_code",
                                  "paper_sec41", "paper_sec41.yaml"])
def test_resolve_shipped_names(name):
    path = resolve_trace(name)
    assert path.is_file() and path.parent.name == "data"


def test_resolve_existing_path_and_unknown_name(five):
    assert resolve_trace(five) == five
    message = str(pytest.raises(WorkloadError, resolve_trace, "sharegpt").value)
    assert "sharegpt" in message and "splitwise_conv" in message and "splitwise_code" in message


@pytest.mark.parametrize("name, requests", [("splitwise_conv", 19_366), ("splitwise_code", 8_819)])
def test_shipped_traces_load_whole(name, requests):
    # loading speed is a measurement (benchmarks/), not a test: a timed assertion fails on a busy machine
    arrivals = load_workload(name)
    assert len(arrivals) == requests
    stats = trace_stats(arrivals)
    assert stats["requests"] == requests and stats["span_s"] > 3000


def test_trace_stats_lifetime_kv():
    arrivals = [Arrival(0.0, 10, 2, 8), Arrival(2.0, 20, 4, 8)]
    stats = trace_stats(arrivals)
    assert stats["mean_rate_rps"] == 1.0
    assert stats["mean_tokens_per_request"] == 15 + 3
    # E[P*D] = (20 + 80)/2, E[D(D+1)]/2 = (6 + 20)/4
    assert stats["lifetime_kv_workload"] == pytest.approx(50 + 6.5)
    assert stats["prompt_tokens_max"] == 20 and stats["output_tokens_max"] == 4


def test_shipped_paper_workload():
    arrivals = load_workload("paper_sec41", duration_s=2000)
    counts = np.bincount([a.class_id for a in arrivals])
    assert counts[0] == pytest.approx(0.8 * 2000, rel=0.1)
    assert counts[1] == pytest.approx(0.1 * 2000, rel=0.25)
    assert {(a.prompt_tokens, a.output_tokens) for a in arrivals} == {(20, 20), (60, 100)}


# --- synthetic -------------------------------------------------------------------------------

def two_classes(**arrival):
    return {
        "arrival": arrival or {"process": "poisson"},
        "duration_s": 5000,
        "classes": [
            {"name": "short", "rate_rps": 2.0, "prompt_tokens": 20,
             "output_tokens": {"dist": "uniform", "low": 10, "high": 30}},
            {"name": "long", "rate_rps": 0.5, "prompt_tokens": {"dist": "lognormal", "mean": 100,
                                                                "sigma": 0.5},
             "output_tokens": {"dist": "geometric", "mean": 100}, "max_tokens": 150},
        ],
    }


def test_synthetic_rates_lengths_and_classes():
    arrivals = load_synthetic(two_classes(), seed=1)
    times = [a.arrival_time_s for a in arrivals]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 5000
    short = [a for a in arrivals if a.class_id == 0]
    long = [a for a in arrivals if a.class_id == 1]
    # counts are Poisson: 10,000 +- 100 and 2,500 +- 50
    assert len(short) == pytest.approx(10_000, abs=500)
    assert len(long) == pytest.approx(2_500, abs=250)
    assert {a.prompt_tokens for a in short} == {20}
    assert min(a.output_tokens for a in short) == 10 and max(a.output_tokens for a in short) == 30
    assert np.mean([a.prompt_tokens for a in long]) == pytest.approx(100, rel=0.05)
    assert max(a.output_tokens for a in long) == 150 and {a.max_tokens for a in long} == {150}
    assert {a.max_tokens for a in short} == {DEFAULT_MAX_TOKENS}


def test_synthetic_seeds_reproduce():
    assert load_synthetic(two_classes(), seed=3) == load_synthetic(two_classes(), seed=3)
    assert load_synthetic(two_classes(), seed=3) != load_synthetic(two_classes(), seed=4)


def test_file_seed_is_used_unless_an_argument_is_given():
    spec = {**two_classes(), "seed": 7}
    assert load_synthetic(spec) == load_synthetic(two_classes(), seed=7)
    assert load_synthetic(spec, seed=8) == load_synthetic(two_classes(), seed=8)


def interarrival_cv(arrivals):
    gaps = np.diff([a.arrival_time_s for a in arrivals if a.class_id == 0])
    return gaps.std() / gaps.mean()


def test_gamma_burstiness_raises_interarrival_cv():
    poisson = interarrival_cv(load_synthetic(two_classes(), seed=0))
    bursty = interarrival_cv(load_synthetic(two_classes(process="gamma", burstiness=3.0), seed=0))
    smooth = interarrival_cv(load_synthetic(two_classes(process="deterministic"), seed=0))
    assert poisson == pytest.approx(1.0, abs=0.05)
    assert bursty == pytest.approx(3.0, rel=0.2)
    assert smooth == pytest.approx(0.0, abs=1e-9)


def test_synthetic_options():
    base = load_synthetic(two_classes(), seed=0, duration_s=1000)
    assert base[-1].arrival_time_s < 1000
    faster = load_synthetic(two_classes(), seed=0, duration_s=1000, rate_scale=2.0)
    assert len(faster) == pytest.approx(2 * len(base), rel=0.1)
    capped = load_synthetic(two_classes(), seed=0, duration_s=1000, max_tokens_cap=12)
    assert max(a.output_tokens for a in capped) == 12 and {a.max_tokens for a in capped} == {12}
    halved = load_synthetic(two_classes(), seed=0, duration_s=1000, length_scale=0.5)
    assert {a.prompt_tokens for a in halved if a.class_id == 0} == {10}


def test_choice_and_fixed_distributions():
    spec = {"duration_s": 200, "classes": [{
        "rate_rps": 5, "prompt_tokens": {"dist": "fixed", "value": 7},
        "output_tokens": {"dist": "choice", "values": [1, 50], "weights": [3, 1]}}]}
    arrivals = load_synthetic(spec)
    assert {a.prompt_tokens for a in arrivals} == {7}
    share_short = np.mean([a.output_tokens == 1 for a in arrivals])
    assert share_short == pytest.approx(0.75, abs=0.06)


def test_synthetic_yaml_file_via_load_workload(tmp_path):
    path = write(tmp_path, "w.yml", "duration_s: 100", "seed: 2", "classes:",
                 "  - {rate_rps: 1, prompt_tokens: 3, output_tokens: 4}")
    assert load_workload(path) == load_synthetic(path) == load_synthetic(path, seed=2)


@pytest.mark.parametrize("edit, where, words", [
    (lambda s: s["classes"][1].update(output_tokens={"dist": "foo"}),
     "classes[1].output_tokens", "unknown distribution 'foo', expected one of fixed, uniform, "
                                 "geometric, lognormal, choice"),
    (lambda s: s.update(arrival={"process": "hawkes"}), "arrival.process", "unknown process"),
    (lambda s: s["classes"][0].pop("rate_rps"), "classes[0].rate_rps", "missing"),
    (lambda s: s["classes"][0].update(rate_rps=-1), "classes[0].rate_rps", "positive"),
    (lambda s: s["classes"][0].update(prompt_tokens="20"), "classes[0].prompt_tokens", "integer"),
    (lambda s: s["classes"][0].update(prompt_tokens=0), "classes[0].prompt_tokens", "integer"),
    (lambda s: s["classes"][0].update(output_tokens={"dist": "uniform", "low": 5}),
     "classes[0].output_tokens.high", "missing"),
    (lambda s: s["classes"][0].update(output_tokens={"dist": "uniform", "low": 5, "high": 2}),
     "classes[0].output_tokens.high", "at least 5"),
    (lambda s: s["classes"][1].update(output_tokens={"dist": "geometric", "mean": 0.5}),
     "classes[1].output_tokens.mean", "at least 1"),
    (lambda s: s["classes"][0].update(rate=1), "classes[0].rate", "unknown key"),
    (lambda s: s.update(arrival={"process": "gamma"}), "arrival.burstiness", "missing"),
    (lambda s: s.update(arrival={"process": "poisson", "burstiness": 2}), "arrival.burstiness",
     "gamma"),
    (lambda s: s.update(duration_s=-5), "duration_s", "positive"),
    (lambda s: s.update(classes=[]), "classes", "list of request classes"),
    (lambda s: s.update(classes=[3]), "classes[0]", "mapping"),
])
def test_bad_synthetic_names_the_key(tmp_path, edit, where, words):
    import yaml

    spec = two_classes()
    edit(spec)
    path = tmp_path / "paper.yaml"
    path.write_text(yaml.safe_dump(spec))
    message = str(pytest.raises(WorkloadError, load_synthetic, path).value)
    assert message.startswith(f"{path}: {where}: ")
    assert words in message and "\n" not in message


def test_yaml_syntax_and_missing_file(tmp_path):
    path = write(tmp_path, "broken.yaml", "duration_s: 10", "classes: [", "  {rate_rps: 1")
    assert str(pytest.raises(WorkloadError, load_synthetic, path).value).startswith(f"{path}:")
    missing = tmp_path / "none.yaml"
    assert str(pytest.raises(WorkloadError, load_synthetic, missing).value) == \
        f"{missing}: no such file"
    top = write(tmp_path, "list.yaml", "- 1")
    assert "mapping" in str(pytest.raises(WorkloadError, load_synthetic, top).value)
