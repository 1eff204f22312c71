"""Counting each table's distinct values within a memory bound.

Why sampling by hash: the full Kaggle set has 33.8 M values; keeping only values whose hash falls below a
threshold keeps each kept value's count exact, and it stands for 2^level values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slipcache.data.preprocess import hash_ids

HASH_SPACE = 1 << 31  # value hashes are 1 .. 2^31 - 1; the missing value hashes to 0


@dataclass
class TableCounter:
    """Counts of the kept values of one table; kept means hash < HASH_SPACE >> level (all at level 0)."""

    table: int
    missing_value: int | None
    values: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    level: int = 0

    def hash(self, values: np.ndarray) -> np.ndarray:
        return value_hash(values, self.table, self.missing_value)

    def weights(self, hashes: np.ndarray) -> np.ndarray:
        """How many values each kept value stands for (the missing value is always kept, so 1)."""
        return np.where(hashes == 0, 1.0, float(1 << self.level))

    def add(self, values: np.ndarray, counts: np.ndarray, hashes: np.ndarray) -> float:
        """Count a chunk's distinct values; returns the estimated lookups of values not seen before."""
        keep = hashes < (HASH_SPACE >> self.level)
        values, counts, hashes = values[keep], counts[keep], hashes[keep]
        pos = np.searchsorted(self.values, values)
        found = np.zeros(len(values), dtype=bool)
        if len(self.values):
            found = self.values[np.minimum(pos, len(self.values) - 1)] == values
        self.counts[pos[found]] += counts[found]
        new = ~found
        self.values = np.insert(self.values, pos[new], values[new])
        self.counts = np.insert(self.counts, pos[new], counts[new])
        self.hashes = np.insert(self.hashes, pos[new], hashes[new])
        return float((counts[new] * self.weights(hashes[new])).sum())

    def coarsen(self) -> None:
        """Halve the kept share of values (one level up), dropping the others."""
        self.level += 1
        keep = self.hashes < (HASH_SPACE >> self.level)
        self.values, self.counts, self.hashes = self.values[keep], self.counts[keep], self.hashes[keep]

    def lookup(self, values: np.ndarray) -> np.ndarray:
        """Counts of `values` (0 for values not kept)."""
        if not len(self.values):
            return np.zeros(len(values), dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.values, values), len(self.values) - 1)
        return np.where(self.values[pos] == values, self.counts[pos], 0)


def value_hash(values: np.ndarray, table: int, missing_value: int | None) -> np.ndarray:
    """A 31-bit hash of each value, salted by the table; 0 for the missing value (always kept)."""
    hashes = hash_ids(np.asarray(values, dtype=np.int64), HASH_SPACE, seed=table).astype(np.int64)
    if missing_value is not None:
        hashes[values == missing_value] = 0
    return hashes


@dataclass
class Histogram:
    """Values of one table as (count, how many values have it); `hashes` only when counts are exact."""

    counts: np.ndarray
    weights: np.ndarray
    hashes: np.ndarray | None


def size_biased_histogram(counts: np.ndarray, rows: int) -> Histogram:
    """Estimated values per count from the counts of a uniform sample of lookups: a value seen c times
    is sampled about c times as often as a value seen once, so each sampled lookup stands for
    rows / (len(counts) * c) values."""
    unique, lookups = np.unique(counts, return_counts=True)
    return Histogram(unique, lookups * rows / (len(counts) * unique.astype(np.float64)), None)
