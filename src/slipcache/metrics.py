"""Binary-classification metrics for CTR models: AUC, log loss, accuracy, normalized entropy.

All functions take numpy arrays of labels in {0, 1} and predicted probabilities (AUC accepts any
scores). They are exact: evaluation sets of a few million rows sort in well under a second, so no
binned approximation is needed.
"""

from __future__ import annotations

import math

import numpy as np

# Probabilities are clipped to [EPS, 1 - EPS] before taking logs, so one confidently wrong prediction
# costs at most -log(EPS) ~ 16 nats instead of infinity.
EPS = 1e-7


def _as_arrays(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.shape[0]} vs {s.shape[0]}")
    return y, s


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC via the rank-sum (Mann-Whitney U) statistic; tied scores share their average rank.

    Equals the probability that a random positive scores above a random negative, ties counting 1/2.
    O(n log n). Returns nan when only one class is present (AUC is undefined then).
    """
    y, s = _as_arrays(labels, scores)
    n_pos = float((y > 0.5).sum())
    n_neg = float(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_scores = s[order]
    # Average 1-based rank of every run of equal scores.
    run_starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    run_ends = np.r_[run_starts[1:], s.size]  # exclusive
    run_rank = (run_starts + run_ends + 1) / 2.0  # mean of ranks start+1 .. end
    ranks_sorted = np.repeat(run_rank, run_ends - run_starts)
    pos_rank_sum = ranks_sorted[y[order] > 0.5].sum()
    return float((pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy in nats, with probabilities clipped to [EPS, 1 - EPS]."""
    y, p = _as_arrays(labels, probs)
    if y.size == 0:
        return float("nan")
    p = np.clip(p, EPS, 1.0 - EPS)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def accuracy(labels: np.ndarray, probs: np.ndarray, threshold: float = 0.5) -> float:
    """Fraction of samples whose thresholded prediction (p > threshold) equals the label."""
    y, p = _as_arrays(labels, probs)
    if y.size == 0:
        return float("nan")
    return float(np.mean((p > threshold) == (y > 0.5)))


def binary_entropy(rate: float) -> float:
    """Entropy in nats of a Bernoulli(rate) label: the log loss of always predicting `rate`."""
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1.0 - rate) * math.log(1.0 - rate))


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
    """Log loss divided by the entropy of the positive rate of the *evaluated* set (He et al. 2014).

    Below 1 means the model beats predicting the set's own click rate for everyone; the base rate is
    measured on the same labels being scored, not on the training set. nan if that set has one class.
    """
    y, _ = _as_arrays(labels, probs)
    base = binary_entropy(float(y.mean())) if y.size else 0.0
    if base == 0.0:
        return float("nan")
    return log_loss(labels, probs) / base


def evaluate_predictions(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """All four metrics under the names the run files use."""
    return {
        "auc": auc(labels, probs),
        "logloss": log_loss(labels, probs),
        "accuracy": accuracy(labels, probs),
        "normalized_entropy": normalized_entropy(labels, probs),
    }
