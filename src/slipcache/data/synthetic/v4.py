"""v4, the default generator: v3's entities and time order, with the label signal, dense shapes and links
placed where the real rows have them (docs/data.md says which figures are calibrated and which chosen).

What changes against v3 (v3 stays bit for bit):
- Every user, ad and site carries teacher signal, not only the 20,000 most popular ranks, and the user's
  first-order term weighs more: the big tables' values, rare ones included, carry signal a model can
  memorise (a per-value mean label predicts held-back rows as in the real rows).
- Dense features have the real rows' shapes: a share of zeros among present values, negative values in
  I2, and a log-normal body with the real median and spread; the teacher's dense weights follow which
  features predict the label in the real rows (I1, I7, I10, I11 up; I5, I13 down).
- Ads and sites are drawn from a Zipf-Mandelbrot law (a flattened head): the top values are less hot and
  values seen 2-9 times carry more of the traffic, as in C7, C11, C13, C15, C18.
- The C19/C20/C25/C26 missing group follows the user (a per-user propensity, with a little per-row noise).
- Links: a share of a user's impressions are on the user's own site (C3 -> C15), and C13 derives from C11.

Like v3, every per-value decision is a hash, so a window of rows costs only its rows and the generator
yields independent chunks of rows (``sample(rng, start, n)``), which a streaming writer can consume.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slipcache.data.dataset import NUM_DENSE, NUM_TABLES
from slipcache.data.synthetic.teacher import HOT_ROWS, TEACHER_DIM, dense_transform
from slipcache.data.synthetic.v3 import (
    DERIVED,
    ENTITY_EXPONENT,
    ENTITY_ONE_OFF,
    ENTITY_ROOT,
    INDEPENDENT_EXPONENT,
    MISSING_GROUPS,
    MISSING_ROW,
    GeneratorV3,
    _mix,
    _unit,
    _zipf_rank,
)

# v3's derived tables, except C13 (12), which now coarsens C11 (10) as in the real rows.
DERIVED_V4: dict[int, tuple[str | int, float, float]] = {**DERIVED, 12: (10, 0.05, 0.0)}
# Zipf-Mandelbrot laws of ad and site: count ~ (rank + offset)^-s (offset 0 = v3's Zipf law).
ENTITY_LAW_V4 = {"user": (ENTITY_EXPONENT["user"], 0.0), "ad": (1.15, 40.0), "site": (1.7, 80.0)}
SITE_FROM_USER = 0.35  # share of impressions on the user's own site (a hash of the user): C3 -> C15
USER_MISSING_GROUP = 1  # index in MISSING_GROUPS of C19, C20, C25, C26: decided per user
USER_MISSING_NOISE = 0.03  # share of rows whose group is drawn per row instead
# First-order teacher weight per signal source (entities; the tables drawn on their own weigh 1).
SOURCE_WEIGHT = {"user": 10.0, "ad": 3.0, "site": 3.0}
VARIANCE_SHARES_V4 = (0.3, 0.5, 0.2)  # dense, first-order, pairwise: more on the per-value terms than v3
# Dense features, from the real rows (kaggle_train_tiny.csv, rounded): share of zeros among present
# values; median and log-spread (sigma) of the positive values.
DENSE_ZERO = (0.47, 0.18, 0.01, 0.09, 0.02, 0.07, 0.25, 0.13, 0.03, 0.51, 0.27, 0.72, 0.06)
DENSE_MEDIAN = (3.0, 16.0, 6.0, 5.0, 2900.0, 50.0, 5.0, 10.0, 47.0, 1.0, 2.0, 1.0, 6.0)
DENSE_SIGMA = (1.35, 2.4, 1.65, 1.15, 1.85, 1.55, 1.6, 1.0, 1.55, 0.55, 0.95, 1.5, 1.25)
I2_NEGATIVE = 0.11  # share of I2's present values that are negative (-1, or -2 for a tenth of them)
# Teacher weights of the log dense features: signs and rough sizes from each feature's own AUC in the real
# rows (I1 0.62, I7 0.65, I10 0.62, I11 0.65 up; I5 0.38, I13 0.43 down; the rest near 0.5).
DENSE_WEIGHTS = (1.0, -0.1, -0.2, -0.1, -0.6, -0.1, 1.2, -0.1, 0.0, 2.0, 1.4, 0.2, -0.5)


def _mandelbrot_rank(u: np.ndarray, size: int, exponent: float, offset: float) -> np.ndarray:
    """Ranks 0..size-1 by the inverse CDF of a continuous density ~ (x + offset)^-s on [1, size + 1)."""
    if offset <= 0.0:
        return _zipf_rank(u, size, exponent)
    lo, hi = (1.0 + offset) ** (1.0 - exponent), (size + 1.0 + offset) ** (1.0 - exponent)
    x = (lo - u * (lo - hi)) ** (1.0 / (1.0 - exponent)) - offset
    return np.minimum(x.astype(np.int64) - 1, size - 1)


class GeneratorV4(GeneratorV3):
    """v4: v3's structure with signal on every entity, real dense shapes, flatter ad/site heads, the
    missing group per user and the C3 -> C15, C11 -> C13 links (module docstring)."""

    version = 4

    variance_shares = VARIANCE_SHARES_V4
    source_weight = SOURCE_WEIGHT

    def init_dense(self, rng: np.random.Generator) -> None:
        super().init_dense(rng)
        self.dense_weights = np.array(DENSE_WEIGHTS)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["derived"]["C13"] = {"source": "C11", "merge": DERIVED_V4[12][1], "noise": DERIVED_V4[12][2]}
        out.update({
            "entity_laws": {k: {"exponent": s, "offset": q} for k, (s, q) in ENTITY_LAW_V4.items()},
            "site_from_user": SITE_FROM_USER,
            "user_missing_group": [f"C{t + 1}" for t in MISSING_GROUPS[USER_MISSING_GROUP][0]],
            "user_missing_noise": USER_MISSING_NOISE,
            "source_weight": self.source_weight,
            "dense": {"zero": DENSE_ZERO, "median": DENSE_MEDIAN, "sigma": DENSE_SIGMA, "i2_negative": I2_NEGATIVE,
                      "weights": DENSE_WEIGHTS},
            "signal": "every entity",
        })
        return out

    def entity_rank(self, name: str, u: np.ndarray) -> np.ndarray:
        pool = int(self.sizes[ENTITY_ROOT[name]])
        one_off = ENTITY_ONE_OFF[name]
        exponent, offset = ENTITY_LAW_V4[name]
        rank = _mandelbrot_rank(np.maximum(u - one_off, 0.0) / (1.0 - one_off), pool, exponent, offset)
        if one_off > 0:
            picked = u < one_off
            rank[picked] = np.minimum((u[picked] / one_off * pool).astype(np.int64), pool - 1)
        return rank

    def entity_keys_v4(
        self, name: str, rank: np.ndarray, days: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """v3's drift and new entities on given ranks; every entity carries signal."""
        pool = int(self.sizes[ENTITY_ROOT[name]])
        epoch = np.floor(self.drift_rate * days + _unit(_mix(rank, self.salt(name, 1)))).astype(np.int64)
        owner = np.where(epoch > 0, _mix(rank + pool * epoch, self.salt(name, 2)) % np.uint64(pool), rank)
        owner = owner.astype(np.int64)
        generation = np.floor(self.new_entity_rate * days + _unit(_mix(owner, self.salt(name, 3))))
        keys = owner.astype(np.uint64) + np.uint64(pool) * generation.astype(np.uint64)
        return keys, generation > 0, self.param_rows(keys, np.ones(keys.shape, dtype=bool), name)

    def sample_latent(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows start..start+n-1 of the log: (dense [n, 13], ids int32 [n, 26], teacher parameter rows [n, k],
        latent values [n, k]: the user's, ad's and site's keys, then each independent table's rank)."""
        days = (start + np.arange(n)) / self.rows_per_day
        ids = np.empty((n, NUM_TABLES), dtype=np.int64)
        params, weights = [], []
        u = rng.random((len(ENTITY_ROOT) + len(INDEPENDENT_EXPONENT) + 1, n))
        keys, new = {}, {}
        user_rank = self.entity_rank("user", u[0])
        keys["user"], new["user"], param = self.entity_keys_v4("user", user_rank, days)
        params.append(param)
        ad_rank = self.entity_rank("ad", u[1])
        site_rank = self.entity_rank("site", u[2])
        own = u[-1] < SITE_FROM_USER  # the user's own site: a fixed draw of the site law per user
        site_rank[own] = self.entity_rank("site", _unit(_mix(keys["user"][own], self.salt("site", 8))))
        for name, rank in (("ad", ad_rank), ("site", site_rank)):
            keys[name], new[name], param = self.entity_keys_v4(name, rank, days)
            params.append(param)
        weights += [self.source_weight["user"], self.source_weight["ad"], self.source_weight["site"]]
        ranks: list[np.ndarray] = []
        for i, (table, exponent) in enumerate(INDEPENDENT_EXPONENT.items(), len(ENTITY_ROOT)):
            rank = _zipf_rank(u[i], len(self.rank_to_row[table]), exponent)
            ids[:, table] = self.rank_to_row[table][rank]
            params.append(self.param_rows(rank, rank < HOT_ROWS, table))
            weights.append(1.0)
            ranks.append(rank.astype(np.int64))
        noise_u = rng.random((len(DERIVED_V4), n))
        for i, (table, (source, merge, noise)) in enumerate(self._derived_order()):
            ids[:, table] = self.derived_rows(table, source, merge, noise, keys, new, ids, noise_u[i])
        missing_u = rng.random((len(MISSING_GROUPS), n))
        per_user = _unit(_mix(keys["user"], self.salt("user", 9)))
        missing_u[USER_MISSING_GROUP] = np.where(missing_u[USER_MISSING_GROUP] < USER_MISSING_NOISE,
                                                 rng.random(n), per_user)
        for (tables, rate), mu in zip(MISSING_GROUPS, missing_u, strict=True):
            ids[np.ix_(mu < rate, tables)] = MISSING_ROW
        dense = self.draw_dense(rng, n)
        if self.columns is not None:  # given table sizes: each role's ids go back to its table's column
            out = np.empty_like(ids)
            out[:, self.columns] = ids
            ids = out
        self._source_weights = np.array(weights)
        sources = np.stack([keys[name].astype(np.int64) for name in ENTITY_ROOT] + ranks, axis=1)
        return dense, ids.astype(np.int32), np.stack(params, axis=1), sources

    def _derived_order(self) -> list[tuple[int, tuple[str | int, float, float]]]:
        """DERIVED_V4 with every table after its source (C13 after C11)."""
        order = [t for t in DERIVED if t != 12]
        order.insert(order.index(10) + 1, 12)
        return [(t, DERIVED_V4[t]) for t in order]

    def draw_dense(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """float32 [n, 13] as stored (log(1 + max(x, 0)), missing 0); raw values (NaN = missing) in raw_dense."""
        normal = rng.standard_normal((n, NUM_DENSE))
        shape = rng.random((n, NUM_DENSE))
        missing = rng.random((n, NUM_DENSE)) < self.dense_missing
        raw = np.maximum(1.0, np.floor(np.array(DENSE_MEDIAN) * np.exp(normal * np.array(DENSE_SIGMA)) + 0.5))
        raw[shape < np.array(DENSE_ZERO)] = 0.0
        negative = (shape >= DENSE_ZERO[1]) & (shape < DENSE_ZERO[1] + I2_NEGATIVE)
        raw[:, 1] = np.where(negative[:, 1], np.where(normal[:, 0] > 1.28, -2.0, -1.0), raw[:, 1])
        raw[missing] = np.nan
        self.raw_dense = raw
        return dense_transform(raw)

    def terms(self, dense: np.ndarray, params: np.ndarray) -> np.ndarray:
        """v3's three terms, the first-order one weighted per source (the user's counts more)."""
        n, k = params.shape
        weights = getattr(self, "_source_weights", np.ones(k))
        rows = params.ravel()
        terms = np.empty((n, 3))
        terms[:, 0] = dense.astype(np.float64) @ self.dense_weights
        terms[:, 1] = (self.first_order[rows].reshape(n, k) * weights).sum(axis=1)
        vec = self.vectors[rows]
        total = vec.reshape(n, k, TEACHER_DIM).sum(axis=1)
        squares = np.einsum("ij,ij->i", vec, vec).reshape(n, k).sum(axis=1)
        terms[:, 2] = 0.5 * (np.einsum("ij,ij->i", total, total) - squares)
        return terms
