"""Criteo-shaped synthetic data with a hidden teacher; `slipcache synth` (and `synth --compare`).

Why synthetic: the full Criteo set is 45M rows and not available offline, but experiments need data
with its shape (26 tables with the Kaggle cardinalities, power-law id popularity, skewed dense counts,
positive rate 0.256) and a known achievable AUC. Labels come from a teacher that a DLRM can represent:
a dense linear term, first-order terms and pairwise dot products of per-value teacher vectors.

Two generators (docs/data.md):
- v3, the default: the big tables are views of latent entities (user, ad, site) with their own power-law
  popularity, derived with table-specific collisions and noise, so they recur together as in real rows;
  missing values come in the real rows' groups; rows are in time order over days, with new entities and
  drifting popularity; splits follow time. Everything per value is a hash, so no per-row arrays.
- v2, kept bit for bit so earlier figures reproduce: every table drawn independently by rank from a
  bounded continuous Zipf law (inverse CDF) and mapped to row ids by a random permutation per table
  (int32, 135 MB at full scale); teacher parameters for the `HOT_ROWS` most popular rows of each table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from slipcache.data.dataset import NUM_DENSE, NUM_TABLES, DatasetWriter
from slipcache.errors import SlipcacheError

KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
TARGET_POSITIVE_RATE = 0.256
TARGET_TEACHER_AUC = 0.80
GENERATOR_VERSIONS = {"v3": 3, "v2": 2}  # `--generator` name -> the version recorded in meta.json
DEFAULT_GENERATOR = "v3"
DEFAULT_SAMPLES = 2_500_000  # 2M train + 250k val + 250k test with the default fractions
SMALL_TABLE = 100  # tables up to this size keep their size under --scale; bigger ones never shrink below it
HOT_ROWS = 20_000  # rows (by popularity rank) per table that carry teacher signal
TEACHER_DIM = 8
CHUNK_ROWS = 32_768
CALIBRATION_ROWS = 4 * CHUNK_ROWS
# Fraction of missing values of I1..I13 in the Kaggle training set (approximate).
DENSE_MISSING = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22]
# Share of teacher logit variance from the dense term, first-order row terms, pairwise interactions.
VARIANCE_SHARES = (0.3, 0.3, 0.4)


def synthetic_table_sizes(scale: float) -> list[int]:
    """Kaggle cardinalities times `scale`; small tables (<= SMALL_TABLE rows) keep their size."""
    if not scale > 0:
        raise SlipcacheError(f"scale must be positive, got {scale}")
    return [max(min(c, SMALL_TABLE), int(round(c * scale))) for c in KAGGLE_CARDINALITIES]


class _Teacher:
    """What v2 and v3 share: dense features, the teacher's logit terms and their calibration.

    Subclasses set `first_order` [P + 1] and `vectors` [P + 1, TEACHER_DIM] (the last row all zero, read
    by values without signal) and implement `sample(rng, start, n)`.
    """

    first_order: np.ndarray
    vectors: np.ndarray

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.component_scale = np.ones(3)  # these three are set by calibrate()
        self.logit_scale = 1.0
        self.logit_bias = 0.0

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
        """float32 [n, 13]: log1p of skewed counts, 0 where missing."""
        counts = np.floor(
            np.exp(rng.standard_normal((n, NUM_DENSE)) * self.dense_sigma + self.dense_mu) - 0.5
        )
        dense = np.log1p(np.maximum(counts, 0.0))
        dense[rng.random((n, NUM_DENSE)) < self.dense_missing] = 0.0
        return dense.astype(np.float32)

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
        """Weigh the three logit terms by VARIANCE_SHARES, then pick scale and bias for the targets.

        Calibrated on the first CALIBRATION_ROWS rows of the log (the start of the first day)."""
        rng = np.random.default_rng([self.seed, 1])
        terms = np.concatenate(
            [self.sample(rng, i * CHUNK_ROWS, CHUNK_ROWS)[2] for i in range(CALIBRATION_ROWS // CHUNK_ROWS)]
        )
        self.component_scale = np.sqrt(np.array(VARIANCE_SHARES)) / np.maximum(terms.std(axis=0), 1e-12)
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


class _GeneratorV2(_Teacher):
    """v2: tables drawn independently of each other and of time (kept so earlier figures reproduce)."""

    def __init__(self, scale: float, seed: int) -> None:
        super().__init__(seed)
        self.sizes = np.array(synthetic_table_sizes(scale), dtype=np.int64)
        rng = np.random.default_rng([seed, 0])
        self.exponents = rng.uniform(1.05, 1.2, NUM_TABLES)
        n1 = (self.sizes + 1).astype(np.float64)
        self._cdf_span = 1.0 - n1 ** (1.0 - self.exponents)
        self._inv = 1.0 / (1.0 - self.exponents)
        # A random permutation rank -> id per table, so hot rows are spread over the table (4 bytes/row).
        self.table_offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.rank_to_id = np.concatenate([rng.permutation(int(n)).astype(np.int32) for n in self.sizes])
        self.hot = np.minimum(self.sizes, HOT_ROWS)
        self.hot_offsets = np.concatenate([[0], np.cumsum(self.hot)[:-1]]).astype(np.int64)
        total_hot = int(self.hot.sum())
        self.first_order = np.append(rng.standard_normal(total_hot), 0.0).astype(np.float32)
        self.vectors = np.vstack(
            [rng.standard_normal((total_hot, TEACHER_DIM)), np.zeros((1, TEACHER_DIM))]
        ).astype(np.float32)
        self.init_dense(rng)

    def sample(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense float32 [n, 13] after log1p, ids int32 [n, 26], teacher logit terms float64 [n, 3]).

        `start` (the position of the first row in the log) does not matter: v2 has no time."""
        u = rng.random((n, NUM_TABLES))
        x = (1.0 - u * self._cdf_span) ** self._inv  # continuous Zipf on [1, size + 1)
        ranks = np.minimum(x.astype(np.int64) - 1, self.sizes - 1)
        ids = self.rank_to_id[self.table_offsets + ranks]
        dense = self.draw_dense(rng, n)
        # Rows past the hot ones read the all-zero parameter row at index total_hot.
        params = np.where(ranks < self.hot, self.hot_offsets + ranks, len(self.first_order) - 1)
        return dense, ids, self.terms(dense, params)

    def describe(self) -> dict[str, Any]:
        return {"zipf_exponents": [round(float(e), 4) for e in self.exponents]}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _bias_for_rate(logits: np.ndarray, rate: float) -> float:
    """The b with mean(sigmoid(logits + b)) == rate (Newton's method; the mean is increasing in b)."""
    b = math.log(rate / (1.0 - rate)) - float(np.median(logits))
    for _ in range(50):
        p = _sigmoid(logits + b)
        step = (p.mean() - rate) / max(float((p * (1.0 - p)).mean()), 1e-12)
        b -= float(np.clip(step, -5.0, 5.0))
        if abs(step) < 1e-9:
            break
    return b


def expected_auc(logits: np.ndarray) -> float:
    """AUC of the teacher itself, in expectation over labels ~ Bernoulli(sigmoid(logits))."""
    p = _sigmoid(np.asarray(logits, dtype=np.float64))
    order = np.argsort(logits, kind="stable")
    p, q = p[order], 1.0 - p[order]
    negatives_below = np.cumsum(q) - q
    return float((p * negatives_below).sum() / (p.sum() * q.sum() - (p * q).sum()))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank AUC with ties counted half (Mann-Whitney)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(average, counts)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ----------------------------------------------------------------------------------------------------
# v3: latent entities, time order


# Latent entities (table indices are 0-based: C3 is 2). Each is drawn by rank from a bounded Zipf law
# over as many ranks as its finest table has rows, and seen through one or more tables.
ENTITY_ROOT = {"user": 2, "ad": 6, "site": 14}
# Derived tables: table -> (source, merge, noise). The source is an entity (its root tables read the
# entity itself) or a table whose value this one coarsens. `merge`: share of source values that collapse
# onto a popular value of this table (a value drawn from its own Zipf law, fixed per source value), the
# rest are hashed to a value of their own; `noise`: share of rows that draw an unrelated value instead.
# The structure is read off the real rows: C3 determines C12, C21, C16, C4, C24 exactly and C19 nearly;
# C7 and C11 determine C13; C15 determines C18, C14 and C2 (docs/data.md).
DERIVED: dict[int, tuple[str | int, float, float]] = {
    2: ("user", 0.0, 0.0),  # C3
    11: (2, 0.05, 0.0),  # C12
    20: (11, 0.04, 0.0),  # C21
    15: (20, 0.08, 0.0),  # C16
    3: (15, 0.28, 0.0),  # C4
    23: (3, 0.60, 0.0),  # C24
    18: (2, 0.95, 0.02),  # C19
    25: (3, 0.20, 0.05),  # C26
    6: ("ad", 0.0, 0.0),  # C7
    10: ("ad", 0.30, 0.0),  # C11
    12: (6, 0.20, 0.02),  # C13
    14: ("site", 0.0, 0.0),  # C15
    17: (14, 0.45, 0.0),  # C18
    1: (17, 0.30, 0.0),  # C2
    13: (14, 0.30, 0.0),  # C14
}
# Zipf exponents of the entities and of the tables drawn on their own (static, as in v2), fitted to the
# per-table recurrence of the real rows (see docs/data.md).
ENTITY_EXPONENT = {"user": 1.15, "ad": 0.93, "site": 1.15}
# Share of an entity's draws that pick a rank uniformly instead (one-off visitors): the long tail of values
# seen once or twice that makes the full Kaggle log's C3 hold 10.1 M values in 45.8 M rows.
ENTITY_ONE_OFF = {"user": 0.3, "ad": 0.0, "site": 0.0}
MERGE_EXPONENT = 1.2
INDEPENDENT_EXPONENT = {
    0: 1.8,
    4: 2.0,
    5: 1.8,
    7: 2.0,
    8: 3.0,
    9: 1.1,
    16: 1.8,
    19: 2.0,
    21: 2.0,
    22: 1.8,
    24: 2.0,
}
# Missing values come in groups that are empty together in the real rows: (tables, share of rows).
MISSING_GROUPS: tuple[tuple[tuple[int, ...], float], ...] = (
    ((2, 3, 11, 15, 20, 23), 0.033),
    ((18, 19, 24, 25), 0.483),
    ((5,), 0.126),
    ((21,), 0.816),
)
MISSING_ROW = 0  # v3: row 0 of every table is the empty value (as with `preprocess --vocab hash`)
# Time: the log spans DAYS days (Kaggle's 7); per day a share NEW_ENTITY_RATE of each entity's ranks passes
# to an entity never seen before and a share DRIFT_RATE to an existing entity from elsewhere in the
# ranking, continuously over the day. Not measurable on the shared rows: see docs/data.md for the choice.
DAYS = 7
NEW_ENTITY_RATE = 0.04
DRIFT_RATE = 0.04
# New entities need values never seen before: each entity table of at least RESERVE_MIN_ROWS rows keeps the
# share new_entity_rate * days (at most MAX_RESERVED) of its rows for the values of entities born later.
RESERVE_MIN_ROWS = 1000
MAX_RESERVED = 0.5
TEACHER_BANK = 1 << 17  # teacher parameter rows; an entity's parameters are a hash of its key into them
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A 64-bit hash of (x, salt) (splitmix64's finalizer): a fixed random function without tables."""
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64) + np.uint64(salt & 0xFFFFFFFFFFFFFFFF) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _unit(h: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) from a 64-bit hash."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _zipf_rank(u: np.ndarray, size: int, exponent: float) -> np.ndarray:
    """Ranks 0..size-1 from uniforms by the inverse CDF of a continuous Zipf law on [1, size + 1)."""
    span = 1.0 - (size + 1.0) ** (1.0 - exponent)
    x = (1.0 - u * span) ** (1.0 / (1.0 - exponent))
    return np.minimum(x.astype(np.int64) - 1, size - 1)


class _GeneratorV3(_Teacher):
    """v3: each table is a view of a latent entity (user, ad, site) or drawn on its own; time-ordered.

    Everything per value is a hash (`_mix`) of the value and a per-(seed, table) salt, so the generator
    holds no per-row arrays except the rank permutations of the small tables drawn on their own.
    """

    def __init__(
        self,
        scale: float,
        seed: int,
        *,
        num_samples: int,
        days: int = DAYS,
        new_entity_rate: float = NEW_ENTITY_RATE,
        drift_rate: float = DRIFT_RATE,
    ) -> None:
        super().__init__(seed)
        self.sizes = np.array(synthetic_table_sizes(scale), dtype=np.int64)
        self.days = days
        self.rows_per_day = num_samples / days
        self.new_entity_rate = new_entity_rate
        self.drift_rate = drift_rate
        self.has_missing = np.zeros(NUM_TABLES, dtype=bool)
        for tables, _ in MISSING_GROUPS:
            self.has_missing[list(tables)] = True
        # Row 0 is the empty value of every table (unused where no value is ever empty), so one missing
        # row holds for all tables, as in datasets preprocessed with the hash vocabulary.
        self.first = np.ones(NUM_TABLES, dtype=np.int64)
        reserved = np.zeros(NUM_TABLES)
        derived = list(DERIVED)
        reserved[derived] = np.where(
            self.sizes[derived] >= RESERVE_MIN_ROWS, min(MAX_RESERVED, new_entity_rate * days), 0.0
        )
        self.reserve_start = self.first + np.floor((self.sizes - self.first) * (1.0 - reserved)).astype(
            np.int64
        )
        rng = np.random.default_rng([seed, 3])
        self._salt = int(rng.integers(1 << 62))
        self.affine = {}  # root table -> (scale, shift) of its one-to-one map of day-0 entity ranks
        for table, (source, _, _) in DERIVED.items():
            if isinstance(source, str):
                span = int(self.reserve_start[table] - self.first[table])
                scale = int(rng.integers(1, span)) if span > 1 else 1
                while math.gcd(scale, span) != 1:
                    scale += 1
                self.affine[table] = (scale, int(rng.integers(span)))
        self.rank_to_row = {
            t: (self.first[t] + rng.permutation(int(self.sizes[t] - self.first[t]))).astype(np.int32)
            for t in INDEPENDENT_EXPONENT
        }
        # Teacher parameters: a bank shared by all signal sources (entities, independent tables) plus an
        # all-zero last row, read by the rows that carry no signal.
        self.first_order = np.append(rng.standard_normal(TEACHER_BANK), 0.0).astype(np.float32)
        self.vectors = np.vstack(
            [rng.standard_normal((TEACHER_BANK, TEACHER_DIM)), np.zeros((1, TEACHER_DIM))]
        ).astype(np.float32)
        self.init_dense(rng)

    def describe(self) -> dict[str, Any]:
        return {
            "days": self.days,
            "rows_per_day": self.rows_per_day,
            "new_entity_rate": self.new_entity_rate,
            "drift_rate": self.drift_rate,
            "entities": {name: f"C{root + 1}" for name, root in ENTITY_ROOT.items()},
            "entity_exponents": ENTITY_EXPONENT,
            "entity_one_off": ENTITY_ONE_OFF,
            "derived": {
                f"C{t + 1}": {"source": s if isinstance(s, str) else f"C{s + 1}", "merge": m, "noise": z}
                for t, (s, m, z) in DERIVED.items()
            },
            "independent_exponents": {f"C{t + 1}": e for t, e in INDEPENDENT_EXPONENT.items()},
            "tables_with_missing": [int(t) for t in np.flatnonzero(self.has_missing)],
        }

    def salt(self, source: int | str, purpose: int) -> int:
        """Salt of a table (int) or entity (name) for one purpose, so every hash is its own function."""
        index = list(ENTITY_ROOT).index(source) + 100 if isinstance(source, str) else source
        return self._salt + 1000 * index + purpose

    def entity_keys(
        self, name: str, u: np.ndarray, days: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entity keys uint64, born after day 0 (bool), teacher parameter row) of draws `u` at times
        `days` (float, in days)."""
        pool = int(self.sizes[ENTITY_ROOT[name]])
        one_off = ENTITY_ONE_OFF[name]
        rank = _zipf_rank(np.maximum(u - one_off, 0.0) / (1.0 - one_off), pool, ENTITY_EXPONENT[name])
        if one_off > 0:
            picked = u < one_off
            rank[picked] = np.minimum((u[picked] / one_off * pool).astype(np.int64), pool - 1)
        # Drift: a rank passes to the entity of a random other rank, at a random phase per rank.
        epoch = np.floor(self.drift_rate * days + _unit(_mix(rank, self.salt(name, 1)))).astype(np.int64)
        owner = np.where(epoch > 0, _mix(rank + pool * epoch, self.salt(name, 2)) % np.uint64(pool), rank)
        owner = owner.astype(np.int64)
        # New entities: the owner's slot passes to a new entity (a new key), at a random phase per slot.
        generation = np.floor(self.new_entity_rate * days + _unit(_mix(owner, self.salt(name, 3))))
        keys = owner.astype(np.uint64) + np.uint64(pool) * generation.astype(np.uint64)
        return keys, generation > 0, self.param_rows(keys, owner < HOT_ROWS, name)

    def param_rows(self, keys: np.ndarray, signal: np.ndarray, source: int | str) -> np.ndarray:
        """Teacher parameter rows of `keys` of one signal source; the zero row where `signal` is False."""
        rows = (_mix(keys, self.salt(source, 4)) % np.uint64(TEACHER_BANK)).astype(np.int64)
        return np.where(signal, rows, TEACHER_BANK)

    def value_rows(
        self, table: int, values: np.ndarray, new: np.ndarray | None = None, *, ranks: bool = False
    ) -> np.ndarray:
        """Rows of `table` for hashed values, spread uniformly over its rows for day-0 entities (past the
        empty row) or, where `new`, over the rows it keeps for entities born later. With `ranks` the
        values are entity keys, which are ranks for day-0 entities: those map one-to-one (an affine
        permutation), so a table as large as the entity's pool can have every row used."""
        first, reserve, size = self.first[table], self.reserve_start[table], self.sizes[table]
        h = _mix(values, self.salt(table, 5))
        span = reserve - first
        if ranks:
            scale, shift = self.affine[table]
            rows = ((values.astype(np.int64) % span) * scale + shift) % span + first
        else:
            rows = (h % np.uint64(span)).astype(np.int64) + first
        if new is not None and reserve < size:
            rows = np.where(new, (h % np.uint64(size - reserve)).astype(np.int64) + reserve, rows)
        return rows

    def popular_rows(self, table: int, u: np.ndarray) -> np.ndarray:
        """Rows of `table` drawn by its own Zipf law (where merged and noisy values land)."""
        size = int(self.reserve_start[table] - self.first[table])
        return self.value_rows(table, _zipf_rank(u, size, MERGE_EXPONENT))

    def sample(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows start..start+n-1 of the log: (dense [n, 13], ids int32 [n, 26], teacher terms [n, 3])."""
        days = (start + np.arange(n)) / self.rows_per_day
        ids = np.empty((n, NUM_TABLES), dtype=np.int64)
        params = []
        u = rng.random((len(ENTITY_ROOT) + len(INDEPENDENT_EXPONENT), n))
        keys, new = {}, {}
        for i, name in enumerate(ENTITY_ROOT):
            keys[name], new[name], param = self.entity_keys(name, u[i], days)
            params.append(param)
        for i, (table, exponent) in enumerate(INDEPENDENT_EXPONENT.items(), len(ENTITY_ROOT)):
            size = len(self.rank_to_row[table])
            rank = _zipf_rank(u[i], size, exponent)
            ids[:, table] = self.rank_to_row[table][rank]
            params.append(self.param_rows(rank, rank < HOT_ROWS, table))
        noise_u = rng.random((len(DERIVED), n))
        for i, (table, (source, merge, noise)) in enumerate(DERIVED.items()):
            # DERIVED lists every table after its source
            if isinstance(source, str):
                h, born_later = _mix(keys[source], self.salt(table, 6)), new[source]
            else:
                h, born_later = (
                    _mix(ids[:, source], self.salt(table, 6)),
                    ids[:, source] >= self.reserve_start[source],
                )
            merged = _unit(h) < merge
            rows = np.where(
                merged,
                self.popular_rows(table, _unit(_mix(h, 7))),
                self.value_rows(table, keys[source], born_later, ranks=True)
                if isinstance(source, str)
                else self.value_rows(table, h, born_later),
            )
            noisy = noise_u[i] < noise
            rows[noisy] = self.popular_rows(table, noise_u[i][noisy] / noise)  # uniform given noisy
            ids[:, table] = rows
        missing_u = rng.random((len(MISSING_GROUPS), n))
        for (tables, rate), mu in zip(MISSING_GROUPS, missing_u, strict=True):
            ids[np.ix_(mu < rate, tables)] = MISSING_ROW
        dense = self.draw_dense(rng, n)
        return dense, ids.astype(np.int32), self.terms(dense, np.stack(params, axis=1))


def make_generator(
    generator: str,
    scale: float,
    seed: int,
    *,
    num_samples: int,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
) -> _Teacher:
    """The (uncalibrated) generator `generator` ("v3" or "v2") of a dataset of `num_samples` rows."""
    if generator == "v2":
        return _GeneratorV2(scale, seed)
    if generator != "v3":
        raise SlipcacheError(f"generator must be one of {', '.join(GENERATOR_VERSIONS)}, got {generator!r}")
    if days < 1:
        raise SlipcacheError(f"days must be at least 1, got {days}")
    if not (0 <= new_entity_rate <= 1 and 0 <= drift_rate <= 1):
        raise SlipcacheError("new-entity and drift rates are shares of ranks per day, in [0, 1]")
    return _GeneratorV3(
        scale,
        seed,
        num_samples=num_samples,
        days=days,
        new_entity_rate=new_entity_rate,
        drift_rate=drift_rate,
    )


def generate_synthetic(
    out_dir: str | os.PathLike[str],
    *,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    generator: str = DEFAULT_GENERATOR,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
    progress: bool = True,
) -> dict[str, Any]:
    """Write a synthetic dataset to `out_dir` (atomically) and return its meta. Deterministic per seed.

    Rows are written in log order and the splits are contiguous: with v3 (time-ordered over `days` days)
    train holds the earlier days, validation and test the last ones, as in the standard Criteo split.
    `days` and the two rates apply to v3 only."""
    if num_samples < 1:
        raise SlipcacheError(f"number of samples must be at least 1, got {num_samples}")
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise SlipcacheError("val and test fractions must be in [0, 1) and sum to less than 1")
    gen = make_generator(
        generator,
        scale,
        seed,
        num_samples=num_samples,
        days=days,
        new_entity_rate=new_entity_rate,
        drift_rate=drift_rate,
    )
    gen.calibrate()
    n_val = int(num_samples * val_fraction)
    n_test = int(num_samples * test_fraction)
    n_train = num_samples - n_val - n_test
    bounds = {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, num_samples),
    }
    positives = dict.fromkeys(bounds, 0)
    test_logits = np.empty(n_test)
    test_labels = np.empty(n_test, dtype=np.float32)
    with (
        DatasetWriter(out_dir, {k: b - a for k, (a, b) in bounds.items()}) as writer,
        tqdm(total=num_samples, unit="rows", unit_scale=True, desc="synth", disable=not progress) as bar,
    ):
        for chunk, start in enumerate(range(0, num_samples, CHUNK_ROWS)):
            end = min(start + CHUNK_ROWS, num_samples)
            rng = _chunk_rng(seed, chunk)
            dense, ids, terms = gen.sample(rng, start, end - start)
            logits = gen.logits(terms)
            labels = (rng.random(end - start) < _sigmoid(logits)).astype(np.float32)
            for name, (a, b) in bounds.items():
                lo, hi = max(a, start), min(b, end)
                if lo >= hi:
                    continue
                part = slice(lo - start, hi - start)
                writer.write(name, lo - a, labels[part], dense[part], ids[part])
                positives[name] += int(labels[part].sum())
                if name == "test":
                    test_logits[lo - a : hi - a] = logits[part]
                    test_labels[lo - a : hi - a] = labels[part]
            bar.update(end - start)
        sizes = {k: b - a for k, (a, b) in bounds.items()}
        meta = writer.commit(
            {
                "table_sizes": [int(s) for s in gen.sizes],
                "positive_rate": sum(positives.values()) / num_samples,
                "split_positive_rate": {k: (positives[k] / sizes[k] if sizes[k] else None) for k in sizes},
                "vocabulary": "synthetic",
                "teacher_auc": auc(test_logits, test_labels) if n_test else None,
                "teacher_expected_auc": expected_auc(test_logits) if n_test else None,
                "source": {"generator": "slipcache.data.synthetic"},
                "time_ordered": isinstance(gen, _GeneratorV3),
                **({"missing_row": MISSING_ROW} if isinstance(gen, _GeneratorV3) else {}),
                "generator": {
                    "version": GENERATOR_VERSIONS[generator],
                    "num_samples": num_samples,
                    "scale": scale,
                    "seed": seed,
                    "val_fraction": val_fraction,
                    "test_fraction": test_fraction,
                    "hot_rows": HOT_ROWS,
                    "teacher_dim": TEACHER_DIM,
                    "variance_shares": list(VARIANCE_SHARES),
                    "logit_scale": gen.logit_scale,
                    "logit_bias": gen.logit_bias,
                    "dense_missing": DENSE_MISSING,
                    **gen.describe(),
                },
            }
        )
    return meta


def _chunk_rng(seed: int, chunk: int) -> np.random.Generator:
    """The random stream of rows [chunk * CHUNK_ROWS, (chunk + 1) * CHUNK_ROWS) of a dataset."""
    return np.random.default_rng([seed, 2, chunk])


def synthetic_window(
    start: int,
    rows: int,
    *,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    generator: str = DEFAULT_GENERATOR,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
) -> np.ndarray:
    """The categorical ids [rows, 26] of rows start..start+rows-1 of the dataset `generate_synthetic`
    would write with these parameters (the same rows; no labels, so no calibration is needed)."""
    gen = make_generator(
        generator,
        scale,
        seed,
        num_samples=num_samples,
        days=days,
        new_entity_rate=new_entity_rate,
        drift_rate=drift_rate,
    )
    end = start + rows
    if not 0 <= start < end <= num_samples:
        raise SlipcacheError(f"rows {start}..{end - 1} are not all within the {num_samples} rows of the log")
    parts = []
    for chunk in range(start // CHUNK_ROWS, (end - 1) // CHUNK_ROWS + 1):
        first = chunk * CHUNK_ROWS
        last = min(first + CHUNK_ROWS, num_samples)
        ids = gen.sample(_chunk_rng(seed, chunk), first, last - first)[1]
        parts.append(ids[max(start, first) - first : min(end, last) - first])
    return np.concatenate(parts)


def default_cache_root() -> Path:
    env = os.environ.get("SLIPCACHE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "slipcache"


def default_synthetic_path(
    cache_root: str | os.PathLike[str] | None,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    *,
    generator: str = DEFAULT_GENERATOR,
    progress: bool = True,
) -> Path:
    """A cached synthetic dataset for these parameters: reused when present, generated when not.

    `cache_root` None means $SLIPCACHE_CACHE_DIR, else ~/.cache/slipcache; data lives under `synthetic/`.
    The key holds the generator's version and, for v3, a digest of its parameters, so data from another
    generator or an older calibration is never reused.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    described = make_generator(generator, scale, seed, num_samples=num_samples).describe()
    version = GENERATOR_VERSIONS[generator]
    name = f"n{num_samples}-scale{scale:g}-seed{seed}-v{version}"
    if generator != "v2":  # v2 keeps its earlier directory name, so its cached datasets stay valid
        name += "-" + hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:8]
    path = root / "synthetic" / name
    try:
        gen = json.loads((path / "meta.json").read_text()).get("generator", {})
        if (gen.get("version"), gen.get("num_samples"), gen.get("scale"), gen.get("seed")) == (
            version,
            num_samples,
            scale,
            seed,
        ):
            return path
    except (OSError, ValueError, AttributeError):
        pass
    generate_synthetic(
        path, num_samples=num_samples, scale=scale, seed=seed, generator=generator, progress=progress
    )
    return path


# `synth --compare`: how far each statistic of a synthetic window may be from the real one (missing rates:
# at least three binomial standard errors at the sample's size).
COMPARE_TOLERANCE = {"co_recurrence": 0.10, "correlation": 0.15, "recur_share": 0.10, "missing_rate": 0.03}
COMPARE_ROWS = 100_000  # real rows read from the start of the file (the window compared)


def compare_with_real(
    real_path: str | os.PathLike[str],
    *,
    max_rows: int = COMPARE_ROWS,
    day: int = 0,
    generators: tuple[str, ...] = tuple(GENERATOR_VERSIONS),
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
) -> dict[str, Any]:
    """Statistics of the first rows of a real file against the same number of contiguous synthetic rows
    from the start of day `day`, per generator, each statistic with its tolerance and pass/fail.

    Like with like: the real rows are one contiguous window from the start of a log, an empty field
    counts as a value (v3's row 0; v2 has no empty values), and both sides go through `slipcache.data.stats`.
    """
    from slipcache.data.stats import compute_stats, compute_stats_arrays

    real = compute_stats(real_path, max_rows=max_rows)
    rows = int(real["rows"])
    if rows < 2:
        raise SlipcacheError(f"{real_path}: {rows} good rows; at least 2 are needed to compare")
    if not 0 <= day < days:
        raise SlipcacheError(f"day must be in 0..{days - 1}, got {day}")
    start = int(round(day * num_samples / days))
    stats = {"real": real}
    for name in generators:
        ids = synthetic_window(
            start,
            rows,
            num_samples=num_samples,
            scale=scale,
            seed=seed,
            generator=name,
            days=days,
            new_entity_rate=new_entity_rate,
            drift_rate=drift_rate,
        )
        stats[name] = compute_stats_arrays(ids, missing_value=None if name == "v2" else MISSING_ROW)

    def corr(result: dict[str, Any], a: str, b: str) -> float | None:
        names = result["recurrence_correlation"]["tables"]
        return result["recurrence_correlation"]["matrix"][names.index(a)][names.index(b)]

    checks: list[tuple[str, str, Any]] = [
        ("big-table co-recurrence", "co_recurrence", lambda r: r["co_recurrence"]["all_recur"])
    ]
    big = real["big_tables"]
    for i, a in enumerate(big):
        for b in big[i + 1 :]:
            checks.append((f"recurrence corr {a}-{b}", "correlation", lambda r, a=a, b=b: corr(r, a, b)))
    for t, table in enumerate(real["tables"]):
        for key in ("recur_share", "missing_rate"):
            label = f"{table['name']} {key.replace('_', ' ')}"
            # v2 has no empty values: its missing rate is 0, not unknown
            checks.append((label, key, lambda r, t=t, key=key: r["tables"][t][key] or 0.0))
    lines = []
    for label, kind, get in checks:
        real_value = get(real)
        tolerance = COMPARE_TOLERANCE[kind]
        if kind == "missing_rate":  # a share of rows: at least three binomial standard errors of the sample
            tolerance = max(tolerance, 3.0 * math.sqrt(real_value * (1.0 - real_value) / rows))
        tolerance = round(tolerance, 3)
        values = {name: get(stats[name]) for name in generators}
        passed = {
            name: (v is None and real_value is None)
            or (v is not None and real_value is not None and abs(v - real_value) <= tolerance + 1e-9)
            for name, v in values.items()
        }
        lines.append(
            {"statistic": label, "real": real_value, **values, "tolerance": tolerance, "pass": passed}
        )
    return {
        "real_path": str(real_path),
        "rows": rows,
        "window_start": start,
        "settings": {"scale": scale, "seed": seed, "num_samples": num_samples, "days": days},
        "generators": list(generators),
        "lines": lines,
        "passed": {name: sum(line["pass"][name] for line in lines) for name in generators},
    }


def format_comparison(result: dict[str, Any]) -> str:
    gens = result["generators"]
    settings = result["settings"]
    head = (
        f"{result['real_path']}: first {result['rows']} rows against synthetic rows "
        f"{result['window_start']}..{result['window_start'] + result['rows'] - 1} "
        f"(scale {settings['scale']:g}, seed {settings['seed']}, {settings['num_samples']} rows over "
        f"{settings['days']} days); an empty field counts as a value"
    )

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    width = max(len(line["statistic"]) for line in result["lines"])
    header = f"{'statistic':<{width}}  {'real':>6}  " + "  ".join(f"{g:>6}" for g in gens)
    header += "    tol  " + "  ".join(f"{g:>4}" for g in gens)
    rows = [head, "", header]
    for line in result["lines"]:
        text = f"{line['statistic']:<{width}}  {num(line['real']):>6}  "
        text += "  ".join(f"{num(line[g]):>6}" for g in gens)
        text += f"  ±{line['tolerance']:.2f}  " + "  ".join(
            f"{'ok' if line['pass'][g] else 'FAIL':>4}" for g in gens
        )
        rows.append(text)
    total = len(result["lines"])
    rows.append("")
    rows.append("within tolerance: " + ", ".join(f"{g} {result['passed'][g]}/{total}" for g in gens))
    return "\n".join(rows)


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="output dataset directory (required unless --compare)")
    parser.add_argument(
        "--samples", type=int, default=DEFAULT_SAMPLES, help="total rows (default %(default)s)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplier of the Kaggle table sizes (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of rows in val (default 0.1)")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="share of rows in test (default 0.1)")
    parser.add_argument(
        "--generator",
        choices=tuple(GENERATOR_VERSIONS),
        default=DEFAULT_GENERATOR,
        help="v3 (default): latent entities, time order; v2: independent tables (earlier figures)",
    )
    parser.add_argument("--days", type=int, default=DAYS, help="v3: days the log spans (default %(default)s)")
    parser.add_argument(
        "--new-entity-rate",
        type=float,
        default=NEW_ENTITY_RATE,
        help="v3: share of each entity's popularity ranks taken by new entities per day (default %(default)s)",
    )
    parser.add_argument(
        "--drift-rate",
        type=float,
        default=DRIFT_RATE,
        help="v3: share of ranks passed to another existing entity per day (default %(default)s)",
    )
    parser.add_argument(
        "--compare",
        metavar="REAL_FILE",
        help="instead of writing data: real vs synthetic statistics (v3 and v2) side by side, with tolerances",
    )
    parser.add_argument(
        "--compare-rows",
        type=int,
        default=COMPARE_ROWS,
        help="--compare: real rows read from the start of the file (default %(default)s)",
    )
    parser.add_argument(
        "--compare-day",
        type=int,
        default=0,
        help="--compare: the synthetic window starts this day (default 0)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_synth(args: argparse.Namespace) -> int:
    if args.compare:
        result = compare_with_real(
            args.compare,
            max_rows=args.compare_rows,
            day=args.compare_day,
            num_samples=args.samples,
            scale=args.scale,
            seed=args.seed,
            days=args.days,
            new_entity_rate=args.new_entity_rate,
            drift_rate=args.drift_rate,
        )
        print(format_comparison(result))
        return 0
    if not args.out:
        raise SlipcacheError("synth needs --out DIR (or --compare REAL_FILE)")
    meta = generate_synthetic(
        args.out,
        num_samples=args.samples,
        scale=args.scale,
        seed=args.seed,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
        generator=args.generator,
        days=args.days,
        new_entity_rate=args.new_entity_rate,
        drift_rate=args.drift_rate,
        progress=not args.quiet,
    )
    splits = ", ".join(f"{k} {v}" for k, v in meta["splits"].items())
    print(
        f"wrote {args.out} ({args.generator}): {splits}; {sum(meta['table_sizes'])} embedding rows; "
        f"positive rate {meta['positive_rate']:.4f}; teacher AUC {meta['teacher_auc']}"
    )
    return 0
