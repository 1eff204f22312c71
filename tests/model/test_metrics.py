import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipcache import metrics


def brute_force_auc(y: np.ndarray, s: np.ndarray) -> float:
    pos = s[y == 1]
    neg = s[y == 0]
    total = 0.0
    for p in pos:
        total += float((p > neg).sum()) + 0.5 * float((p == neg).sum())
    return total / (len(pos) * len(neg))


def test_auc_hand_computed() -> None:
    # Pairs (pos, neg): (0.8, 0.1) win, (0.8, 0.4) win, (0.35, 0.1) win, (0.35, 0.4) loss -> 3/4.
    assert metrics.auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert metrics.auc(np.array([0, 1]), np.array([0.2, 0.9])) == 1.0
    assert metrics.auc(np.array([1, 0]), np.array([0.2, 0.9])) == 0.0


def test_auc_ties_count_half() -> None:
    assert metrics.auc(np.array([0, 1, 0, 1]), np.full(4, 0.5)) == pytest.approx(0.5)
    # pos 0.5 ties neg 0.5 (1/2), beats neg 0.1 (1): 1.5 / 2.
    assert metrics.auc(np.array([1, 0, 0]), np.array([0.5, 0.5, 0.1])) == pytest.approx(0.75)


def test_auc_one_class_is_nan() -> None:
    assert math.isnan(metrics.auc(np.ones(5), np.linspace(0, 1, 5)))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=60),
)
def test_auc_matches_brute_force(pairs: list[tuple[int, int]]) -> None:
    y = np.array([p[0] for p in pairs])
    s = np.array([p[1] for p in pairs], dtype=np.float64) / 6.0  # few distinct values -> many ties
    if y.min() == y.max():
        return
    assert metrics.auc(y, s) == pytest.approx(brute_force_auc(y, s), abs=1e-12)


def test_log_loss_and_clipping() -> None:
    y = np.array([1, 0])
    p = np.array([0.8, 0.3])
    expected = -(math.log(0.8) + math.log(0.7)) / 2
    assert metrics.log_loss(y, p) == pytest.approx(expected)
    # A certain wrong prediction is clipped, not infinite.
    assert metrics.log_loss(np.array([1]), np.array([0.0])) == pytest.approx(-math.log(metrics.EPS))


def test_accuracy() -> None:
    assert metrics.accuracy(np.array([1, 0, 1, 0]), np.array([0.9, 0.2, 0.4, 0.6])) == 0.5


def test_normalized_entropy_uses_evaluated_base_rate() -> None:
    y = np.array([1, 0, 0, 0])
    # Predicting the set's own rate gives exactly 1.
    assert metrics.normalized_entropy(y, np.full(4, 0.25)) == pytest.approx(1.0)
    p = np.array([0.7, 0.1, 0.2, 0.1])
    base = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert metrics.normalized_entropy(y, p) == pytest.approx(metrics.log_loss(y, p) / base)
    assert math.isnan(metrics.normalized_entropy(np.zeros(3), np.full(3, 0.1)))


def test_evaluate_predictions_keys() -> None:
    out = metrics.evaluate_predictions(np.array([0, 1]), np.array([0.3, 0.6]))
    assert set(out) == {"auc", "logloss", "accuracy", "normalized_entropy"}


def test_length_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        metrics.auc(np.array([0, 1]), np.array([0.5]))
