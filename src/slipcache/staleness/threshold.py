"""Fitting the staleness threshold T: a pure function of the sampled inputs' keys and the target share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ThresholdResult", "fit_threshold"]


@dataclass
class ThresholdResult:
    """Outcome of the bisection. ``threshold`` is None when the target band is unreachable (no skipping)."""

    threshold: float | None
    achieved_ratio: float  # stale fraction of the sampled hot inputs at the last threshold tried
    steps: int  # bisection midpoints evaluated
    converged: bool
    target: float
    sample_size: int
    reason: str = ""


def fit_threshold(keys: np.ndarray, target: float, tolerance: float, low: float, high: float, max_steps: int,
                  relative: bool) -> ThresholdResult:
    """Bisect T so that the share of ``keys < T`` lands in ``target +- tolerance``.

    ``keys``: per sampled hot input, the smallest T that makes it stale is just above its key (inf: never).
    ``relative``: the keys are relative scores (convergence rule), so the search runs from 0 to just above the
    largest finite key instead of over [low, high]. Pure: no state, so refits after guard actions and tests
    call it alike.
    """
    n = int(keys.size)

    def ratio(t: float) -> float:
        return float(np.count_nonzero(keys < t)) / n

    def result(t: float | None, achieved: float, steps: int, ok: bool, reason: str = "") -> ThresholdResult:
        return ThresholdResult(t, achieved, steps, ok, target, n, reason)

    if n == 0:
        return result(None, 0.0, 0, False, "no hot inputs in the threshold sample")
    lo, hi = low, high
    if relative:
        known = keys[np.isfinite(keys)]
        if not known.size:
            return result(None, 0.0, 0, False, "no sampled hot input has all its rows measured yet")
        lo, hi = 0.0, float(np.nextafter(np.float32(known.max()), np.float32(np.inf)))
    top = ratio(hi)
    if top < target - tolerance:
        return result(None, top, 0, False, f"stale fraction at T={hi} is {top:.3f} < {target - tolerance:.3f}")
    achieved = top
    for step in range(1, max_steps + 1):
        mid = 0.5 * (lo + hi)
        achieved = ratio(mid)
        if abs(achieved - target) <= tolerance:
            return result(mid, achieved, step, True)
        if achieved < target:
            lo = mid
        else:
            hi = mid
    return result(None, achieved, max_steps, False,
                  f"no T in [{low}, {high}] gives {target:.3f} +- {tolerance}")
