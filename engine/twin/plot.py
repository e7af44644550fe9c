"""The twin check's step-time figure: each real step against the profile's prediction."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidegate.engine.core.figures import save_png


def plot_step_times(errors: dict, path: Path, title: str) -> None:
    """Three panels: real against predicted step time per step, the spread of their ratio for
    small and large steps, and the first steps in order."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, pred = errors["real_s"] * 1e3, errors["predicted_s"] * 1e3
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax1.scatter(pred, real, s=4, alpha=0.3)
    lo = float(min(real.min(), pred.min())) * 0.9
    hi = float(max(real.max(), pred.max())) * 1.1
    ax1.plot([lo, hi], [lo, hi], color="black", lw=1, label="real = predicted")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("predicted step time (ms)")
    ax1.set_ylabel("real step time (ms)")
    ax1.set_xlim(lo, hi)
    ax1.set_ylim(lo, hi)
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    ticks = [t for t in (0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000) if lo <= t <= hi]
    for axis in (ax1.xaxis, ax1.yaxis):
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_minor_locator(NullLocator())
        axis.set_major_formatter(ScalarFormatter())
    ax1.legend(loc="upper left")
    ax1.set_title(f"per step: MAPE {100 * errors['mape']:.1f}%")
    ratio = real / pred
    small = errors["tokens"] <= 4
    bins = np.linspace(0.3, 3.0, 55)
    for sel, label in ((small, "T <= 4"), (~small, "T > 4")):
        ax3.hist(np.clip(ratio[sel], bins[0], bins[-1]), bins=bins, alpha=0.6,
                 label=f"{label} ({int(sel.sum())} steps)")
    ax3.axvline(1.0, color="black", lw=1)
    ax3.set_xlabel("real / predicted step time")
    ax3.set_ylabel("steps")
    refit = errors.get("refit_mape")
    refit_note = f" (best linear refit on these steps: MAPE {100 * refit:.1f}%)" if refit is not None else ""
    ax3.set_title("spread" + refit_note, fontsize=9)
    ax3.legend()
    n = min(len(real), 400)
    ax2.plot(real[:n], lw=1, label="real")
    ax2.plot(pred[:n], lw=1, label="predicted (profile)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time (ms)")
    ax2.set_title(f"first {n} steps")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
