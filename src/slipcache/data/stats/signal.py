"""Where a dataset's label signal and dense shapes sit: per-table target AUC, dense-feature shapes,
lookup shares by how often a value was seen, and links between tables.

Why: cache and skipping results depend on which inputs a model can learn from. A generator whose big
tables carry no memorisable signal, or whose dense features lack real zeros and tails, teaches a model
something else than real logs do. These figures hold a dataset against real rows on exactly that.

Every figure here is computed on the first ``signal_rows`` rows read (file order), kept in memory, so
compare equal row counts: target AUC grows with the rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DENSE_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
COUNT_BANDS = (("1", 1, 1), ("2-9", 2, 9), ("10-99", 10, 99), (">=100", 100, None))
# Table pairs whose link (how far the first determines the second) is reported; 0-based (C3 is 2).
LINKS = ((2, 14), (10, 12), (2, 18))
DEFAULT_SIGNAL_ROWS = 500_000  # rows kept for these figures: ~130 MB of ids, dense and labels


def auc_with_ties(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC AUC with tied scores given their average rank; None without both classes."""
    labels = np.asarray(labels) > 0.5
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return None
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)  # rank (1-based) of the last member of each tie group
    average_rank = upper - (counts - 1) / 2.0
    rank_sum = float(average_rank[inverse][labels].sum())
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)


def target_auc(values: np.ndarray, labels: np.ndarray) -> float | None:
    """How well a value's mean label over the first 5/6 of the rows predicts the last 1/6.

    Rows in file order; each value's mean label over the first part, no smoothing (a missing value is a
    value of its own); each later row scored by its value's mean, or by the first part's label rate when
    the value was not seen; the AUC of those scores, ties at their average rank.
    """
    n = len(values)
    cut = (5 * n) // 6
    if cut < 1 or cut >= n:
        return None
    first, y_first = values[:cut], np.asarray(labels[:cut], dtype=np.float64)
    uniq, inverse = np.unique(first, return_inverse=True)
    means = np.bincount(inverse, weights=y_first, minlength=uniq.size) / np.bincount(inverse, minlength=uniq.size)
    later = values[cut:]
    pos = np.minimum(np.searchsorted(uniq, later), uniq.size - 1)
    seen = uniq[pos] == later
    scores = np.where(seen, means[pos], y_first.mean())
    return auc_with_ties(scores, labels[cut:])


def lookup_share_by_count(counts: np.ndarray, weights: np.ndarray) -> dict[str, float | None]:
    """Share of a table's lookups to values seen 1, 2-9, 10-99 and >= 100 times in the sample."""
    lookups = counts.astype(np.float64) * weights
    total = float(lookups.sum())
    out: dict[str, float | None] = {}
    for name, lo, hi in COUNT_BANDS:
        band = (counts >= lo) if hi is None else ((counts >= lo) & (counts <= hi))
        out[name] = float(lookups[band].sum()) / total if total else None
    return out


def dense_figures(dense: np.ndarray, labels: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Per dense feature (I1..): missing rate (NaN), and among present values the zero and negative
    shares and quantiles; ``label_auc``: the AUC of the value itself as a score (missing below every
    value), how strong a single predictor it is. On a dataset the values are the stored ones
    (log(1 + max(x, 0)), missing 0)."""
    out = []
    for j in range(dense.shape[1]):
        x = dense[:, j].astype(np.float64)
        present = x[~np.isnan(x)]
        n = present.size
        out.append({
            "name": f"I{j + 1}",
            "missing_rate": 1.0 - n / len(x) if len(x) else None,
            "zero_share": float((present == 0).mean()) if n else None,
            "negative_share": float((present < 0).mean()) if n else None,
            "quantiles": {f"{q:g}": float(np.quantile(present, q)) for q in DENSE_QUANTILES} if n else None,
            "label_auc": None if labels is None else auc_with_ties(np.nan_to_num(x, nan=-np.inf), labels),
        })
    return out


def link_figures(cats: np.ndarray, pairs: tuple[tuple[int, int], ...] = LINKS, seed: int = 0) -> list[dict[str, Any]]:
    """How far a value of table A determines the value of table B, against chance.

    ``purity``: among rows whose A value occurs at least twice, the share whose B value is the most common
    B value of their A value; ``chance``: the same with B's column shuffled (A and B independent, each
    table's own popularity kept); ``determined``: share of those A values that come with one B value only.
    """
    rng = np.random.default_rng(seed)
    out = []
    for a, b in pairs:
        if max(a, b) >= cats.shape[1]:
            continue
        shuffled = cats[rng.permutation(len(cats)), b]
        purity, determined = _purity(cats[:, a], cats[:, b])
        chance, _ = _purity(cats[:, a], shuffled)
        out.append({"from": f"C{a + 1}", "to": f"C{b + 1}", "purity": purity, "chance": chance,
                    "determined": determined})
    return out


def _purity(a: np.ndarray, b: np.ndarray) -> tuple[float | None, float | None]:
    _, a_idx, a_counts = np.unique(a, return_inverse=True, return_counts=True)
    recurring = a_counts[a_idx] >= 2
    if not recurring.any():
        return None, None
    a_idx, b = a_idx[recurring], b[recurring]
    pairs, pair_counts = np.unique(np.stack([a_idx, b.astype(np.int64)], axis=1), axis=0, return_counts=True)
    mode = np.zeros(a_counts.size, dtype=np.int64)
    np.maximum.at(mode, pairs[:, 0], pair_counts)
    kinds = np.bincount(pairs[:, 0], minlength=a_counts.size)
    used = np.unique(a_idx)
    return float(mode[used].sum()) / a_idx.size, float((kinds[used] == 1).mean())


def signal_figures(cats: np.ndarray, dense: np.ndarray | None, labels: np.ndarray | None,
                   seed: int = 0) -> dict[str, Any]:
    """The figures above on kept rows (file order): target AUC per table, dense shapes, links."""
    return {
        "rows": int(len(cats)),
        "target_auc": None if labels is None else [target_auc(cats[:, t], labels) for t in range(cats.shape[1])],
        "dense": None if dense is None else dense_figures(dense, labels),
        "links": link_figures(cats, seed=seed) if cats.shape[1] == 26 else [],
    }
