"""The id profiler and the miss-ratio curves it gives: how often each row of each table is looked up.

The per-table memory planner (`slipcache.planning.planner`) reads its hit-rate curves (and its lookups
per sample and row histograms).

A profile counts ids on a uniform sample of the training split's rows (without replacement, read in row
order so memory-mapped files are read forward). The curves assume independent references drawn from the
sampled frequencies, with two corrections the sample needs:

- ids that appear once in the sample stand for the unseen tail (Good-Turing: the probability that the next
  lookup is an id not in the sample is about singletons / lookups); those lookups are counted as misses
  whatever the cache size, so the curves are conservative for tables with a long tail;
- LRU's hit rate for C cached rows follows Che's approximation (a row stays in the cache for a
  characteristic time T with sum_i (1 - exp(-p_i T)) = C; it hits with probability 1 - exp(-p_i T));
  LFU's is that of the C most frequent rows (the static optimum). Set-associativity is ignored: with 16
  ways its conflict misses are small next to capacity misses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slipcache.errors import SlipcacheError

HISTOGRAM_BUCKETS = 64
READ_ROWS = 1 << 18


@dataclass
class TableProfile:
    """Sampled lookups of one table: the count of each distinct id seen (descending) and a row histogram."""

    rows: int
    lookups: int  # sampled lookups
    counts: np.ndarray  # int64, descending: how often each distinct sampled id was looked up
    histogram: np.ndarray  # float64 [HISTOGRAM_BUCKETS]: lookups in equal-width row buckets, row order
    lookups_per_sample: float

    @property
    def distinct(self) -> int:
        return int(self.counts.size)

    @property
    def unseen_mass(self) -> float:
        """Good-Turing estimate of the share of lookups that go to ids the sample did not see."""
        return float((self.counts == 1).sum()) / self.lookups if self.lookups else 1.0

    def hit_rate(self, cache_rows: np.ndarray | list[int] | int, policy: str = "lru") -> np.ndarray:
        """Expected hit rate with `cache_rows` rows of cache (vectorized over sizes)."""
        sizes = np.atleast_1d(np.asarray(cache_rows, dtype=np.float64))
        if not self.lookups:
            return np.zeros_like(sizes)
        # Only ids seen twice or more are modelled as re-referenced; singletons are the unseen tail.
        values, multiplicity = np.unique(self.counts[self.counts > 1], return_counts=True)
        p = values / self.lookups
        seen = float((p * multiplicity).sum())
        if policy == "lfu":
            cumulative = np.concatenate([[0.0], np.cumsum(self.counts[self.counts > 1]) / self.lookups])
            index = np.minimum(sizes, cumulative.size - 1).astype(np.int64)
            return cumulative[index]
        result = np.empty_like(sizes)
        distinct = float(multiplicity.sum())
        for i, c in enumerate(sizes):
            if c <= 0:
                result[i] = 0.0
            elif c >= distinct:
                result[i] = seen
            else:
                result[i] = _che_hit_rate(p, multiplicity, c)
        return result


def _che_hit_rate(p: np.ndarray, multiplicity: np.ndarray, cache_rows: float) -> float:
    """Che's approximation of LRU's hit rate: bisect the characteristic time T in log space."""
    lo, hi = np.log(1e-3 / p.max()), np.log(1e3 * cache_rows / p.min())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        occupied = float((multiplicity * -np.expm1(-p * np.exp(mid))).sum())
        if occupied < cache_rows:
            lo = mid
        else:
            hi = mid
    t = np.exp(0.5 * (lo + hi))
    return float((multiplicity * p * -np.expm1(-p * t)).sum())


@dataclass
class IdProfile:
    """Per-table profiles of one dataset split, and how they were sampled."""

    tables: list[TableProfile]
    sampled_rows: int
    split_rows: int
    seed: int


def profile_split(
    split: object, table_sizes: list[int], *, sample_rows: int = 1_000_000, seed: int = 0
) -> IdProfile:
    """Count ids on `sample_rows` rows of a split (`SplitArrays`-like: `.sparse` [n, T], one id per table)."""
    sparse = split.sparse  # type: ignore[attr-defined]
    n = int(sparse.shape[0])
    if n == 0:
        raise SlipcacheError("cannot profile an empty split")
    if sparse.shape[1] != len(table_sizes):
        raise SlipcacheError(f"the split has {sparse.shape[1]} tables, the dataset {len(table_sizes)}")
    take = min(n, sample_rows)
    rows = np.sort(np.random.default_rng(seed).choice(n, take, replace=False)) if take < n else None
    per_table: list[list[np.ndarray]] = [[] for _ in table_sizes]
    for start in range(0, take, READ_ROWS):
        block = np.asarray(
            sparse[rows[start : start + READ_ROWS]] if rows is not None else sparse[start : start + READ_ROWS]
        )
        for t in range(len(table_sizes)):
            per_table[t].append(block[:, t].astype(np.int64))
    tables = []
    for t, size in enumerate(table_sizes):
        ids = np.concatenate(per_table[t])
        if ids.size and (ids.min() < 0 or ids.max() >= size):
            raise SlipcacheError(f"table {t}: id {int(ids.max())} outside its {size} rows")
        _, counts = np.unique(ids, return_counts=True)
        bucket = ids * HISTOGRAM_BUCKETS // size
        histogram = np.bincount(bucket, minlength=HISTOGRAM_BUCKETS).astype(np.float64)
        tables.append(
            TableProfile(
                size, int(ids.size), np.sort(counts)[::-1].astype(np.int64), histogram, ids.size / take
            )
        )
    return IdProfile(tables, take, n, seed)
