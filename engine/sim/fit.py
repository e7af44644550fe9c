"""Fit the simulator's step-time model to timed steps (numpy only).

The model is ``Profile.step_time_s``: ``t = base_s + per_token_s * T + per_kv_token_s * K`` for a
step with T new tokens that reads K KV tokens. The fit keeps the coefficients non-negative and
weighs every step by its relative error, so short steps count as much as long ones. The rows
come from the profiler's grid (``engine.real.profiler``) or from serving runs
(``engine.twin.fit``).
"""

from __future__ import annotations

import numpy as np


def fit_step_time(rows, heldout_fraction: float = 0.25, seed: int = 0, loss: str = "l2") -> dict:
    """Fit ``t = a + b*T + c*K`` to ``(T, K, t)`` rows; returns coefficients and fit quality.

    :param rows: ``(new tokens, KV tokens read, seconds)`` of timed steps; rows with no time are dropped.
    :param heldout_fraction: share of the rows (at least 8 needed) held out to report ``heldout_mape``.
    :param seed: seeds the choice of held-out rows.
    :param loss: ``"l2"``: least squares on relative error; ``"l1"``: least absolute relative
        error (minimises MAPE; iteratively reweighted least squares), robust to the stalls a
        shared machine puts into a few steps.
    :return: ``base_s``, ``per_token_s``, ``per_kv_token_s`` (fitted on all rows), ``r2`` and
        ``mape`` on all rows, ``heldout_mape`` of a fit on the other rows, and ``points``.
    """
    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    fit = _nonneg_relative_lstsq if loss == "l2" else _nonneg_relative_l1
    data = np.asarray(rows, dtype=float)
    data = data[data[:, 2] > 0]
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
    return {"base_s": float(coef[0]), "per_token_s": float(coef[1]), "per_kv_token_s": float(coef[2]),
            "loss": loss, "r2": r2, "mape": mape, "median_ape": float(np.median(np.abs(pred - t) / t)),
            "heldout_mape": heldout, "heldout_points": int(n_test), "points": len(data)}


def binned_samples(rows, max_bins: int = 120) -> list[dict]:
    """Median step time per (T, K) cell of a log grid: a compact record of thousands of steps."""
    groups: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for t, k, s in rows:
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
    """The regressors of ``Profile.step_time_s`` for each row: ``[1, T, K]``."""
    return np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])


def _predict(coef, data) -> np.ndarray:
    """Step times the coefficients ``(base_s, per_token_s, per_kv_token_s)`` predict for the rows
    while fitting (the linear model being fitted; a finished fit becomes a ``Profile``)."""
    return coef[0] + coef[1] * data[:, 0] + coef[2] * data[:, 1]


def _nonneg_relative_l1(data, iterations: int = 60) -> np.ndarray:
    """Least absolute relative error by iteratively reweighted least squares (non-negative)."""
    y = data[:, 2]
    coef = _nonneg_relative_lstsq(data)
    for _ in range(iterations):
        rel = np.abs(_predict(coef, data) - y) / y
        new = _nonneg_relative_lstsq(data, extra_weight=1.0 / np.sqrt(np.maximum(rel, 1e-4)))
        if np.allclose(new, coef, rtol=1e-6, atol=1e-12):
            return new
        coef = new
    return coef


def _nonneg_relative_lstsq(data, extra_weight=None) -> np.ndarray:
    """Least squares on relative error; a coefficient that comes out negative is fixed at 0."""
    x = _design(data)
    y = data[:, 2]
    w = 1.0 / y if extra_weight is None else extra_weight / y
    active = [0, 1, 2]
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef = np.zeros(3)
            coef[active] = np.maximum(sol, 0)
            return coef
        active.pop(int(np.argmin(sol)))
