"""The profile file format: how each field is spelled in a file, what each value must be, and reading one.

``Profile`` and ``StepExtras`` check their values here too, so a file and a constructor call are
held to the same bounds; a problem is one sentence naming the field (or the file's key).
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

PROFILE_SUFFIXES = (".json", ".yaml", ".yml")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` and ``1.0e5`` as floats, as YAML 1.2 does.

    Coefficients are naturally written that way, and YAML 1.1 would read them as strings.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))

class ProfileError(ValueError):
    """A profile file or name that cannot be used; the message is one sentence naming it."""


class Invalid(Exception):
    """A value problem, phrased without saying where the value came from (the caller says)."""

# How each dataclass field is spelled in a profile file, and what it must be.
FILE_KEY = {
    "base_s": "step_time.base_s",
    "per_token_s": "step_time.per_token_s",
    "per_kv_token_s": "step_time.per_kv_token_s",
    "per_decode_token_s": "step_time.per_decode_token_s",
    "noise_sigma": "step_time.noise_sigma",
    "per_prefill_s": "step_time.per_prefill_s",
    "noise_corr": "step_time.noise_corr",
    "noise_sigma_below": "step_time.noise_sigma_below",
    "per_prefill_pair_s": "step_time.per_prefill_pair_s",
    "per_first_decode_s": "step_time.per_first_decode_s",
    "per_after_prefill_s": "step_time.per_after_prefill_s",
    "after_prefill_decay": "step_time.after_prefill_decay",
    "per_after_prefill_token_s": "step_time.per_after_prefill_token_s",
    "noise_knee_s": "step_time.noise_knee_s",
    "noise_floor": "step_time.noise_floor",
    "noise_white": "step_time.noise_white",
    "per_prefill_alone_s": "step_time.per_prefill_alone_s",
    "idle_s": "step_time.idle_s",
    "kv_capacity_tokens": "kv_capacity_tokens",
    "block_size": "block_size",
    "ttft_slo_s": "slo.ttft_s",
    "tpot_slo_s": "slo.tpot_s",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
}
_NON_NEGATIVE = ("base_s", "per_token_s", "per_kv_token_s", "noise_sigma", "per_prefill_s", "noise_corr",
                 "per_prefill_pair_s", "per_first_decode_s", "per_after_prefill_s", "after_prefill_decay",
                 "per_after_prefill_token_s", "noise_knee_s", "noise_floor", "noise_white", "per_prefill_alone_s")
#: fields that may be None (absent from the file)
_OPTIONAL = ("idle_s", "per_decode_token_s", "noise_sigma_below")
#: the largest noise_sigma accepted: a factor of e^2 between the median and one sigma away
MAX_NOISE_SIGMA = 2.0
#: the largest noise_corr accepted (1 would freeze the factor at its first draw)
MAX_NOISE_CORR = 0.999
#: the largest after_prefill_decay accepted (1 would let a prefill's cost last for ever)
MAX_AFTER_PREFILL_DECAY = 0.99
#: the largest value of each bounded field (noise_floor is a share of the noise's sigma)
_AT_MOST = {"noise_sigma": MAX_NOISE_SIGMA, "noise_sigma_below": MAX_NOISE_SIGMA, "noise_corr": MAX_NOISE_CORR,
            "after_prefill_decay": MAX_AFTER_PREFILL_DECAY, "noise_floor": 1.0, "noise_white": 1.0}
_POSITIVE = ("ttft_slo_s", "tpot_slo_s")
_POSITIVE_INT = ("kv_capacity_tokens", "block_size", "max_num_batched_tokens", "max_num_seqs")


def read_profile_file(path: Path) -> Any:
    """The parsed content of a profile file (JSON, or YAML with ``1e-3`` read as a float).

    :raises ProfileError: the file is missing, unreadable or not valid JSON or YAML.
    """
    where = f"profile file {str(path)!r}"
    if path.suffix.lower() not in PROFILE_SUFFIXES:
        raise ProfileError(f"{where}: expected a .json, .yaml or .yml file.")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"{where} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{where} cannot be read ({type(e).__name__}).") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(
                f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).") from None
    else:
        try:
            data = yaml.load(text, Loader=_YamlLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "syntax error"
            raise ProfileError(f"{where} is not valid YAML ({problem}{at}).") from None
    return data


def fields_from_file(data: Any, defaults: dict[str, Any]) -> dict:
    """Profile keyword arguments from a parsed profile file, checked and normalised; ``defaults``: the
    value of each numeric field the file may leave out. Raises Invalid naming the file's key."""
    if not isinstance(data, dict):
        raise Invalid(f"expected a mapping of profile keys at the top level, got {show(data)}")
    _no_unknown_keys(data, {"name", "description", "source", "step_time", "kv_capacity_tokens",
                            "block_size", "slo", "max_num_batched_tokens", "max_num_seqs", "extra"})
    for key in ("name", "step_time", "kv_capacity_tokens"):
        if key not in data:
            raise Invalid(f"missing required key {key!r}")
    step_time = _section(data, "step_time", {key.split(".", 1)[1] for key in FILE_KEY.values()
                                             if key.startswith("step_time.")})
    for key in ("base_s", "per_token_s", "per_kv_token_s"):
        if key not in step_time:
            raise Invalid(f"missing required key 'step_time.{key}'")
    slo = _section(data, "slo", {"ttft_s", "tpot_s"}) if "slo" in data else {}

    fields = {
        "name": data["name"],
        "description": data.get("description", ""),
        "source": data.get("source", ""),
        "extra": data.get("extra", {}),
        "base_s": step_time["base_s"],
        "per_token_s": step_time["per_token_s"],
        "per_kv_token_s": step_time["per_kv_token_s"],
        "idle_s": step_time.get("idle_s"),
        "per_decode_token_s": step_time.get("per_decode_token_s"),
        "noise_sigma": step_time.get("noise_sigma", 0.0),
        "per_prefill_s": step_time.get("per_prefill_s", 0.0),
        "noise_corr": step_time.get("noise_corr", 0.0),
        "noise_sigma_below": step_time.get("noise_sigma_below"),
        "per_prefill_pair_s": step_time.get("per_prefill_pair_s", 0.0),
        "per_first_decode_s": step_time.get("per_first_decode_s", 0.0),
        "per_after_prefill_s": step_time.get("per_after_prefill_s", 0.0),
        "after_prefill_decay": step_time.get("after_prefill_decay", 0.0),
        "per_after_prefill_token_s": step_time.get("per_after_prefill_token_s", 0.0),
        "noise_knee_s": step_time.get("noise_knee_s", 0.0),
        "noise_floor": step_time.get("noise_floor", 0.0),
        "noise_white": step_time.get("noise_white", 0.0),
        "per_prefill_alone_s": step_time.get("per_prefill_alone_s", 0.0),
        "kv_capacity_tokens": data["kv_capacity_tokens"],
    }
    for key in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        if key in data:
            fields[key] = data[key]
    if "ttft_s" in slo:
        fields["ttft_slo_s"] = slo["ttft_s"]
    if "tpot_s" in slo:
        fields["tpot_slo_s"] = slo["tpot_s"]

    # Check with the file's spelling of the keys, so the message points into the file.
    checked = checked_values({**defaults, **{f: v for f, v in fields.items() if f in FILE_KEY}},
                       key_of=FILE_KEY.__getitem__)
    check_text(fields["name"], fields["description"], fields["source"], fields["extra"],
                key_of=lambda f: f)
    # normalised here too (a count written 4096.0 is the int 4096), not only by Profile itself: a
    # compiled Profile (engine/sim/compiled.py) takes only an int where it annotates one
    return {**fields, **{f: checked[f] for f in fields if f in checked}}

def _section(data: dict, key: str, allowed: set[str]) -> dict:
    section = data[key]
    if not isinstance(section, dict):
        raise Invalid(f"{key!r} must be a mapping, got {show(section)}")
    _no_unknown_keys(section, allowed, prefix=f"{key}.")
    return section


def _no_unknown_keys(mapping: dict, allowed: set[str], prefix: str = "") -> None:
    for key in mapping:
        if key not in allowed:
            raise Invalid(f"unknown key {prefix + str(key)!r} (expected one of "
                           f"{', '.join(prefix + k for k in sorted(allowed))})")


def checked_terms(values: dict, key_of) -> dict:
    """The float fields among ``values`` validated and normalised to float (None kept where it
    may be); raises Invalid naming the first bad one."""
    out: dict[str, Any] = {}
    for f in _NON_NEGATIVE + _POSITIVE + _OPTIONAL:
        if f not in values:
            continue
        v = values[f]
        if f in _OPTIONAL and v is None:
            out[f] = None
            continue
        if not _is_number(v) or not math.isfinite(v):
            raise Invalid(f"{key_of(f)} must be a finite number, got {show(v)}")
        if f in _NON_NEGATIVE and v < 0 or f in _OPTIONAL and f != "idle_s" and v < 0:
            raise Invalid(f"{key_of(f)} must be a non-negative number, got {show(v)}")
        if f in _AT_MOST and v > _AT_MOST[f]:
            raise Invalid(f"{key_of(f)} must be at most {_AT_MOST[f]}, got {show(v)}")
        if f not in _NON_NEGATIVE and f in _POSITIVE + ("idle_s",) and v <= 0:
            raise Invalid(f"{key_of(f)} must be a positive number of seconds, got {show(v)}")
        out[f] = float(v)
    return out


def checked_values(values: dict, key_of) -> dict:
    """Numeric fields validated and normalised (floats as float, counts as int); raises Invalid."""
    out = checked_terms(values, key_of)
    for f in _POSITIVE_INT:
        v = values[f]
        if not _is_number(v) or not math.isfinite(v) or v != int(v) or v < 1:
            raise Invalid(f"{key_of(f)} must be a positive whole number, got {show(v)}")
        out[f] = int(v)
    if out["kv_capacity_tokens"] < out["block_size"]:
        raise Invalid(f"{key_of('kv_capacity_tokens')} ({out['kv_capacity_tokens']}) must be at "
                       f"least one block of {key_of('block_size')} ({out['block_size']}) tokens")
    # A step that does work, and an idle tick, must move the clock or the simulator stalls.
    if out["base_s"] == out["per_token_s"] == out["per_kv_token_s"] == 0:
        raise Invalid(f"{key_of('base_s')}, {key_of('per_token_s')} and {key_of('per_kv_token_s')} "
                       f"are all 0, so a step would take no time; expected at least one positive")
    if out["base_s"] == out["per_kv_token_s"] == out["per_decode_token_s"] == 0:
        raise Invalid(f"{key_of('base_s')}, {key_of('per_kv_token_s')} and {key_of('per_decode_token_s')} "
                       f"are all 0, so a decode step would take no time; expected at least one positive")
    if out["base_s"] == 0 and out["idle_s"] is None:
        raise Invalid(f"{key_of('idle_s')} must be given and positive when {key_of('base_s')} "
                       f"is 0, since an idle step would otherwise take no time")
    return out


def check_text(name: Any, description: Any, source: Any, extra: Any, key_of) -> None:
    if not isinstance(name, str) or not name.strip():
        raise Invalid(f"{key_of('name')} must be a non-empty string, got {show(name)}")
    for key, value in (("description", description), ("source", source)):
        if not isinstance(value, str):
            raise Invalid(f"{key_of(key)} must be a string, got {show(value)}")
    if not isinstance(extra, dict):
        raise Invalid(f"{key_of('extra')} must be a mapping, got {show(extra)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def show(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)


def profile_to_dict(profile: Any) -> dict:
    """``profile`` (a ``Profile``) in file format: the structure ``fields_from_file`` reads, the optional
    terms written only where they are set."""
    step_time = {"base_s": profile.base_s, "per_token_s": profile.per_token_s,
                 "per_kv_token_s": profile.per_kv_token_s}
    if profile.per_decode_token_s is not None:
        step_time["per_decode_token_s"] = profile.per_decode_token_s
    if profile.noise_sigma:
        step_time["noise_sigma"] = profile.noise_sigma
    if profile.noise_corr:
        step_time["noise_corr"] = profile.noise_corr
    if profile.noise_white:
        step_time["noise_white"] = profile.noise_white
    if profile.noise_sigma_below is not None:
        step_time["noise_sigma_below"] = profile.noise_sigma_below
    if profile.noise_knee_s:
        step_time["noise_knee_s"] = profile.noise_knee_s
        step_time["noise_floor"] = profile.noise_floor
    if profile.per_prefill_pair_s:
        step_time["per_prefill_pair_s"] = profile.per_prefill_pair_s
    if profile.per_first_decode_s:
        step_time["per_first_decode_s"] = profile.per_first_decode_s
    if profile.per_after_prefill_s or profile.per_after_prefill_token_s:
        step_time["per_after_prefill_s"] = profile.per_after_prefill_s
        step_time["after_prefill_decay"] = profile.after_prefill_decay
    if profile.per_after_prefill_token_s:
        step_time["per_after_prefill_token_s"] = profile.per_after_prefill_token_s
    if profile.per_prefill_s:
        step_time["per_prefill_s"] = profile.per_prefill_s
    if profile.per_prefill_alone_s:
        step_time["per_prefill_alone_s"] = profile.per_prefill_alone_s
    if profile.idle_s is not None:
        step_time["idle_s"] = profile.idle_s
    return {
        "name": profile.name,
        "description": profile.description,
        "source": profile.source,
        "step_time": step_time,
        "kv_capacity_tokens": profile.kv_capacity_tokens,
        "block_size": profile.block_size,
        "slo": {"ttft_s": profile.ttft_slo_s, "tpot_s": profile.tpot_slo_s},
        "max_num_batched_tokens": profile.max_num_batched_tokens,
        "max_num_seqs": profile.max_num_seqs,
        "extra": copy.deepcopy(profile.extra),
    }
