"""v3, the default generator: the big tables are views of latent entities (user, ad, site), rows are in
time order over days with new entities and drifting popularity, missing values come in groups.

Everything per value is a hash of (entity, rank), so the generator holds no per-row arrays.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from slipcache.data.dataset import NUM_TABLES
from slipcache.data.synthetic.teacher import (
    HOT_ROWS,
    KAGGLE_CARDINALITIES,
    TEACHER_DIM,
    Teacher,
    synthetic_table_sizes,
)
from slipcache.errors import SlipcacheError

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


def roles_by_size(table_sizes: list[int]) -> np.ndarray:
    """columns[r]: the table that plays v3's role r (Kaggle's column r), matched by size rank: the largest
    given table is the user entity's root (Kaggle's largest, C3), the next its views, and so on; ties keep
    the column order. Kaggle's own sizes map every table to itself."""
    if len(table_sizes) != NUM_TABLES or min(table_sizes) < 2:
        raise SlipcacheError(
            f"table sizes: v3 needs {NUM_TABLES} sizes of at least 2 rows (row 0 is the missing value), "
            f"got {len(table_sizes)} sizes, smallest {min(table_sizes, default=0)}"
        )
    role_order = np.argsort(-np.array(KAGGLE_CARDINALITIES), kind="stable")
    column_order = np.argsort(-np.array(table_sizes, dtype=np.int64), kind="stable")
    columns = np.empty(NUM_TABLES, dtype=np.int64)
    columns[role_order] = column_order
    return columns


class GeneratorV3(Teacher):
    """v3: each table is a view of a latent entity (user, ad, site) or drawn on its own; time-ordered.

    Everything per value is a hash (`_mix`) of the value and a per-(seed, table) salt, so the generator
    holds no per-row arrays except the rank permutations of the small tables drawn on their own.
    """

    version = 3

    def __init__(
        self,
        scale: float,
        seed: int,
        *,
        num_samples: int,
        days: int = DAYS,
        new_entity_rate: float = NEW_ENTITY_RATE,
        drift_rate: float = DRIFT_RATE,
        table_sizes: list[int] | None = None,
    ) -> None:
        super().__init__(seed)
        # Given sizes: the tables take v3's roles by size (see `roles_by_size`); sizes are in role order
        # inside the generator and `sample` puts each role's ids back in its table's column.
        self.table_sizes = None if table_sizes is None else [int(n) for n in table_sizes]
        self.columns = roles_by_size(self.table_sizes) if self.table_sizes is not None else None
        given = None if self.table_sizes is None else np.array(self.table_sizes, dtype=np.int64)[self.columns]
        self.sizes = np.array(synthetic_table_sizes(scale), dtype=np.int64) if given is None else given
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

    @property
    def output_sizes(self) -> list[int]:
        """Rows per table in the dataset's column order."""
        return list(self.table_sizes) if self.table_sizes is not None else [int(n) for n in self.sizes]

    def describe(self) -> dict[str, Any]:
        given = {} if self.table_sizes is None else {
            "table_sizes": self.table_sizes,
            "roles": {f"C{int(c) + 1}": f"C{r + 1}" for r, c in enumerate(self.columns)},
        }
        return {
            **given,
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

    def derived_rows(
        self,
        table: int,
        source: str | int,
        merge: float,
        noise: float,
        keys: dict[str, np.ndarray],
        new: dict[str, np.ndarray],
        ids: np.ndarray,
        noise_u: np.ndarray,
    ) -> np.ndarray:
        """Rows of a table derived from an entity (`source` a name) or from another table's ids: a share
        `merge` falls on popular rows, a share `noise` is replaced by a popular row drawn uniformly."""
        if isinstance(source, str):
            h, born_later = _mix(keys[source], self.salt(table, 6)), new[source]
        else:
            h, born_later = _mix(ids[:, source], self.salt(table, 6)), ids[:, source] >= self.reserve_start[source]
        rows = np.where(
            _unit(h) < merge,
            self.popular_rows(table, _unit(_mix(h, 7))),
            self.value_rows(table, keys[source], born_later, ranks=True)
            if isinstance(source, str)
            else self.value_rows(table, h, born_later),
        )
        noisy = noise_u < noise
        rows[noisy] = self.popular_rows(table, noise_u[noisy] / noise)  # uniform given noisy
        return rows

    def sample(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows start..start+n-1 of the log: (dense [n, 13], ids int32 [n, 26], teacher terms [n, 3])."""
        dense, ids, params, _ = self.sample_latent(rng, start, n)
        return dense, ids, self.terms(dense, params)

    def sample_latent(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`sample`'s rows with what the teacher reads instead of its terms: (dense, ids, teacher parameter
        rows [n, k], latent values [n, k] int64: each signal source's entity key or independent table rank)."""
        days = (start + np.arange(n)) / self.rows_per_day
        ids = np.empty((n, NUM_TABLES), dtype=np.int64)
        params, sources = [], []
        u = rng.random((len(ENTITY_ROOT) + len(INDEPENDENT_EXPONENT), n))
        keys, new = {}, {}
        for i, name in enumerate(ENTITY_ROOT):
            keys[name], new[name], param = self.entity_keys(name, u[i], days)
            params.append(param)
            sources.append(keys[name].astype(np.int64))
        for i, (table, exponent) in enumerate(INDEPENDENT_EXPONENT.items(), len(ENTITY_ROOT)):
            size = len(self.rank_to_row[table])
            rank = _zipf_rank(u[i], size, exponent)
            ids[:, table] = self.rank_to_row[table][rank]
            params.append(self.param_rows(rank, rank < HOT_ROWS, table))
            sources.append(rank.astype(np.int64))
        noise_u = rng.random((len(DERIVED), n))
        for i, (table, (source, merge, noise)) in enumerate(DERIVED.items()):
            # DERIVED lists every table after its source
            ids[:, table] = self.derived_rows(table, source, merge, noise, keys, new, ids, noise_u[i])
        missing_u = rng.random((len(MISSING_GROUPS), n))
        for (tables, rate), mu in zip(MISSING_GROUPS, missing_u, strict=True):
            ids[np.ix_(mu < rate, tables)] = MISSING_ROW
        dense = self.draw_dense(rng, n)
        if self.columns is not None:
            out = np.empty_like(ids)
            out[:, self.columns] = ids
            ids = out
        return dense, ids.astype(np.int32), np.stack(params, axis=1), np.stack(sources, axis=1)
