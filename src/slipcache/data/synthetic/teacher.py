"""What every generator shares: Kaggle's shape (26 tables, their sizes, dense counts) and the hidden
teacher that labels rows, calibrated to the target positive rate and AUC.
"""

from __future__ import annotations

import math

import numpy as np

from slipcache.data.dataset import NUM_DENSE
from slipcache.data.kaggle import KAGGLE_CARDINALITIES as KAGGLE_CARDINALITIES
from slipcache.data.kaggle import SMALL_TABLE as SMALL_TABLE
from slipcache.data.kaggle import kaggle_table_sizes

TARGET_POSITIVE_RATE = 0.256
TARGET_TEACHER_AUC = 0.80
HOT_ROWS = 20_000  # rows (by popularity rank) per table that carry teacher signal
TEACHER_DIM = 8
CHUNK_ROWS = 32_768
CALIBRATION_ROWS = 4 * CHUNK_ROWS
# Fraction of missing values of I1..I13 in the Kaggle training set (approximate).
DENSE_MISSING = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22]
# Share of teacher logit variance from the dense term, first-order row terms, pairwise interactions.
VARIANCE_SHARES = (0.3, 0.3, 0.4)


def synthetic_table_sizes(scale: float) -> list[int]:
    """The generators' tables: `kaggle_table_sizes(scale)` (the name the generators have always used)."""
    return kaggle_table_sizes(scale)


class Teacher:
    """What every generator shares: dense features, the teacher's logit terms and their calibration.

    Subclasses set `version` (recorded in meta.json), `first_order` [P + 1] and `vectors` [P + 1,
    TEACHER_DIM] (the last row all zero, read by values without signal) and implement `sample(rng, start, n)`.
    """

    version: int
    first_order: np.ndarray
    vectors: np.ndarray
    variance_shares: tuple[float, float, float] = VARIANCE_SHARES  # dense, first-order, pairwise

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.component_scale = np.ones(3)  # these three are set by calibrate()
        self.logit_scale = 1.0
        self.logit_bias = 0.0
        self.raw_dense = np.zeros((0, NUM_DENSE))  # raw counts of the latest `draw_dense`, NaN = missing

    def sample(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    def init_dense(self, rng: np.random.Generator) -> None:
        self.dense_mu = rng.uniform(0.0, 4.0, NUM_DENSE)
        self.dense_sigma = rng.uniform(0.8, 2.0, NUM_DENSE)
        self.dense_missing = np.array(DENSE_MISSING)
        self.dense_weights = rng.standard_normal(NUM_DENSE)

    def draw_dense(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """float32 [n, 13]: log1p of skewed counts, 0 where missing. The raw counts (NaN where missing) of
        the latest draw stay in `raw_dense`, for `slipcache stats` on generated rows."""
        counts = np.floor(
            np.exp(rng.standard_normal((n, NUM_DENSE)) * self.dense_sigma + self.dense_mu) - 0.5
        )
        missing = rng.random((n, NUM_DENSE)) < self.dense_missing
        self.raw_dense = np.where(missing, np.nan, counts)
        return dense_transform(self.raw_dense)

    def terms(self, dense: np.ndarray, params: np.ndarray) -> np.ndarray:
        """Logit terms [n, 3]: dense linear, first-order, pairwise dot products of the parameter rows
        `params` [n, k] (one per signal source)."""
        n, k = params.shape
        rows = params.ravel()
        terms = np.empty((n, 3))
        terms[:, 0] = dense.astype(np.float64) @ self.dense_weights
        terms[:, 1] = self.first_order[rows].reshape(n, k).sum(axis=1)
        vec = self.vectors[rows]
        total = vec.reshape(n, k, TEACHER_DIM).sum(axis=1)
        squares = np.einsum("ij,ij->i", vec, vec).reshape(n, k).sum(axis=1)
        terms[:, 2] = 0.5 * (np.einsum("ij,ij->i", total, total) - squares)
        return terms

    def logits(self, terms: np.ndarray) -> np.ndarray:
        return self.logit_scale * (terms @ self.component_scale) + self.logit_bias

    def calibrate(self) -> None:
        """Weigh the three logit terms by `variance_shares`, then pick scale and bias for the targets.

        Calibrated on the first CALIBRATION_ROWS rows of the log (the start of the first day)."""
        rng = np.random.default_rng([self.seed, 1])
        terms = np.concatenate(
            [self.sample(rng, i * CHUNK_ROWS, CHUNK_ROWS)[2] for i in range(CALIBRATION_ROWS // CHUNK_ROWS)]
        )
        self.component_scale = np.sqrt(np.array(self.variance_shares)) / np.maximum(terms.std(axis=0), 1e-12)
        raw = terms @ self.component_scale
        z = np.sort(raw - raw.mean())  # sorted once so expected_auc's sort is cheap
        lo, hi = 0.01, 20.0
        for _ in range(25):
            mid = math.sqrt(lo * hi)
            if expected_auc(mid * z + _bias_for_rate(mid * z, TARGET_POSITIVE_RATE)) < TARGET_TEACHER_AUC:
                lo = mid
            else:
                hi = mid
        self.logit_scale = math.sqrt(lo * hi)
        bias = _bias_for_rate(self.logit_scale * z, TARGET_POSITIVE_RATE)
        self.logit_bias = bias - self.logit_scale * float(raw.mean())


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """What a dataset stores of raw dense counts: log(1 + max(x, 0)), missing (NaN) -> 0, float32 (as
    `slipcache preprocess` does)."""
    return np.log1p(np.maximum(np.nan_to_num(raw, nan=0.0), 0.0)).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function: teacher logits to click probabilities."""
    return 1.0 / (1.0 + np.exp(-x))


def _bias_for_rate(logits: np.ndarray, rate: float) -> float:
    """The b with mean(sigmoid(logits + b)) == rate (Newton's method; the mean is increasing in b)."""
    b = math.log(rate / (1.0 - rate)) - float(np.median(logits))
    for _ in range(50):
        p = sigmoid(logits + b)
        step = (p.mean() - rate) / max(float((p * (1.0 - p)).mean()), 1e-12)
        b -= float(np.clip(step, -5.0, 5.0))
        if abs(step) < 1e-9:
            break
    return b


def expected_auc(logits: np.ndarray) -> float:
    """AUC of the teacher itself, in expectation over labels ~ Bernoulli(sigmoid(logits))."""
    p = sigmoid(np.asarray(logits, dtype=np.float64))
    order = np.argsort(logits, kind="stable")
    p, q = p[order], 1.0 - p[order]
    negatives_below = np.cumsum(q) - q
    return float((p * negatives_below).sum() / (p.sum() * q.sum() - (p * q).sum()))
