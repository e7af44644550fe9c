"""Which step-time terms each engine's serving steps support: one fit per engine, and the same fit with
each optional term left out, judged on held-out steps.

    .venv/bin/python benchmarks/step_terms.py --steps tidegate-cpu=DIR/profile_steps.csv \\
        --steps vllm-cpu=DIR/vllm_steps.csv [--preset a100-llama2-7b ...] [--out docs/bench/step_terms]

``--steps LABEL=FILE``: a steps file ``tidegate profile --from-steps`` reads (a twin check's
``twin_steps.csv`` or ``profile_steps.csv``, or the vLLM plugin's step log, each step timed by its
period in vLLM's loop). The rows are split in time, the first ``--train`` share fitted and the rest
judged (the steps a profile predicts come after the ones it was fitted on), with the ``l1`` fit that
serving profiles use. Variants:

- ``full``: every term the fit takes (``engine.sim.fit.fit_step_time``);
- ``-F``: no cost per first decode; ``-Q,F``: no cost per prefill attention pair either;
- ``-alone``: no cost for a step that prefills with no decodes beside it;
- ``-after``: no cost on the steps after a prefill;
- ``one cost per token``: T and K only (``base + per_token T + per_kv K``), the presets' form.

A term helps an engine where leaving it out raises the held-out error; the table is what
docs/PROFILES.md quotes. ``--preset NAME``: a shipped profile's coefficients, listed for which terms
it uses (presets come from published figures, not from steps). Writes ``step_terms.md``; ``--json
FILE`` also writes every variant's fit (its terms and error by step kind).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.fit import fit_step_time, profile_fields
from tidegate.engine.twin.fit import read_steps_csv

OUT = Path("docs/bench/step_terms")
BASE = load_profile("tiny-cpu")
TERMS = ("base_s", "per_token_s", "per_decode_token_s", "per_kv_token_s", "per_prefill_s", "per_prefill_pair_s",
         "per_first_decode_s", "per_prefill_alone_s", "per_after_prefill_s", "per_after_prefill_token_s")


def variants(rows: np.ndarray) -> dict[str, tuple[np.ndarray, dict]]:
    """Each variant's rows and ``fit_step_time`` options."""
    return {"full": (rows, {}), "-F": (rows[:, :6], {}), "-Q,F": (rows[:, :5], {}),
            "-alone": (rows, {"prefill_alone": False}), "-after": (rows, {"after_prefill": False}),
            "one cost per token": (rows[:, :3], {})}


def judge(rows: np.ndarray, train: float) -> dict:
    """Each variant fitted on the first ``train`` share of ``rows`` and judged on the rest."""
    cut = int(len(rows) * train)
    out = {}
    for name, (data, options) in variants(rows).items():
        fit = fit_step_time(data[:cut].tolist(), loss="l1", **options)
        fields = profile_fields(fit, noise=False)
        profile = dataclasses.replace(BASE, **fields)  # the fitted step time; nothing else is read
        test = data[cut:]
        counts = [tuple(r[:2]) + tuple(r[3:]) for r in test]
        pred = np.array(profile.predict_steps(counts))
        ape = np.abs(pred - test[:, 2]) / test[:, 2]
        kinds = fit["by_kind"]
        out[name] = {"heldout_mape": float(ape.mean()), "heldout_median_ape": float(np.median(ape)),
                     "train_mape": fit["mape"], "by_kind": kinds,
                     "terms": {t: fields.get(t) for t in TERMS if fields.get(t)}}
    return out


def markdown(results: dict, presets: dict, command: str) -> str:
    names = list(next(iter(results.values()))["variants"]) if results else []
    lines = [f"Command: `{command}`", "",
             "Held-out MAPE (the later steps, predicted by a fit on the earlier ones):", "",
             "| engine | steps | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label, r in results.items():
        full = r["variants"]["full"]["heldout_mape"]
        cells = [f"{100 * v['heldout_mape']:.1f}%" + ("" if name == "full" else
                                                       f" ({100 * (v['heldout_mape'] - full):+.1f})")
                 for name, v in r["variants"].items()]
        lines.append(f"| {label} | {r['steps']} | " + " | ".join(cells) + " |")
    lines += ["", "Terms the full fit takes (coefficients) and its error by step kind (MAPE, median measured / "
              "predicted):", "", "| engine | terms | decode only | prefill only | prefill beside decodes |",
              "|---|---|---|---|---|"]
    for label, r in results.items():
        full = r["variants"]["full"]
        terms = ", ".join(f"{t} {v:.3g}" for t, v in full["terms"].items())
        kinds = [full["by_kind"].get(k) for k in ("decode only", "prefill only", "prefill beside decodes")]
        cells = [f"{100 * k['mape']:.1f}%, x{1 + k['bias']:.3f} ({k['steps']})" if k else "-" for k in kinds]
        lines.append(f"| {label} | {terms} | " + " | ".join(cells) + " |")
    for name, terms in presets.items():
        lines.append(f"| {name} (preset) | " + ", ".join(f"{t} {v:.3g}" for t, v in terms.items()) + " | - | - | - |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", action="append", default=[], metavar="LABEL=FILE")
    ap.add_argument("--preset", action="append", default=[])
    ap.add_argument("--train", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--json", type=Path, default=None, help="also write every variant's fit here")
    args = ap.parse_args()
    results = {}
    for spec in args.steps:
        label, _, path = spec.partition("=")
        rows = np.array([tuple(r) + (0,) * (7 - len(r)) for r in read_steps_csv(path)], dtype=float)
        results[label] = {"file": path, "steps": len(rows), "variants": judge(rows, args.train)}
        print(label, {k: round(v["heldout_mape"], 4) for k, v in results[label]["variants"].items()})
    presets = {}
    for name in args.preset:
        p = load_profile(name)
        presets[name] = {t: getattr(p, t) for t in TERMS if getattr(p, t, None)}
    command = "python benchmarks/step_terms.py " + " ".join(f"--steps {s}" for s in args.steps) + "".join(
        f" --preset {p}" for p in args.preset)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_terms.md").write_text(markdown(results, presets, command))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "presets": presets}, indent=2) + "\n")
    print(markdown(results, presets, command))


if __name__ == "__main__":
    main()
