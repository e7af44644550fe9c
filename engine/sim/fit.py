"""Fit the simulator's step-time model to timed steps (numpy only).

The model is ``Profile.step_time_s``: ``t = base_s + per_token_s * P + per_decode_token_s * D +
per_kv_token_s * K + per_prefill_s * C + per_prefill_pair_s * Q + per_first_decode_s * F +
per_after_prefill_s * A + per_after_prefill_token_s * B + per_prefill_alone_s * L`` for a step
with P prefill tokens in C chunks whose attention has Q query-key pairs and D decodes, F of them
a request's first, that reads K KV tokens, L being 1 when it prefills with no decodes beside,
A the weight of the prefill steps before it and B that of their prefill
tokens (``engine.core.profile.after_prefill_weights``: on a CPU a prefill evicts the caches the
next decodes work from, a longer one more of them, and they run slow for a few steps). Rows
that do not say D, or that never mix the two, get one cost per token (``base_s + per_token_s * T
+ per_kv_token_s * K``); rows that do not say C, Q or F leave ``per_prefill_s``,
``per_prefill_pair_s`` or ``per_first_decode_s`` at 0. Rows that say C come from serving in the
order the steps ran, and their fit tries A and B for each decay of ``AFTER_DECAYS``, keeping the
best when it cuts the loss by 1% or more (else both costs stay 0). L gets its own cost where
the rows have steps of prefills alone and steps of prefills beside decodes (``MIN_SPLIT_ROWS``
of each): on a CPU at light load, a step that prefills alone is nearly always the first after
the engine idled, and with one cost per chunk fitted on those, the prefills beside running
decodes ran 13% faster than the model at the median over 57 checks (interquartile range
11-15%, ``benchmarks/step_kinds.py``): the very steps that the slowest requests' TPOT is made of.
The fit keeps the coefficients non-negative and weighs every step by its relative error, so
short steps count as much as long ones. The rows come from the profiler's grid
(``engine.real.profiler``) or from serving runs (``engine.twin.fit``).

The noise model is fitted from what the linear model leaves, the log of real over predicted step
time in the order the steps ran. Real steps rarely run much faster than their median and now
and then run far slower, so the two halves get their own sigma, each from the median distance
of its steps from the median (a half-normal's is 0.6745 sigma), so that the stalls of a shared
machine do not count: ``Profile.noise_sigma`` above, ``Profile.noise_sigma_below`` below. (A
sigma above matched to the mean instead overshot TPOT p99, by 20% at the median over 72 pairs
of checks, fitted on one and judged on another: the tail's mean belongs to a few stalls.)
``Profile.noise_corr`` and ``Profile.noise_white`` are fitted together (:func:`noise_wander`): an
AR(1) series, the machine's speed wandering over tens of steps, plus a share of fresh jitter at
every step, chosen so that the mean of 2 to 256 successive steps varies as much as the measured
steps' does. A request's TPOT is such a mean: independent factors would average out within a
request and make TPOT far narrower than measured, and an AR(1) series alone, fitted to the first
lags' autocorrelation as profiles did before, cannot have both a quick drop at lag one and a slow
decay after it. Over 33 recorded checks it gave the mean of 8-32 steps 20-27% more variance
than measured; on series whose jitter is 30-90% fresh, it spreads the mean of 32 steps 1.14-1.74
times as wide as the truth (``benchmarks/noise_spans.py``). A profile whose ``noise_corr`` is 0
has no fresh share (every draw is fresh already).

The noise's size falls with the step's length: on a CPU, single-token decodes of about 1 ms vary
by 12-20% from step to step while prefills of 10-40 ms vary by 3-6%, part of the jitter being a
fixed number of seconds that a long step amortises. ``Profile.noise_knee_s`` and
``Profile.noise_floor`` are fitted to the robust sigma of the residuals in bins of the predicted
step length (:func:`noise_size`), and the sigmas and the correlation above are then fitted on the
residuals divided by that curve, so they are the sigmas of the short steps. (One sigma for every
length gave the long prefill steps three times their noise: over 12 twin checks judged in sample,
TPOT p99 came out +23% at the median and TTFT p50 -6%, against +4% and -1% with the curve.)
"""

from __future__ import annotations

import numpy as np
from scipy.stats import f as f_dist

from tidegate.engine.core.profile import after_prefill_weights
from tidegate.engine.core.profile_file import MAX_NOISE_CORR, MAX_NOISE_SIGMA

#: fewer rows than this with prefill tokens, or with decodes, and the fit keeps one cost per token
MIN_SPLIT_ROWS = 3
#: the median of a half-normal |Z|
_HALF_NORMAL_MEDIAN = 0.6745
#: the fewest steps the noise's correlation is fitted on (fewer: independent steps)
NOISE_MIN_STEPS = 200
#: the correlation at lag one below which steps count as independent (noise, not signal)
NOISE_ACF_FLOOR = 0.05
#: the decays of the after-prefill cost the fit tries (how much of it is left one step later)
AFTER_DECAYS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: the least relative cut in the fit's loss for which the after-prefill cost is kept
AFTER_MIN_GAIN = 0.01
#: the spans of successive steps (a request's decode steps) whose mean's variance the noise's
#: correlation and fresh share are fitted to (:func:`noise_wander`)
NOISE_SPANS = (2, 4, 8, 16, 32, 64, 128, 256)
#: the correlations and fresh shares :func:`noise_wander` tries (rho up to MAX_NOISE_CORR, finer near 1)
_WANDER_RHOS = np.concatenate([[0.0], 1.0 - np.geomspace(1.0, 1.0 - MAX_NOISE_CORR, 400)[1:]])
_WANDER_WHITES = np.linspace(0.0, 1.0, 201)
#: log-spaced bins of the predicted step length in which the noise's size is measured
NOISE_BINS = 24
#: the fewest steps a bin needs for its noise to count
NOISE_BIN_MIN = 20
#: the significance at which the noise is judged to depend on the step's length (an F test of the
#: curve's two parameters against one sigma for every length)
NOISE_SIZE_SIGNIFICANCE = 0.05


def fit_step_time(rows, heldout_fraction: float = 0.25, seed: int = 0, loss: str = "l2",
                  after_prefill: bool = True, after_prefill_tokens: bool = True, runs=None,
                  noise_by_length: bool = True, prefill_alone: bool = True) -> dict:
    """Fit the step-time model to timed steps; returns coefficients, the noise sigma and fit quality.

    :param rows: ``(new tokens, KV tokens read, seconds)``, ``(new tokens, KV tokens read, seconds,
        decodes)``, ``(..., decodes, prefill chunks)``, ``(..., prefill chunks, prefill pairs)`` or
        ``(..., prefill pairs, first decodes)`` of timed steps, in the order they ran; rows with
        no time are dropped.
    :param heldout_fraction: share of the rows (at least 8 needed) held out to report ``heldout_mape``.
    :param seed: seeds the choice of held-out rows.
    :param after_prefill: with rows that say their prefill chunks (so they come from serving, in
        the order they ran), also fit the cost a step pays after prefill steps
        (``per_after_prefill_s``, and ``per_after_prefill_token_s`` per prefill token) and its
        decay from step to step (the best of ``AFTER_DECAYS``).
    :param after_prefill_tokens: False leaves the cost per prefill token at 0 (the cost per prefill
        step alone, as profiles before it had).
    :param runs: for rows pooled from several serving runs, each row's run (any labels): the
        noise is then fitted on each run's steps against that run's own median, so a machine that
        ran faster in one run than in another does not count as step noise (the coefficients
        are fitted on all rows, the median step over the runs).
    :param noise_by_length: fit how the noise falls with the step's length (:func:`noise_size`);
        False: one sigma for every step, fitted on all of them.
    :param prefill_alone: with rows that say their prefill chunks, also fit the cost of a step
        that prefills and runs no decodes (``per_prefill_alone_s``), where ``MIN_SPLIT_ROWS`` steps
        or more prefill alone and as many beside decodes.
    :param loss: ``"l2"``: least squares on relative error; ``"l1"``: least absolute error
        relative to the prediction (iteratively reweighted least squares), which makes the model
        the median step: half the steps of any size run longer than predicted. Robust to the
        stalls a shared machine puts into a few steps, and the fit the noise model assumes (error
        relative to the real time instead would put the model below the median, by a factor
        ``exp(-sigma^2)`` under log-normal noise).
    :return: ``base_s``, ``per_token_s``, ``per_kv_token_s``, ``per_decode_token_s`` (None without
        a split), ``per_prefill_s``, ``per_prefill_pair_s`` and ``per_first_decode_s`` (0 without
        their counts), ``per_prefill_alone_s`` (0 when not fitted), ``per_after_prefill_s``,
        ``per_after_prefill_token_s`` and ``after_prefill_decay`` (0 when not fitted),
        ``noise_sigma``, ``noise_sigma_below``, ``noise_corr`` and ``noise_white`` (fitted on all
        rows, those of the steps up to ``noise_knee_s``), ``noise_knee_s`` and ``noise_floor`` (:func:`noise_size`),
        ``r2`` and ``mape`` on all rows, ``heldout_mape`` of a fit on the other rows, and ``points``.
    """
    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    fit = _nonneg_relative_lstsq if loss == "l2" else _nonneg_relative_l1
    raw = np.asarray(rows, dtype=float)
    if runs is not None:
        if len(runs) != len(raw):
            raise ValueError(f"runs must label every row: {len(runs)} labels for {len(raw)} rows")
        runs = np.asarray(runs)[raw[:, 2] > 0]
    data = _with_split(raw)
    alone = prefill_alone and data.shape[1] >= 5 and _alone_and_beside(data)
    if alone:  # L after the counts (P, K, t, D, C, Q, F), Q and F 0 where the rows lack them
        data = np.column_stack([data] + [np.zeros(len(data))] * (7 - data.shape[1])
                               + [(data[:, 3] == 0) & (data[:, 4] > 0)])
    after_at = max(7, data.shape[1])  # where A and B go, when fitted
    decay, after_gain = None, None
    if after_prefill and data.shape[1] >= 5 and (data[:, 0] > 0).sum() >= MIN_SPLIT_ROWS:
        data, decay, after_gain = _with_after_prefill(data, fit, loss, after_prefill_tokens, runs)
    idx = np.random.default_rng(seed).permutation(len(data))
    n_test = max(1, int(round(heldout_fraction * len(data)))) if len(data) >= 8 else 0
    test, train = idx[:n_test], idx[n_test:]
    coef_train = fit(data[train])
    coef = fit(data)
    pred = _predict(coef, data)
    t = data[:, 2]
    r2 = 1.0 - float(np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2))
    mape = float(np.mean(np.abs(pred - t) / t))
    heldout = mape
    if n_test:
        heldout = float(np.mean(np.abs(_predict(coef_train, data[test]) - data[test, 2]) / data[test, 2]))
    split = data.shape[1] >= 4
    ratios = t / pred if runs is None else _within_runs(t / pred, runs)
    knee, floor = noise_size(ratios, pred, runs) if noise_by_length else (0.0, 0.0)
    if knee:  # the short steps' noise: each residual over its length's share of the sigma
        ratios = ratios ** (1.0 / _noise_scales(pred, knee, floor))
    corr, white = noise_wander(ratios)
    after_s = float(coef[after_at]) if decay is not None else 0.0
    after_token_s = float(coef[after_at + 1]) if decay is not None else 0.0
    terms = _optional_terms(raw, data, coef, alone, prefill_alone, after_prefill, after_prefill_tokens, decay,
                            after_gain, after_s, after_token_s, ratios, corr, white, knee, noise_by_length)
    return {"base_s": float(coef[0]), "per_token_s": float(coef[1]), "per_kv_token_s": float(coef[2]),
            "per_decode_token_s": float(coef[3]) if split else None,
            "per_prefill_s": float(coef[4]) if data.shape[1] >= 5 else 0.0,
            "per_prefill_pair_s": float(coef[5]) if data.shape[1] >= 6 else 0.0,
            "per_first_decode_s": float(coef[6]) if data.shape[1] >= 7 else 0.0,
            "per_prefill_alone_s": float(coef[7]) if alone else 0.0,
            "per_after_prefill_s": after_s, "per_after_prefill_token_s": after_token_s,
            "after_prefill_decay": decay if (after_s or after_token_s) and decay is not None else 0.0,
            "noise_sigma": noise_sigma(ratios), "noise_sigma_below": noise_sigma_below(ratios),
            "noise_corr": corr, "noise_white": white, "noise_knee_s": knee, "noise_floor": floor, "loss": loss,
            "r2": r2, "mape": mape, "median_ape": float(np.median(np.abs(pred - t) / t)),
            "heldout_mape": heldout, "heldout_points": int(n_test), "points": len(data),
            "by_kind": residuals_by_kind(data, pred), "optional_terms": terms}


def fit_core(rows) -> dict | None:
    """The step model's core alone, fitted by least squares on relative error (non-negative): the
    terms the controllers' fluid bound reads, quickly enough to refit while serving
    (``engine.sim.online``). No optional term and no noise: the fitted line is near the mean step,
    the step the bound wants.

    :param rows: ``(new tokens, KV tokens read, seconds, decodes, prefill chunks)`` of timed steps
        (rows with no time are dropped).
    :return: ``base_s``, ``per_token_s``, ``per_kv_token_s``, ``per_decode_token_s`` (None where the
        rows cannot tell prefill from decode tokens: ``MIN_SPLIT_ROWS`` of each are needed),
        ``per_prefill_s`` (0 without a split), ``mape`` and ``points``; None for fewer than 8 timed rows.
    """
    data = _with_split(np.asarray(rows, dtype=float))
    if len(data) < 8:
        return None
    coef = _nonneg_relative_lstsq(data)
    pred = _predict(coef, data)
    t = data[:, 2]
    split = data.shape[1] >= 4
    return {"base_s": float(coef[0]), "per_token_s": float(coef[1]), "per_kv_token_s": float(coef[2]),
            "per_decode_token_s": float(coef[3]) if split else None,
            "per_prefill_s": float(coef[4]) if data.shape[1] >= 5 else 0.0,
            "mape": float(np.mean(np.abs(pred - t) / t)), "points": len(data)}


def residuals_by_kind(data: np.ndarray, pred: np.ndarray) -> dict:
    """The fit's error on each kind of step, so that a term the model lacks shows as a number: per kind
    (decode only, prefill only, prefill beside decodes where the rows say their decodes; else single-token
    against longer steps) its ``steps``, ``mape`` and ``bias``, the median of measured over predicted
    less 1 (positive: the model predicts those steps too short)."""
    t = data[:, 2]
    if data.shape[1] >= 4:  # (P, K, t, D, ...): P prefill tokens, D decodes
        prefill, decodes = data[:, 0] > 0, data[:, 3] > 0
        kinds = {"decode only": decodes & ~prefill, "prefill only": prefill & ~decodes,
                 "prefill beside decodes": prefill & decodes}
    else:
        kinds = {"single token": data[:, 0] == 1, "several tokens": data[:, 0] > 1}
    out = {}
    for name, mask in kinds.items():
        if mask.any():
            ratio = t[mask] / pred[mask]
            out[name] = {"steps": int(mask.sum()), "mape": float(np.mean(np.abs(1.0 / ratio - 1.0))),
                         "bias": float(np.median(ratio) - 1.0)}
    return out


def _optional_terms(raw: np.ndarray, data: np.ndarray, coef: np.ndarray, alone: bool, prefill_alone: bool,
                    after_prefill: bool, after_prefill_tokens: bool, decay: float | None, after_gain: float | None,
                    after_s: float, after_token_s: float, ratios: np.ndarray, corr: float, white: float,
                    knee: float, noise_by_length: bool) -> dict:
    """Which of the optional terms (``engine.core.profile.StepExtras``) a fit took, and why: per
    term ``{"taken": bool, "why": one sentence}`` (the rule each follows is in docs/PROFILES.md)."""
    def term(taken: bool, why: str) -> dict:
        return {"taken": bool(taken), "why": why}

    def counted(col: int, count: str) -> dict:  # a term of its own count, Q or F: column col of the rows
        if raw.shape[1] <= col:
            return term(False, f"the rows do not say {count}")
        if data.shape[1] <= col:
            return term(False, f"too few rows to tell prefill from decode costs ({MIN_SPLIT_ROWS} of each needed)")
        if float(coef[col]) > 0:
            return term(True, f"fitted on the rows' {count}")
        return term(False, f"the rows say {count}, and the non-negative fit put its cost at 0")

    pair = counted(5, "prefill pairs (Q)")
    first = counted(6, "first decodes (F)")
    prefill, decodes = ((data[:, 4] > 0, data[:, 3] > 0) if data.shape[1] >= 5
                        else (np.zeros(len(data), bool), np.zeros(len(data), bool)))
    n_alone, n_beside = int((prefill & ~decodes).sum()), int((prefill & decodes).sum())
    if not prefill_alone:
        alone_term = term(False, "not asked for (prefill_alone=False)")
    elif data.shape[1] < 5:
        alone_term = term(False, "the rows do not say their prefill chunks (C)")
    elif not alone:
        alone_term = term(False, f"{n_alone} steps prefill alone and {n_beside} beside decodes; "
                                 f"{MIN_SPLIT_ROWS} of each are needed")
    else:
        alone_term = term(float(coef[7]) > 0, f"{n_alone} steps prefill alone and {n_beside} beside decodes "
                                              f"({MIN_SPLIT_ROWS} of each needed)"
                          + ("" if float(coef[7]) > 0 else "; the non-negative fit put its cost at 0"))
    if not after_prefill:
        after_why = "not asked for (after_prefill=False)"
    elif after_gain is None:
        after_why = (f"the rows do not say their prefill chunks (C), or fewer than {MIN_SPLIT_ROWS} "
                     f"steps prefill")
    elif decay is None:
        after_why = (f"the best decay cut the loss by {100 * after_gain:.2f}%, less than the "
                     f"{100 * AFTER_MIN_GAIN:g}% needed")
    else:
        after_why = (f"decay {decay:g} cut the loss by {100 * after_gain:.2f}% "
                     f"({100 * AFTER_MIN_GAIN:g}% needed)")
    return {
        "per_prefill_pair_s": pair,
        "per_first_decode_s": first,
        "per_after_prefill_s": term(after_s > 0, after_why),
        "after_prefill_decay": term(decay is not None and bool(after_s or after_token_s), after_why),
        "per_after_prefill_token_s": term(after_token_s > 0, after_why if after_prefill_tokens or not after_prefill
                                          else "not asked for (after_prefill_tokens=False)"),
        "per_prefill_alone_s": alone_term,
        **_noise_terms(ratios, corr, white, knee, noise_by_length),
    }


def _noise_terms(ratios: np.ndarray, corr: float, white: float, knee: float, noise_by_length: bool) -> dict:
    """``_optional_terms`` of the noise's shape."""
    def term(taken: bool, why: str) -> dict:
        return {"taken": bool(taken), "why": why}

    steps = len(noise_residuals(ratios))
    if corr:
        wander_why = (f"lag-one correlation (1 - w) rho = {(1.0 - white) * corr:.3f} over {steps} steps "
                      f"({NOISE_ACF_FLOOR:g} and {NOISE_MIN_STEPS} steps needed)")
    elif steps < NOISE_MIN_STEPS:
        wander_why = f"{steps} steps, fewer than the {NOISE_MIN_STEPS} needed"
    else:
        wander_why = f"the fitted lag-one correlation is below {NOISE_ACF_FLOOR:g}: independent steps"
    if knee:
        size_why = (f"the noise falls with the step's length, significant at {NOISE_SIZE_SIGNIFICANCE:g} "
                    f"(F test against one sigma)")
    elif not noise_by_length:
        size_why = "not asked for (noise_by_length=False)"
    else:
        size_why = (f"fewer than 4 length bins of {NOISE_BIN_MIN} steps, or the curve's cut is not "
                    f"significant at {NOISE_SIZE_SIGNIFICANCE:g}: one sigma for every length")
    below = noise_sigma_below(ratios)
    return {
        "noise_corr": term(corr > 0, wander_why),
        "noise_white": term(corr > 0 and white > 0, wander_why if corr else "no wander (noise_corr 0), so no share"),
        "noise_sigma_below": term(len(_logs(ratios)) >= 2,
                                  f"the median distance below the median of {len(_logs(ratios))} steps "
                                  f"(sigma {below:.3g} below against {noise_sigma(ratios):.3g} above)"),
        "noise_knee_s": term(knee > 0, size_why),
        "noise_floor": term(knee > 0, size_why),
    }


def _alone_and_beside(data: np.ndarray) -> bool:
    """Whether ``data`` (``(P, K, t, D, C, ...)`` rows) has ``MIN_SPLIT_ROWS`` or more steps that
    prefill with no decodes and as many that prefill beside decodes: without both, the cost of a
    prefill alone cannot be told from that of a prefill chunk."""
    prefill, decodes = data[:, 4] > 0, data[:, 3] > 0
    return bool((prefill & ~decodes).sum() >= MIN_SPLIT_ROWS and (prefill & decodes).sum() >= MIN_SPLIT_ROWS)


def _with_after_prefill(data: np.ndarray, fit, loss: str, tokens: bool = True,
                        runs=None) -> tuple[np.ndarray, float | None, float]:
    """``data`` as ``(P, K, t, D, C, Q, F[, L], A, B)`` (Q and F 0 where the rows lack them), A and B the
    weights of the prefill steps before each row and of their prefill tokens
    (``after_prefill_weights``) for the decay in ``AFTER_DECAYS`` that fits best, and that decay;
    ``data`` unchanged and None when no decay improves the fit by ``AFTER_MIN_GAIN`` or more; and the
    relative cut in the loss of the best decay tried (negative: none helped).
    Without ``tokens``, B is 0 on every row. With ``runs`` (each row's run), A and B start
    from 0 at each run's first row, as a simulation's do."""
    base = np.column_stack([data] + [np.zeros(len(data))] * (7 - data.shape[1]))
    prefill = data[:, 0] if tokens else np.zeros(len(data))
    prefilled = data[:, 0] > 0

    def score(d: np.ndarray) -> float:
        rel = (d[:, 2] - _predict(fit(d), d)) / d[:, 2]
        return float(np.mean(np.abs(rel)) if loss == "l1" else np.mean(rel * rel))

    without = best = score(data)
    best_data, best_decay, lowest = data, None, np.inf
    threshold = best * (1.0 - AFTER_MIN_GAIN)
    for decay in AFTER_DECAYS:
        candidate = np.column_stack([base, _run_weights(prefilled, decay, runs),
                                     _run_weights(prefill, decay, runs)])
        got = score(candidate)
        lowest = min(lowest, got)
        if got < min(best, threshold):
            best, best_data, best_decay = got, candidate, decay
    return best_data, best_decay, float(1.0 - lowest / without) if without > 0 else 0.0


def _run_weights(values: np.ndarray, decay: float, runs) -> list[float]:
    """``after_prefill_weights`` of ``values``, started again at each run's first row."""
    if runs is None:
        return after_prefill_weights(values, decay)
    out: list[float] = []
    starts = [0] + [i for i in range(1, len(runs)) if runs[i] != runs[i - 1]] + [len(runs)]
    for a, b in zip(starts, starts[1:]):
        out += after_prefill_weights(values[a:b], decay)
    return out


def _within_runs(ratios: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """``ratios`` (real / predicted step times) over the median of their own run's, each run's
    steps kept in order."""
    out = np.array(ratios, dtype=float)
    for run in dict.fromkeys(runs.tolist()):
        mine = runs == run
        logs = _logs(out[mine])
        if len(logs):
            out[mine] /= float(np.exp(np.median(logs)))
    return out


def noise_size(ratios, median_s, runs=None) -> tuple[float, float]:
    """How the noise falls with the step's length: ``(noise_knee_s, noise_floor)`` of the
    ``Profile.noise_scale`` curve that best fits (least squares on the log, each bin weighed by its
    steps) the robust sigma (1.4826 times the median absolute deviation from the bin's median) of
    the log ``ratios`` in ``NOISE_BINS`` log-spaced bins of the steps' predicted lengths
    ``median_s``; ``(0.0, 0.0)``, one sigma for every step, when fewer than four bins hold
    ``NOISE_BIN_MIN`` steps or the curve's cut in the error is not significant at
    ``NOISE_SIZE_SIGNIFICANCE`` (the F test of nested least squares: the bins' sigmas scatter
    more than their step counts say when the noise is correlated from step to step, and the test
    judges the cut against the curve's own residuals, not against the counts). With ``runs`` (each
    step's run), a bin's deviations are each run's from its own median in the bin: a machine that
    ran slower in one run slowed its short steps more than its long ones, and taking out one
    median per run would leave that difference in the long steps' spread."""
    r = np.asarray(ratios, dtype=float)
    t = np.asarray(median_s, dtype=float)
    keep = np.isfinite(r) & (r > 0) & np.isfinite(t) & (t > 0)
    logs, t = np.log(r[keep]), t[keep]
    labels = np.zeros(len(t), dtype=int) if runs is None else np.unique(np.asarray(runs)[keep], return_inverse=True)[1]
    if len(t) < 2 * NOISE_BIN_MIN or t.max() <= t.min():
        return 0.0, 0.0
    edges = np.geomspace(t.min(), t.max(), NOISE_BINS + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, NOISE_BINS - 1)
    lengths, sigmas, counts = [], [], []
    for b in range(NOISE_BINS):
        x, run = logs[which == b], labels[which == b]
        if len(x) >= NOISE_BIN_MIN:
            deviations = np.concatenate([x[run == k] - np.median(x[run == k]) for k in np.unique(run)])
            mad = float(np.median(np.abs(deviations)))
            if mad > 0:
                lengths.append(float(np.median(t[which == b])))
                sigmas.append(np.log(1.4826 * mad))
                counts.append(len(x))
    if len(lengths) < 4:
        return 0.0, 0.0
    at, log_s, n = np.array(lengths), np.array(sigmas), np.array(counts, dtype=float)
    knees = np.geomspace(at.min(), at.max(), 40)[:, None, None]
    floors = np.linspace(0.0, 1.0, 41)[None, :, None]
    resid = log_s - np.log(_noise_scales(at[None, None, :], knees, floors))
    resid -= (resid * n).sum(axis=2, keepdims=True) / n.sum()  # the short steps' sigma, best for each curve
    err = (n * resid ** 2).sum(axis=2)
    flat = float((n * (log_s - (log_s * n).sum() / n.sum()) ** 2).sum())
    k, f = np.unravel_index(int(np.argmin(err)), err.shape)
    dof = len(lengths) - 3  # the curve fits three: the short steps' sigma, the knee and the floor
    best = float(err[k, f])
    significant = flat > best and (best <= 0.0 or (flat - best) / 2.0 / (best / dof)
                                   > f_dist.ppf(1.0 - NOISE_SIZE_SIGNIFICANCE, 2, dof))
    if not significant or floors[0, f, 0] >= 1.0:
        return 0.0, 0.0
    return float(knees[k, 0, 0]), float(floors[0, f, 0])


def _noise_scales(median_s: np.ndarray, knee, floor) -> np.ndarray:
    """``Profile.noise_scale`` of each predicted step length (``knee`` and ``floor`` may be arrays
    that broadcast with it)."""
    ratio = np.minimum(1.0, knee / np.maximum(median_s, 1e-300))
    return np.sqrt(floor * floor + (1.0 - floor * floor) * ratio * ratio)


def noise_sigma(ratios) -> float:
    """The sigma above the median: the median distance of the log ``ratios`` (real / predicted step
    times) above their median from it, over a half-normal's median (0.6745)."""
    return _half_sigma(ratios, above=True)


def noise_sigma_below(ratios) -> float:
    """The sigma below the median, as :func:`noise_sigma` from the ratios below it."""
    return _half_sigma(ratios, above=False)


def _half_sigma(ratios, above: bool) -> float:
    logs = _logs(ratios)
    if len(logs) < 2:
        return 0.0
    mid = np.median(logs)
    side = logs[logs > mid] - mid if above else mid - logs[logs < mid]
    return min(float(np.median(side)) / _HALF_NORMAL_MEDIAN, MAX_NOISE_SIGMA) if len(side) else 0.0


def noise_wander(ratios) -> tuple[float, float]:
    """``(noise_corr, noise_white)``: the AR(1) correlation ``rho`` and the share ``w`` of fresh
    noise whose variance-time curve (:func:`span_variance_model`) fits that of the logs of
    ``ratios`` (in the order the steps ran, :func:`span_variances` of :func:`noise_residuals`)
    over the spans of ``NOISE_SPANS`` that the steps fill 8 times or more (least squares on its
    log). A request's TPOT is the mean of its decode steps, so this is the figure the noise has
    to get right; the correlation at each lag is a means to it. At low correlation rho and w
    trade off against each other (several pairs draw nearly the same curve); the curve itself
    is what the fit gets right. ``(0.0, 0.0)``, independent steps, on fewer than
    ``NOISE_MIN_STEPS`` steps or when the fitted correlation at lag one, ``(1 - w) rho``, is below
    ``NOISE_ACF_FLOOR``."""
    x = noise_residuals(ratios)
    spans = [m for m in NOISE_SPANS if 8 * m <= len(x)]
    if len(x) < NOISE_MIN_STEPS or not spans or not np.any(x):
        return 0.0, 0.0
    measured = np.log(np.maximum(span_variances(x, spans), 1e-12))
    at = np.asarray(spans, dtype=float)
    sums = _wander_sums(_WANDER_RHOS, spans)  # per rho and span
    model = (1.0 + 2.0 * (1.0 - _WANDER_WHITES[None, :, None]) * sums[:, None, :]) / at[None, None, :]
    err = ((np.log(model) - measured) ** 2).sum(axis=2)
    i, j = np.unravel_index(int(np.argmin(err)), err.shape)
    corr, white = float(_WANDER_RHOS[i]), float(_WANDER_WHITES[j])
    if (1.0 - white) * corr < NOISE_ACF_FLOOR:  # lag one's correlation: independent steps, as far as they tell
        return 0.0, 0.0
    return min(corr, MAX_NOISE_CORR), white


def noise_residuals(ratios) -> np.ndarray:
    """The logs of ``ratios`` (real / predicted step times, in the order the steps ran) less their
    median, a stall clipped at 5 robust sigmas (it counts as a large step, not more), then less
    their mean: what the noise's correlation is fitted on (finite positive ratios only)."""
    logs = _logs(ratios)
    if not len(logs):
        return logs
    mad = float(np.median(np.abs(logs - np.median(logs))))
    bound = 5.0 * (1.4826 * mad or 1.0)
    x = np.clip(logs - np.median(logs), -bound, bound)
    return x - x.mean()


def span_variances(x: np.ndarray, spans) -> np.ndarray:
    """The variance of the mean of m successive values of ``x`` (every window of m) over that of
    one value, for each m in ``spans``."""
    x = np.asarray(x, dtype=float)
    sums = np.concatenate([[0.0], np.cumsum(x)])
    var = float(np.var(x))
    return np.array([float(np.var((sums[m:] - sums[:-m]) / m)) / var if var > 0 else 0.0 for m in spans])


def span_variance_model(corr: float, white: float, spans) -> np.ndarray:
    """Under the noise model (an AR(1) series of correlation ``corr`` plus a fresh share
    ``white``), the variance of the mean of m successive steps over that of one, for each m in
    ``spans``: ``(1 + 2 (1 - w) sum_{k<m} (1 - k/m) rho^k) / m``."""
    at = np.asarray(spans, dtype=float)
    return (1.0 + 2.0 * (1.0 - white) * _wander_sums(np.array([corr]), spans)[0]) / at


def _wander_sums(rhos: np.ndarray, spans) -> np.ndarray:
    """``sum_{k<m} (1 - k/m) rho^k`` for each rho (rows) and span m (columns)."""
    at = np.asarray(spans, dtype=float)
    lags = np.arange(1, int(max(spans)))[None, None, :]
    weights = np.clip(1.0 - lags / at[None, :, None], 0.0, None)  # (1 - k/m) for k < m, 0 beyond
    return (weights * np.asarray(rhos, dtype=float)[:, None, None] ** lags).sum(axis=2)


def _logs(ratios) -> np.ndarray:
    r = np.asarray(ratios, dtype=float)
    return np.log(r[np.isfinite(r) & (r > 0)])


def profile_fields(fit: dict, noise: bool = True) -> dict:
    """The ``Profile`` fields a fit sets: the coefficients, and with ``noise`` its noise sigma, which
    assumes the model is the median step (the ``l1`` fit; an ``l2`` fit gets none).

    ``idle_s``, the simulator's tick while nothing can run, is None (``base_s``), unless the fixed
    cost per step came out 0 (on few steps, the costs per decode or per prefill can take all of
    it): then it is the cheapest positive cost of one token, a decode's or any token's, since an
    engine loop that does no work takes no longer than one that does the least, and a tick of 0
    would never advance the clock (a fit with no positive cost at all is left for ``Profile`` to
    refuse).
    """
    fields = {k: fit[k] for k in ("base_s", "per_token_s", "per_kv_token_s")}
    fields["per_decode_token_s"] = fit.get("per_decode_token_s")
    one_token = [c for c in (fields["per_decode_token_s"], fields["per_token_s"]) if c is not None and c > 0]
    fields["idle_s"] = float(min(one_token)) if not fields["base_s"] and one_token else None
    fields["per_prefill_s"] = fit.get("per_prefill_s", 0.0)
    fields["per_prefill_pair_s"] = fit.get("per_prefill_pair_s", 0.0)
    fields["per_first_decode_s"] = fit.get("per_first_decode_s", 0.0)
    fields["per_prefill_alone_s"] = fit.get("per_prefill_alone_s", 0.0)
    fields["per_after_prefill_s"] = fit.get("per_after_prefill_s", 0.0)
    fields["after_prefill_decay"] = fit.get("after_prefill_decay", 0.0)
    fields["per_after_prefill_token_s"] = fit.get("per_after_prefill_token_s", 0.0)
    with_noise = noise and fit.get("loss") == "l1"
    fields["noise_sigma"] = fit.get("noise_sigma", 0.0) if with_noise else 0.0
    fields["noise_corr"] = fit.get("noise_corr", 0.0) if with_noise and fields["noise_sigma"] else 0.0
    fields["noise_white"] = fit.get("noise_white", 0.0) if fields["noise_corr"] else 0.0
    fields["noise_sigma_below"] = fit.get("noise_sigma_below") if with_noise and fields["noise_sigma"] else None
    sized = with_noise and fields["noise_sigma"] and fit.get("noise_knee_s")
    fields["noise_knee_s"] = fit["noise_knee_s"] if sized else 0.0
    fields["noise_floor"] = fit.get("noise_floor", 0.0) if sized else 0.0
    return fields


def _with_split(data: np.ndarray) -> np.ndarray:
    """Rows with a time, as ``(T, K, t)`` or, where prefill and decode costs can be told apart,
    ``(P, K, t, D)`` (P = T - D prefill tokens), with the prefill chunks C as a fifth column,
    their pairs Q as a sixth and the first decodes F as a seventh where rows say them."""
    data = data[data[:, 2] > 0]
    if data.shape[1] < 4:
        return data[:, :3]
    decodes = np.minimum(data[:, 3], data[:, 0])
    prefill = data[:, 0] - decodes
    if (prefill > 0).sum() < MIN_SPLIT_ROWS or (decodes > 0).sum() < MIN_SPLIT_ROWS:
        return data[:, :3]
    if data.shape[1] >= 5:
        cols = [prefill, data[:, 1], data[:, 2], decodes, np.minimum(data[:, 4], prefill)]
        cols += [data[:, 5]] if data.shape[1] >= 6 else []
        cols += [np.minimum(data[:, 6], decodes)] if data.shape[1] >= 7 else []
        return np.column_stack(cols)
    return np.column_stack([prefill, data[:, 1], data[:, 2], decodes])


def binned_samples(rows, max_bins: int = 120) -> list[dict]:
    """Median step time per (T, K) cell of a log grid: a compact record of thousands of steps."""
    groups: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for t, k, s, *_ in rows:
        key = (int(np.log2(max(t, 1)) * 2), int(np.log2(max(k, 1)) * 2))
        groups.setdefault(key, []).append((t, k, s))
    out = []
    for key in sorted(groups, key=lambda kk: -len(groups[kk]))[:max_bins]:
        g = groups[key]
        out.append({"tokens": float(np.median([x[0] for x in g])),
                    "kv_tokens_read": float(np.median([x[1] for x in g])),
                    "step_s": float(np.median([x[2] for x in g])), "steps": len(g)})
    return sorted(out, key=lambda d: (d["tokens"], d["kv_tokens_read"]))


def _design(data) -> np.ndarray:
    """The regressors of ``Profile.step_time_s`` for each row: ``[1, T, K]``, ``[1, P, K, D]``,
    and on up to ``[1, P, K, D, C, Q, F, L, A, B]`` (L where fitted)."""
    cols = [np.ones(len(data)), data[:, 0], data[:, 1]]
    cols += [data[:, i] for i in range(3, data.shape[1])]
    return np.column_stack(cols)


def _predict(coef, data) -> np.ndarray:
    """Step times the coefficients ``(base_s, per_token_s, per_kv_token_s[, per_decode_token_s[, per_prefill_s[,
    per_prefill_pair_s[, per_first_decode_s[, per_prefill_alone_s][, per_after_prefill_s,
    per_after_prefill_token_s]]]]])``
    predict for the rows while fitting (the linear model being fitted; a finished fit becomes a ``Profile``)."""
    return _design(data) @ coef


def _nonneg_relative_l1(data, iterations: int = 60) -> np.ndarray:
    """The median step, by iteratively reweighted least squares (non-negative): at the fixed point
    each row's residual counts by its sign only, relative to the prediction, so the ratio t / pred
    has median 1 (least absolute relative error, sum |t - pred| / t, would sit below the median)."""
    y = data[:, 2]
    coef = _nonneg_relative_lstsq(data)
    for _ in range(iterations):
        pred = np.maximum(_predict(coef, data), 1e-12)
        rel = np.abs(pred - y) / pred
        new = _nonneg_relative_lstsq(data, extra_weight=y / pred / np.sqrt(np.maximum(rel, 1e-4)))
        if np.allclose(new, coef, rtol=1e-6, atol=1e-12):
            return new
        coef = new
    return coef


def _nonneg_relative_lstsq(data, extra_weight=None) -> np.ndarray:
    """Least squares on relative error; a coefficient that comes out negative is fixed at 0."""
    x = _design(data)
    y = data[:, 2]
    w = 1.0 / y if extra_weight is None else extra_weight / y
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]  # a count no row has stays at 0
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef = np.zeros(x.shape[1])
            coef[active] = np.maximum(sol, 0)
            return coef
        active.pop(int(np.argmin(sol)))
