"""The figures themselves: per table (top shares, recurrence, power law), across tables (hot rows,
correlation) and over time (top-value overlap of consecutive chunks).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from slipcache.data.stats.counting import HASH_SPACE, Histogram

TOP_FRACTIONS = (0.001, 0.01, 0.05)
FIT_POINTS = 40
MIN_FIT_VALUES = 5


def table_figures(
    counts: np.ndarray, weights: np.ndarray, rows: int, missing_count: int | None
) -> dict[str, Any]:
    """Per-table figures from the counts of (kept) values, each standing for `weights` values."""
    order = np.argsort(-counts, kind="stable")
    counts, weights = counts[order].astype(np.float64), weights[order]
    distinct = float(weights.sum())
    cum = np.cumsum(weights)
    cum_lookups = np.cumsum(counts * weights)
    top = {}
    for fraction in TOP_FRACTIONS:
        k = max(1.0, math.ceil(fraction * distinct - 1e-9))
        i = int(np.searchsorted(cum, k))  # the value that holds rank k
        if i >= len(counts):
            top[fraction_name(fraction)] = 1.0 if rows else None
            continue
        before = float(cum_lookups[i - 1]) if i else 0.0
        rank_before = float(cum[i - 1]) if i else 0.0
        top[fraction_name(fraction)] = (before + (k - rank_before) * counts[i]) / rows
    recurring = counts >= 2
    return {
        "distinct": distinct,
        "missing_rate": None if missing_count is None else missing_count / rows,
        "top_share": top,
        "recur_share": float((counts * weights)[recurring].sum()) / rows,
        "singleton_share": float(weights[counts == 1].sum()) / distinct if distinct else None,
        "power_law_exponent": _fit_power_law(
            counts[recurring], cum[recurring] - (weights[recurring] - 1) / 2
        ),
        "rank_frequency": _rank_frequency(counts, cum - (weights - 1) / 2),
    }


def fraction_name(fraction: float) -> str:
    """0.01 -> '1%': the keys of `top_share`."""
    return f"{fraction * 100:g}%"


def _log_spaced(ranks: np.ndarray, points: int) -> np.ndarray:
    """Indices of the values at about `points` log-spaced ranks (unique, ascending)."""
    targets = np.geomspace(1.0, float(ranks[-1]), points)
    return np.unique(np.minimum(np.searchsorted(ranks, targets), len(ranks) - 1))


def _fit_power_law(counts: np.ndarray, ranks: np.ndarray) -> float | None:
    """s of count ~ rank^-s: least squares in log-log at log-spaced ranks (`counts` descending)."""
    if len(counts) < MIN_FIT_VALUES:
        return None
    idx = _log_spaced(ranks, FIT_POINTS)
    if len(idx) < 3:
        return None
    slope = np.polyfit(np.log(ranks[idx]), np.log(counts[idx]), 1)[0]
    return float(-slope)


def _rank_frequency(counts: np.ndarray, ranks: np.ndarray) -> list[list[float]]:
    """[rank, count] at log-spaced ranks: the curve, small enough for JSON and plots."""
    if not len(counts):
        return []
    idx = _log_spaced(ranks, FIT_POINTS)
    return [[float(ranks[i]), float(counts[i])] for i in idx]


def hot_threshold(histograms: list[Histogram], rows_budget: int) -> tuple[int, float, float]:
    """(count threshold t, hash cutoff h, estimated lookups on hot rows) of the top `rows_budget` values:
    a value is hot iff count > t, or count == t and hash <= h."""
    counts = np.concatenate([h.counts for h in histograms])
    weights = np.concatenate([h.weights for h in histograms])
    if weights.sum() <= rows_budget:
        return 0, float(HASH_SPACE), float((counts * weights).sum())
    uniq, inverse = np.unique(-counts, return_inverse=True)  # descending counts
    per_count = np.bincount(inverse, weights=weights)
    cum = np.cumsum(per_count)
    i = int(np.searchsorted(cum, rows_budget))
    t = int(-uniq[i])
    needed = rows_budget - (float(cum[i - 1]) if i else 0.0)
    hot_lookups = float((counts * weights)[counts > t].sum()) + needed * t
    if all(h.hashes is not None for h in histograms):  # exact: the `needed` tied values of smallest hash
        tied = np.concatenate([h.hashes[h.counts == t] for h in histograms])  # type: ignore[index]
        k = int(round(needed))
        cutoff = float(np.partition(tied, k - 1)[k - 1]) if k >= 1 else -1.0
    else:  # estimated: the same share of tied values, by hash
        cutoff = needed / float(per_count[i]) * HASH_SPACE
    return t, cutoff, hot_lookups


def pearson(indicators: np.ndarray) -> np.ndarray:
    """Correlation matrix of 0/1 columns; NaN where a column is constant."""
    x = indicators.astype(np.float64)
    x -= x.mean(axis=0)
    norms = np.sqrt((x * x).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x.T @ x) / np.outer(norms, norms)


def chunk_top_overlap(
    values: np.ndarray, counts: np.ndarray, hashes: np.ndarray, previous: np.ndarray | None, top_k: int
) -> tuple[float | None, np.ndarray]:
    """(overlap with the previous chunk's top values, this chunk's top values by count, then hash)."""
    recurring = counts >= 2
    values, counts, hashes = values[recurring], counts[recurring], hashes[recurring]
    order = np.lexsort((hashes, -counts))[:top_k]
    top = values[order]
    if previous is None:
        return None, top
    k = min(len(top), len(previous))
    if k == 0:
        return None, top
    return len(np.intersect1d(top[:k], previous[:k])) / k, top


def over_time_figures(chunks: list[dict[str, Any]], big: list[int]) -> dict[str, Any]:
    """Per-chunk series; chunk 0 has every id new and no predecessor, so summaries start at chunk 1."""
    for chunk in chunks:
        overlaps = [chunk["top_overlap_per_table"][t] for t in big]
        overlaps = [o for o in overlaps if o is not None]
        chunk["top_overlap_big_tables"] = float(np.mean(overlaps)) if overlaps else None
        chunk["new_id_rate_big_tables"] = float(np.mean([chunk["new_id_rate_per_table"][t] for t in big]))
    later = chunks[1:]
    new_rates = [c["new_id_rate"] for c in later]
    overlaps = [c["top_overlap_big_tables"] for c in later if c["top_overlap_big_tables"] is not None]
    return {
        "chunks": chunks,
        "new_id_rate_mean": float(np.mean(new_rates)) if new_rates else None,
        "new_id_rate_last": new_rates[-1] if new_rates else None,
        "new_id_rate_big_tables_mean": float(np.mean([c["new_id_rate_big_tables"] for c in later]))
        if later
        else None,
        "top_overlap_big_tables_mean": float(np.mean(overlaps)) if overlaps else None,
    }
