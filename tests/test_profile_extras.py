"""The step model's core and its optional part (``StepExtras``): old files, round trips, bad values,
the keyword arguments and attributes kept from before, and the fit's report of what it took."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from tidegate.engine.core.profile import EXTRA_TERMS, Profile, ProfileError, StepExtras, load_profile

#: a file as ``Profile.save`` wrote it before the split, every optional term set (its key order too)
OLD_FILE = {
    "name": "every-term",
    "description": "a profile with every step-time term",
    "source": "written by Profile.save before the step model had a core",
    "step_time": {
        "base_s": 0.0021405763279858485, "per_token_s": 9.350408537812356e-05,
        "per_kv_token_s": 2.1592289123891984e-06, "per_decode_token_s": 5e-05, "noise_sigma": 0.2,
        "noise_corr": 0.8, "noise_white": 0.4, "noise_sigma_below": 0.1, "noise_knee_s": 0.003,
        "noise_floor": 0.3, "per_prefill_pair_s": 1e-08, "per_first_decode_s": 0.0003,
        "per_after_prefill_s": 0.001, "after_prefill_decay": 0.5, "per_after_prefill_token_s": 2e-06,
        "per_prefill_s": 0.002, "per_prefill_alone_s": 0.0015, "idle_s": 0.001,
    },
    "kv_capacity_tokens": 16384, "block_size": 16, "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
    "max_num_batched_tokens": 512, "max_num_seqs": 64, "extra": {},
}
CORE_KEYS = {"base_s", "per_token_s", "per_kv_token_s", "per_decode_token_s", "noise_sigma", "per_prefill_s",
             "idle_s"}


def _old_step_time(c: dict, t: int, k: int, d: int, n: int, q: int, f: int, a: float, b: float) -> float:
    """The step time exactly as the profile computed it before the split, in its order of additions."""
    if t == 0:
        return c["idle_s"]
    s = c["base_s"] + c["per_token_s"] * t + c["per_kv_token_s"] * k
    s += (c["per_decode_token_s"] - c["per_token_s"]) * d
    s += c["per_prefill_s"] * n
    if n and not d:
        s += c["per_prefill_alone_s"]
    s += c["per_prefill_pair_s"] * q
    s += c["per_first_decode_s"] * f
    s += c["per_after_prefill_s"] * a
    s += c["per_after_prefill_token_s"] * b
    return s


def _grid():
    for t in (0, 1, 7, 300):
        for k in (0, 50, 5000):
            for d in (0, 1):
                for n in (0, 1):
                    for f in (0, 1):
                        if d <= t and n <= t - d and f <= d:
                            yield t, k, d, n, 99 * n, f, 1.5, 30.0


def test_an_old_file_with_every_term_loads_and_gives_the_same_step_times(tmp_path: Path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_FILE, indent=2) + "\n")
    p = load_profile(path)
    assert p.extras is not None and set(p.extras.terms()) == set(EXTRA_TERMS)
    for key in EXTRA_TERMS:  # every term read as before, from the profile itself
        assert getattr(p, key) == OLD_FILE["step_time"][key]
    for counts in _grid():  # to the bit
        assert p.step_time_s(*counts) == _old_step_time(OLD_FILE["step_time"], *counts)
    assert p.noise_scale(0.01) == pytest.approx((0.3 ** 2 + (1 - 0.3 ** 2) * 0.3 ** 2) ** 0.5)
    # written again, the same file: the same keys, in the same order
    p.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()


def test_the_shipped_profiles_are_core_only_and_write_what_they_read():
    for name in ("a100-llama2-7b", "h200-llama3-8b", "tiny-cpu", "slot"):
        p = load_profile(name)
        assert p.extras is None
        written = p.to_dict()
        shipped = json.loads((Path(__file__).parents[1] / "engine/core/profiles" / f"{name}.json").read_text())
        assert written["step_time"] == shipped["step_time"]


def test_a_core_only_profile_round_trips_without_the_optional_keys(tmp_path: Path):
    p = Profile(name="core", description="", base_s=0.01, per_token_s=1e-4, per_kv_token_s=1e-6,
                kv_capacity_tokens=4096, per_decode_token_s=2e-4, per_prefill_s=1e-3, noise_sigma=0.1)
    assert p.extras is None
    assert set(p.to_dict()["step_time"]) <= CORE_KEYS
    p.save(tmp_path / "core.json")
    text = (tmp_path / "core.json").read_text()
    assert not any(key in text for key in EXTRA_TERMS)
    again = load_profile(tmp_path / "core.json")
    assert again == p and again.extras is None
    assert again.noise_corr == 0.0 and again.noise_sigma_below is None and again.per_prefill_alone_s == 0.0


def test_all_optional_terms_at_their_defaults_are_the_core_model():
    core = Profile("a", "", 0.01, 1e-4, 1e-6, 4096)
    assert Profile("a", "", 0.01, 1e-4, 1e-6, 4096, extras=StepExtras()) == core
    assert Profile("a", "", 0.01, 1e-4, 1e-6, 4096, noise_corr=0.0, per_prefill_alone_s=0.0).extras is None
    assert StepExtras(noise_white=0.5).noise_white == 0.0  # no wander, no fresh share: one way to say it
    assert StepExtras(noise_sigma_below=0.0).terms() == {"noise_sigma_below": 0.0}  # 0 below is a value


@pytest.mark.parametrize("key, value, expected", [
    ("noise_corr", 1.5, "must be at most 0.999"),
    ("noise_white", 2.0, "must be at most 1.0"),
    ("after_prefill_decay", 0.995, "must be at most 0.99"),
    ("per_prefill_alone_s", -1e-3, "must be a non-negative number"),
    ("noise_sigma_below", float("inf"), "must be a finite number"),
    ("per_prefill_pair_s", "1e-8", "must be a finite number"),
    ("noise_floor", True, "must be a finite number"),
])
def test_bad_optional_values_are_refused_with_the_key_named_in_one_sentence(tmp_path: Path, key, value, expected):
    data = json.loads(json.dumps(OLD_FILE))
    data["step_time"][key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    for make, named in ((lambda: load_profile(path), f"step_time.{key} {expected}"),
                        (lambda: Profile("bad", "", 0.01, 1e-4, 1e-6, 4096, **{key: value}), f"{key} {expected}"),
                        (lambda: StepExtras(**{key: value}), f"step extras: {key} {expected}")):
        with pytest.raises(ProfileError) as e:
            make()
        message = str(e.value)
        assert named in message
        assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message


def test_extras_of_the_wrong_kind_are_refused_in_one_sentence():
    with pytest.raises(ProfileError, match=r"^profile 'x': extras must be a StepExtras or nothing \(None\), got "
                                           r"a mapping\.$"):
        Profile("x", "", 0.01, 1e-4, 1e-6, 4096, extras={"noise_corr": 0.5})  # type: ignore[arg-type]


def test_the_optional_terms_are_still_keyword_arguments_attributes_and_replace_fields():
    p = Profile(name="kw", description="", base_s=0.01, per_token_s=1e-4, per_kv_token_s=1e-6,
                kv_capacity_tokens=4096, per_prefill_alone_s=0.001, noise_corr=0.5)
    assert p.extras == StepExtras(per_prefill_alone_s=0.001, noise_corr=0.5)
    assert (p.per_prefill_alone_s, p.noise_corr, p.noise_knee_s) == (0.001, 0.5, 0.0)
    with pytest.raises(AttributeError):
        p.noise_corr = 0.1  # type: ignore[misc]
    # replace: a core field keeps the extras; an optional term replaces only itself
    noisy = replace(p, noise_sigma=0.2)
    assert noisy.extras == p.extras and noisy.noise_sigma == 0.2
    after = replace(p, per_after_prefill_s=1e-3, after_prefill_decay=0.5)
    assert (after.per_after_prefill_s, after.after_prefill_decay, after.per_prefill_alone_s) == (1e-3, 0.5, 0.001)
    assert replace(after, per_after_prefill_s=0.0, after_prefill_decay=0.0, per_prefill_alone_s=0.0,
                   noise_corr=0.0).extras is None
    # a keyword beside extras overrides that term of it
    both = Profile("b", "", 0.01, 1e-4, 1e-6, 4096, extras=StepExtras(noise_corr=0.5, noise_sigma_below=0.1),
                   noise_sigma_below=None)
    assert both.noise_corr == 0.5 and both.noise_sigma_below is None
    # pickled and copied whole, extras included
    assert pickle.loads(pickle.dumps(after)) == after
    assert pickle.loads(pickle.dumps(after.extras)) == after.extras


def test_the_fit_reports_which_optional_terms_it_took_and_why():
    import numpy as np

    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    truth = Profile("t", "", 2e-3, 1e-4, 2e-6, 50_000, per_decode_token_s=3e-4, per_prefill_s=1e-3,
                    per_prefill_alone_s=1.5e-3)
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(2000):
        decodes = int(rng.choice([0, 0, 1, 2, 8]))
        chunk = int(rng.choice([0, 16, 128])) if decodes else int(rng.choice([16, 64, 128]))
        t, kv = decodes + chunk, decodes * 300 + chunk
        noise = float(np.exp(0.05 * rng.standard_normal()))
        rows.append((t, kv, truth.step_time_s(t, kv, decodes, int(chunk > 0)) * noise, decodes, int(chunk > 0)))
    fit = fit_step_time(rows, loss="l1")
    report = fit["optional_terms"]
    assert list(report) == list(EXTRA_TERMS)
    assert all(set(r) == {"taken", "why"} and isinstance(r["why"], str) and r["why"] for r in report.values())
    assert report["per_prefill_alone_s"]["taken"] and "3 of each needed" in report["per_prefill_alone_s"]["why"]
    pair = report["per_prefill_pair_s"]
    assert not pair["taken"] and "do not say prefill pairs" in pair["why"]
    assert not report["noise_corr"]["taken"]  # independent noise: no wander
    fields = profile_fields(fit)
    for term in ("per_prefill_pair_s", "per_first_decode_s", "per_after_prefill_s", "per_after_prefill_token_s",
                 "per_prefill_alone_s", "noise_knee_s"):
        assert report[term]["taken"] == bool(fit[term]), term
    assert replace(truth, **fields).extras is not None
    # without the steps to tell them apart, the fit leaves the cost of a prefill alone out, and says why
    beside_never = fit_step_time([r for r in rows if not (r[3] and r[4])], loss="l1")["optional_terms"]
    assert not beside_never["per_prefill_alone_s"]["taken"]
    assert "0 beside decodes; 3 of each are needed" in beside_never["per_prefill_alone_s"]["why"]
    json.dumps(fit)  # kept in a profile's extra: plain JSON
