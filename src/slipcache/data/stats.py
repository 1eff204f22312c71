"""Access-pattern statistics of Criteo-shaped data; `slipcache stats`.

Why: every cache hit rate and every skipped input depends on which rows are hot, how many inputs touch
only hot rows and how fast rows come and go. These figures say how a dataset (real, preprocessed or
synthetic) looks by exactly those measures, so synthetic data can be held against real logs.

Definitions (the sample is the rows read, after `max_rows`; a "value" is one distinct id of one table):
- Missing fields count as one value of their table. Raw files: an empty field is `criteo.MISSING` (-1).
  Preprocessed datasets: row 0, which is "empty" for the hash vocabulary and "empty, rare or unseen in
  train" for the frequency vocabulary. Synthetic datasets: none (unless meta.json names `missing_row`).
- A row's value *recurs* iff it occurs at least twice in the sample; singletons are values seen once.
  `recur_share`: share of rows whose value recurs; `singleton_share`: share of distinct values seen once.
- `top_share[f]`: share of lookups taken by the k = max(1, ceil(f * distinct)) most frequent values.
- `power_law_exponent`: s of count ~ rank^-s, least squares on log count vs log rank at 40 log-spaced
  ranks among the values that recur (the singleton tail is flat by construction); None if < 5 recur.
- Co-recurrence: share of rows whose values in all big tables recur, against the product of the tables'
  recur shares (what independent tables would give). Big tables: C3, C4, C12, C16, C21 for 26 tables,
  else the five with most distinct values.
- Hot inputs (Slipstream's rule): a budget of B bytes holds K = B / (4 * 16) fp32 rows of dim 16; the
  hot rows are the K values with the highest counts over all tables (ties broken by a hash of the value,
  so exactly K are hot); an input is hot iff all its lookups are hot. `hot_fractions` also sets K as a
  share of all distinct values, which stays informative on samples smaller than any byte budget.
- Over time (the rows in their order, cut into chunks of `chunk_rows`): `new_id_rate` is the share of a
  chunk's lookups whose value was not seen in earlier chunks; `top_overlap` is |A & B| / k for the top-k
  values (k = min(top_k, values recurring within each of the two chunks)) of consecutive chunks.

Memory: counts are exact while all tables together hold at most `max_values` distinct values. Beyond
that (the full Kaggle set has 33.8 M), the table with most values keeps only values whose hash falls
below a threshold that halves each time (distinct-value sampling: a kept value's count stays exact and
stands for 2^level values); the new-id rate is then estimated from the kept values. Per-row figures
(co-recurrence, correlation, hot inputs) use a uniform reservoir of `sample_rows` rows: exact when the
sample has no more rows, else estimates (binomial standard error <= 0.5 / sqrt(sample_rows)). When
counts were sampled, a second pass counts the reservoir's values exactly; the sampled tables' figures and
the hot-row thresholds then come from those lookups (a value seen c times stands for
rows / (sample lookups * c) values, so heavy values, which value sampling would catch or miss by luck,
are measured well). `exact` in the result says which figures are exact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from slipcache.data.criteo import MISSING, ReadStats, read_chunks
from slipcache.data.dataset import SPLIT_NAMES
from slipcache.data.formats import detect_format, open_any
from slipcache.data.preprocess import hash_ids
from slipcache.errors import InvalidInputError, SlipcacheError

CRITEO_BIG_TABLES = (2, 3, 11, 15, 20)  # C3, C4, C12, C16, C21: the tables with millions of values
NUM_BIG_TABLES = 5
TOP_FRACTIONS = (0.001, 0.01, 0.05)
DEFAULT_BUDGETS_MB = (64, 256, 1024)
DEFAULT_HOT_FRACTIONS = (0.01, 0.1)  # budgets as shares of the sample's values, for samples of any size
DEFAULT_CHUNK_ROWS = 100_000
DEFAULT_SAMPLE_ROWS = 262_144
DEFAULT_MAX_VALUES = 10_000_000  # 24 bytes each, ~50 bytes at the peak of a merge: < 0.5 GB
DEFAULT_TOP_K = 1000
HOT_DIM = 16
HOT_BYTES_PER_VALUE = 4  # fp32
HASH_SPACE = 1 << 31  # value hashes are 1 .. 2^31 - 1; the missing value hashes to 0
FIT_POINTS = 40
MIN_FIT_VALUES = 5
READ_ROWS = 262_144  # rows per read from a preprocessed dataset

Chunk = tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]  # categorical, dense, labels


@dataclass
class _Source:
    """Where the rows come from: `chunks(record=True)` starts a fresh pass over them (`record=False`: a
    second pass, whose malformed lines are not counted again)."""

    chunks: Callable[..., Iterator[Chunk]]
    info: dict[str, Any]
    missing_value: int | None
    total_rows: int | None = None
    read_stats: ReadStats | None = None


@dataclass
class _TableCounter:
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


# ---------------------------------------------------------------------------------------------- sources


def _natural_key(path: Path) -> list[Any]:
    """day_2 before day_10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.name)]


def _raw_source(files: list[Path], info: dict[str, Any]) -> _Source:
    stats = ReadStats()

    def chunks(record: bool = True) -> Iterator[Chunk]:
        target = stats if record else ReadStats()
        for path in files:
            try:
                for chunk in read_chunks(path, stats=target):
                    yield chunk.categorical, chunk.dense, chunk.labels
            except SlipcacheError as exc:
                if str(path) in str(exc):
                    raise
                raise SlipcacheError(f"{path}: {exc}") from exc

    source = _Source(
        chunks=chunks,
        info=info,
        missing_value=MISSING,
        read_stats=stats,
    )
    source.info["missing"] = f"empty field -> {MISSING}, counted as one value of its table"
    source.info["dense_missing"] = "empty field -> NaN"
    return source


def _dataset_source(path: Path, splits: Sequence[str] | None) -> _Source:
    dataset = open_any(path)  # a slipcache dataset or TorchRec / DLRM / MLPerf files (data.formats)
    names = list(splits) if splits else [s for s in SPLIT_NAMES if s in dataset.splits]
    names += [s for s in dataset.splits if not splits and s not in names]
    arrays = [(name, dataset.split(name)) for name in names]  # validates names and shapes
    vocabulary = dataset.meta.get("vocabulary")
    if "missing_row" in dataset.meta:
        missing = dataset.meta["missing_row"]
        missing_text = f"row {missing} (meta.json missing_row)"
    elif vocabulary == "hash":
        missing, missing_text = 0, "row 0 = empty field (hash vocabulary)"
    elif vocabulary == "frequency":
        missing, missing_text = (
            0,
            "row 0 = empty field, rare value or value unseen in train (frequency vocabulary)",
        )
    else:
        missing, missing_text = None, "none (no row stands for an empty field)"

    def chunks(record: bool = True) -> Iterator[Chunk]:
        for _, split in arrays:
            for start in range(0, len(split), READ_ROWS):
                end = min(start + READ_ROWS, len(split))
                yield (
                    np.asarray(split.sparse[start:end], dtype=np.int64),
                    None,
                    np.asarray(split.labels[start:end]),
                )

    info = {
        "path": str(path),
        "kind": "dataset",
        "vocabulary": vocabulary,
        "generator": dataset.meta.get("generator"),
        "splits": {name: len(split) for name, split in arrays},
        "missing": missing_text,
        "dense_missing": "not recorded (the dataset stores missing dense features as 0)",
    }
    return _Source(chunks, info, None if missing is None else int(missing), sum(len(s) for _, s in arrays))


def open_source(path: str | os.PathLike[str], splits: Sequence[str] | None = None) -> _Source:
    """A raw Criteo file, a directory of raw files (in natural name order) or a dataset directory."""
    p = Path(path)
    if p.is_dir():
        if (p / "meta.json").is_file() or detect_format(p) is not None:
            return _dataset_source(p, splits)
        files = sorted(
            (f for f in p.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix != ".md"),
            key=_natural_key,
        )
        if not files:
            raise SlipcacheError(f"{p}: no data files in this directory")
        return _raw_source(files, {"path": str(p), "kind": "raw", "files": [f.name for f in files]})
    if not p.exists():
        raise SlipcacheError(f"{p}: no such file or directory")
    return _raw_source([p], {"path": str(p), "kind": "raw"})


def _rechunk(chunks: Iterator[Chunk], chunk_rows: int, max_rows: int | None) -> Iterator[Chunk]:
    """The rows in order, cut into pieces of exactly `chunk_rows` (the last may be shorter)."""
    parts: list[Chunk] = []
    buffered = 0
    taken = 0

    def cut(parts: list[Chunk], n: int) -> tuple[Chunk, list[Chunk]]:
        joined = tuple(None if p[0] is None else np.concatenate(p) for p in zip(*parts, strict=True))
        cats, dense, labels = joined
        head = (cats[:n], None if dense is None else dense[:n], None if labels is None else labels[:n])
        rest = (cats[n:], None if dense is None else dense[n:], None if labels is None else labels[n:])
        return head, ([rest] if len(rest[0]) else [])  # type: ignore[return-value]

    try:
        for chunk in chunks:
            if max_rows is not None and taken + len(chunk[0]) >= max_rows:
                keep = max_rows - taken
                chunk = (chunk[0][:keep], *(None if a is None else a[:keep] for a in chunk[1:]))  # type: ignore[assignment]
            parts.append(chunk)
            buffered += len(chunk[0])
            taken += len(chunk[0])
            while buffered >= chunk_rows:
                head, parts = cut(parts, chunk_rows)
                buffered -= chunk_rows
                yield head
            if max_rows is not None and taken >= max_rows:
                break
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    if buffered:
        yield cut(parts, buffered)[0]


# ---------------------------------------------------------------------------------------------- figures


def _table_figures(
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
            top[_fraction_name(fraction)] = 1.0 if rows else None
            continue
        before = float(cum_lookups[i - 1]) if i else 0.0
        rank_before = float(cum[i - 1]) if i else 0.0
        top[_fraction_name(fraction)] = (before + (k - rank_before) * counts[i]) / rows
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


def _fraction_name(fraction: float) -> str:
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


@dataclass
class _Histogram:
    """Values of one table as (count, how many values have it); `hashes` only when counts are exact."""

    counts: np.ndarray
    weights: np.ndarray
    hashes: np.ndarray | None


def _size_biased_histogram(counts: np.ndarray, rows: int) -> _Histogram:
    """Estimated values per count from the counts of a uniform sample of lookups: a value seen c times
    is sampled about c times as often as a value seen once, so each sampled lookup stands for
    rows / (len(counts) * c) values."""
    unique, lookups = np.unique(counts, return_counts=True)
    return _Histogram(unique, lookups * rows / (len(counts) * unique.astype(np.float64)), None)


def _hot_threshold(histograms: list[_Histogram], rows_budget: int) -> tuple[int, float, float]:
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


def _pearson(indicators: np.ndarray) -> np.ndarray:
    """Correlation matrix of 0/1 columns; NaN where a column is constant."""
    x = indicators.astype(np.float64)
    x -= x.mean(axis=0)
    norms = np.sqrt((x * x).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x.T @ x) / np.outer(norms, norms)


def _clean(value: Any) -> Any:
    """JSON-ready: numpy scalars to Python, NaN/inf to None, rounded floats."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.ndarray):
        return _clean(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if not math.isfinite(v):
            return None
        return round(v, 6)
    return value


# ---------------------------------------------------------------------------------------------- main


def _compute(
    source: _Source,
    *,
    max_rows: int | None,
    chunk_rows: int,
    budgets_mb: Sequence[float],
    hot_fractions: Sequence[float],
    sample_rows: int,
    max_values: int,
    top_k: int,
    big_tables: Sequence[int] | None,
    seed: int,
    progress: bool,
) -> dict[str, Any]:
    if max_rows is not None and max_rows < 1:
        raise SlipcacheError(f"--max-rows must be at least 1, got {max_rows}")
    if chunk_rows < 1 or sample_rows < 1 or max_values < 1 or top_k < 1:
        raise SlipcacheError("chunk_rows, sample_rows, max_values and top_k must be at least 1")
    if not budgets_mb or any(not b > 0 for b in budgets_mb):
        raise SlipcacheError(f"budgets must be positive megabytes, got {list(budgets_mb)}")
    if any(not 0 < f <= 1 for f in hot_fractions):
        raise SlipcacheError(f"hot fractions must be in (0, 1], got {list(hot_fractions)}")
    total = source.total_rows if max_rows is None else min(max_rows, source.total_rows or max_rows)
    rng = np.random.default_rng(seed)
    counters: list[_TableCounter] = []
    rows = 0
    positives = 0.0
    label_rows = 0
    dense_missing: np.ndarray | None = None
    dense_rows = 0
    missing_counts: np.ndarray | None = None
    reservoir = np.empty((0, 0), dtype=np.int64)
    reservoir_keys = np.empty(0)
    chunks_out: list[dict[str, Any]] = []
    previous_top: list[np.ndarray | None] = []
    with tqdm(total=total, unit="rows", unit_scale=True, desc="stats", disable=not progress) as bar:
        for cats, dense, labels in _rechunk(source.chunks(), chunk_rows, max_rows):
            n, num_tables = cats.shape
            if not counters:
                counters = [_TableCounter(t, source.missing_value) for t in range(num_tables)]
                missing_counts = np.zeros(num_tables, dtype=np.int64)
                reservoir = np.empty((0, num_tables), dtype=np.int64)
                previous_top = [None] * num_tables
            elif num_tables != len(counters):
                raise InvalidInputError(f"rows with {num_tables} tables after rows with {len(counters)}")
            new_lookups = np.zeros(num_tables)
            overlap: list[float | None] = []
            for t, counter in enumerate(counters):
                values, counts = np.unique(cats[:, t], return_counts=True)
                hashes = counter.hash(values)
                new_lookups[t] = counter.add(values, counts, hashes)
                overlap_t, previous_top[t] = _top_overlap(values, counts, hashes, previous_top[t], top_k)
                overlap.append(overlap_t)
                if source.missing_value is not None:
                    missing_counts[t] += int((cats[:, t] == source.missing_value).sum())  # type: ignore[index]
            while sum(len(c.values) for c in counters) > max_values:
                biggest = max(counters, key=lambda c: len(c.values))
                if len(biggest.values) <= 1:
                    break
                biggest.coarsen()
            chunks_out.append(
                {
                    "start": rows,
                    "rows": n,
                    "new_id_rate": float(new_lookups.sum()) / (n * num_tables),
                    "new_id_rate_per_table": new_lookups / n,
                    "top_overlap_per_table": overlap,
                }
            )
            keys = rng.random(n)
            pool = np.concatenate([reservoir, cats])
            pool_keys = np.concatenate([reservoir_keys, keys])
            if len(pool_keys) > sample_rows:
                keep = np.argpartition(pool_keys, sample_rows - 1)[:sample_rows]
                pool, pool_keys = pool[keep], pool_keys[keep]
            reservoir, reservoir_keys = pool, pool_keys
            if labels is not None:
                positives += float(labels.sum())
                label_rows += n
            if dense is not None:
                nan = np.isnan(dense).sum(axis=0)
                dense_missing = nan if dense_missing is None else dense_missing + nan
                dense_rows += n
            rows += n
            bar.update(n)
    if rows == 0:
        bad = source.read_stats.bad if source.read_stats else 0
        first = (
            f"; first: {source.read_stats.examples[0]}"
            if source.read_stats and source.read_stats.examples
            else ""
        )
        raise SlipcacheError(f"no rows to measure ({bad} malformed lines{first})")

    num_tables = len(counters)
    exact_counts = all(c.level == 0 for c in counters)
    exact_rows = len(reservoir) == rows
    names = [f"C{t + 1}" for t in range(num_tables)]
    # Counts of the reservoir's values: looked up, or counted in a second pass if counts were sampled.
    if exact_counts:
        sample_counts = np.stack([c.lookup(reservoir[:, t]) for t, c in enumerate(counters)], axis=1)
    else:
        sample_counts = _recount(source, reservoir, chunk_rows, max_rows, progress)
    sample_hashes = np.stack([c.hash(reservoir[:, t]) for t, c in enumerate(counters)], axis=1)
    histograms = [
        _Histogram(c.counts, np.ones(len(c.counts)), c.hashes)
        if c.level == 0
        else _size_biased_histogram(sample_counts[:, t], rows)
        for t, c in enumerate(counters)
    ]
    tables = []
    for t, (counter, histogram) in enumerate(zip(counters, histograms, strict=True)):
        figures = _table_figures(
            histogram.counts,
            histogram.weights,
            rows,
            None if missing_counts is None or source.missing_value is None else int(missing_counts[t]),
        )
        tables.append(
            {"name": names[t], **figures, "exact": counter.level == 0, "sampling_level": counter.level}
        )

    recurs = sample_counts >= 2
    if big_tables is None:
        if num_tables == 26:
            big = list(CRITEO_BIG_TABLES)
        else:
            by_distinct = sorted(range(num_tables), key=lambda t: -tables[t]["distinct"])
            big = sorted(by_distinct[:NUM_BIG_TABLES])
    else:
        big = sorted(set(big_tables))
        if not big or any(not 0 <= t < num_tables for t in big):
            raise SlipcacheError(
                f"big tables must be table indices 0..{num_tables - 1}, got {list(big_tables)}"
            )
    together = float(recurs[:, big].all(axis=1).mean())
    independent = float(np.prod([tables[t]["recur_share"] for t in big]))
    correlation = _pearson(recurs)
    big_pairs = [correlation[a, b] for i, a in enumerate(big) for b in big[i + 1 :]]
    big_pairs = [c for c in big_pairs if np.isfinite(c)]

    total_values = sum(table["distinct"] for table in tables)
    budgets = [("budget_mb", b, int(b * (1 << 20) // (HOT_BYTES_PER_VALUE * HOT_DIM))) for b in budgets_mb]
    budgets += [("budget_fraction", f, int(round(f * total_values))) for f in hot_fractions]
    hot: list[dict[str, Any]] = []
    for kind, budget, budget_rows in budgets:
        t, cutoff, hot_lookups = _hot_threshold(histograms, budget_rows)
        is_hot = (sample_counts > t) | ((sample_counts == t) & (sample_hashes <= cutoff))
        hot.append(
            {
                kind: budget,
                "hot_rows": budget_rows,
                "count_threshold": t,
                "hot_lookup_share": hot_lookups / (rows * num_tables),
                "hot_input_share": float(is_hot.all(axis=1).mean()),
            }
        )

    sample_error = (
        0.0 if exact_rows else 0.5 / math.sqrt(len(reservoir))
    )  # the largest binomial standard error, at p = 0.5
    over_time = _over_time(chunks_out, big)
    result = {
        "source": {
            **source.info,
            **(
                {
                    "formats": source.read_stats.formats,
                    "good_lines": source.read_stats.good,
                    "bad_lines": source.read_stats.bad,
                    "bad_examples": source.read_stats.examples,
                }
                if source.read_stats is not None
                else {}
            ),
        },
        "rows": rows,
        "max_rows": max_rows,
        "num_tables": num_tables,
        "positive_rate": positives / label_rows if label_rows else None,
        "dense_missing_rate": None if dense_missing is None else dense_missing / dense_rows,
        "tables": tables,
        "big_tables": [names[t] for t in big],
        "co_recurrence": {
            "all_recur": together,
            "independent": independent,
            "ratio": together / independent if independent > 0 else None,
        },
        "recurrence_correlation": {
            "tables": names,
            "matrix": correlation,
            "big_tables_mean": float(np.mean(big_pairs)) if big_pairs else None,
            "big_tables_min": float(np.min(big_pairs)) if big_pairs else None,
        },
        "hot_inputs": [h for h in hot if "budget_mb" in h],
        "hot_inputs_by_fraction": [h for h in hot if "budget_fraction" in h],
        "over_time": over_time,
        "settings": {
            "chunk_rows": chunk_rows,
            "sample_rows": sample_rows,
            "rows_sampled": len(reservoir),
            "max_values": max_values,
            "top_k": top_k,
            "hot_dim": HOT_DIM,
            "hot_bytes_per_value": HOT_BYTES_PER_VALUE,
            "seed": seed,
        },
        "exact": {
            "per_table": exact_counts,
            "co_recurrence": exact_rows,
            "recurrence_correlation": exact_rows,
            "hot_lookup_share": exact_counts,
            "hot_input_share": exact_rows and exact_counts,
            "new_id_rate": exact_counts,
            "top_overlap": True,
            "sample_standard_error": sample_error,
        },
    }
    return _clean(result)


def _top_overlap(
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


def _over_time(chunks: list[dict[str, Any]], big: list[int]) -> dict[str, Any]:
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


def _recount(
    source: _Source, reservoir: np.ndarray, chunk_rows: int, max_rows: int | None, progress: bool
) -> np.ndarray:
    """Exact counts over the whole sample of the values in the reservoir (a second pass)."""
    keys = [np.unique(reservoir[:, t]) for t in range(reservoir.shape[1])]
    totals = [np.zeros(len(k), dtype=np.int64) for k in keys]
    chunks = source.chunks(record=False)
    with tqdm(unit="rows", unit_scale=True, desc="recount", disable=not progress) as bar:
        for cats, _, _ in _rechunk(chunks, chunk_rows, max_rows):
            for t, k in enumerate(keys):
                values, counts = np.unique(cats[:, t], return_counts=True)
                pos = np.minimum(np.searchsorted(k, values), len(k) - 1)
                match = k[pos] == values
                np.add.at(totals[t], pos[match], counts[match])
            bar.update(len(cats))
    return np.stack(
        [totals[t][np.searchsorted(keys[t], reservoir[:, t])] for t in range(reservoir.shape[1])], axis=1
    )


def compute_stats(
    source: str | os.PathLike[str],
    *,
    max_rows: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    budgets_mb: Sequence[float] = DEFAULT_BUDGETS_MB,
    progress: bool = False,
    hot_fractions: Sequence[float] = DEFAULT_HOT_FRACTIONS,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    max_values: int = DEFAULT_MAX_VALUES,
    top_k: int = DEFAULT_TOP_K,
    big_tables: Sequence[int] | None = None,
    splits: Sequence[str] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Statistics (see the module docstring) of a raw Criteo file or directory, or a dataset directory
    (all of its splits in the order train, val, test unless `splits` names some). JSON-serializable."""
    return _compute(
        open_source(source, splits),
        max_rows=max_rows,
        chunk_rows=chunk_rows,
        budgets_mb=budgets_mb,
        hot_fractions=hot_fractions,
        sample_rows=sample_rows,
        max_values=max_values,
        top_k=top_k,
        big_tables=big_tables,
        seed=seed,
        progress=progress,
    )


def compute_stats_arrays(
    categorical: np.ndarray,
    dense: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    *,
    missing_value: int | None = None,
    max_rows: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    budgets_mb: Sequence[float] = DEFAULT_BUDGETS_MB,
    progress: bool = False,
    hot_fractions: Sequence[float] = DEFAULT_HOT_FRACTIONS,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    max_values: int = DEFAULT_MAX_VALUES,
    top_k: int = DEFAULT_TOP_K,
    big_tables: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Statistics of in-memory rows: categorical integer ids [n, tables] in time order; `missing_value`
    is the id that stands for an empty field (None: no field is empty); dense NaN = missing."""
    cats = np.asarray(categorical)
    if cats.ndim != 2 or not np.issubdtype(cats.dtype, np.integer) or cats.shape[1] < 1:
        raise InvalidInputError(
            f"categorical must be an integer array [rows, tables], got {cats.dtype} {cats.shape}"
        )
    n = len(cats)
    for name, arr, ndim in (("dense", dense, 2), ("labels", labels, 1)):
        if arr is not None and (np.ndim(arr) != ndim or len(arr) != n):
            raise InvalidInputError(
                f"{name} must have {ndim} dimension(s) and {n} rows, got shape {np.shape(arr)}"
            )

    def chunks(record: bool = True) -> Iterator[Chunk]:
        for start in range(0, n, READ_ROWS):
            end = min(start + READ_ROWS, n)
            yield (
                cats[start:end].astype(np.int64),
                None if dense is None else np.asarray(dense[start:end], dtype=np.float32),
                None if labels is None else np.asarray(labels[start:end]),
            )

    info = {
        "kind": "arrays",
        "missing": "none"
        if missing_value is None
        else f"id {missing_value}, counted as one value of its table",
        "dense_missing": "NaN" if dense is not None else "no dense features given",
    }
    source = _Source(chunks, info, missing_value, n)
    return _compute(
        source,
        max_rows=max_rows,
        chunk_rows=chunk_rows,
        budgets_mb=budgets_mb,
        hot_fractions=hot_fractions,
        sample_rows=sample_rows,
        max_values=max_values,
        top_k=top_k,
        big_tables=big_tables,
        seed=seed,
        progress=progress,
    )


# ---------------------------------------------------------------------------------------------- output


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_stats(stats: dict[str, Any]) -> str:
    """A readable report of `compute_stats`'s result."""
    src = stats["source"]
    lines = [f"source: {src.get('path', src['kind'])} ({src['kind']})"]
    if "bad_lines" in src:
        formats = ", ".join(sorted(set(src["formats"].values())))
        lines.append(
            f"  lines: {src['good_lines']} good, {src['bad_lines']} malformed (skipped); format {formats}"
        )
        lines.extend(f"    {example}" for example in src["bad_examples"])
    if src.get("splits"):
        lines.append("  splits: " + ", ".join(f"{k} {v}" for k, v in src["splits"].items()))
    lines.append(f"  missing categorical: {src['missing']}")
    rows = f"rows: {stats['rows']:,}"
    if stats["positive_rate"] is not None:
        rows += f", positive rate {stats['positive_rate']:.4f}"
    lines += [rows, ""]
    fractions = list(stats["tables"][0]["top_share"])
    header = f"{'table':>5} {'distinct':>10} {'missing':>7} " + " ".join(f"{'top' + f:>7}" for f in fractions)
    header += f" {'recur':>6} {'single':>6} {'zipf s':>6}"
    lines.append(header)
    big = set(stats["big_tables"])
    for table in stats["tables"]:
        mark = "*" if table["name"] in big else " "
        line = f"{mark}{table['name']:>4} {table['distinct']:>10,.0f} {_num(table['missing_rate']):>7} "
        line += " ".join(f"{_num(table['top_share'][f]):>7}" for f in fractions)
        line += f" {_num(table['recur_share']):>6} {_num(table['singleton_share']):>6}"
        line += f" {_num(table['power_law_exponent'], 2):>6}"
        lines.append(line)
    lines.append(
        "  top x%: share of lookups on the top x% of values; recur: share of rows whose value occurs >= 2 times;"
    )
    lines.append(
        "  single: share of values seen once; zipf s: count ~ rank^-s over recurring values; * big table"
    )
    co = stats["co_recurrence"]
    corr = stats["recurrence_correlation"]
    lines += [
        "",
        f"big tables {', '.join(stats['big_tables'])}: all recur in {_num(co['all_recur'])} of rows; "
        f"if independent {_num(co['independent'])}" + (f" (x{co['ratio']:.1f})" if co["ratio"] else ""),
        f"correlation of recurrence between big tables: mean {_num(corr['big_tables_mean'])}, "
        f"min {_num(corr['big_tables_min'])}",
        "hot inputs (all lookups among the top rows by count; dim 16 fp32):",
    ]
    for entry in stats["hot_inputs"] + stats["hot_inputs_by_fraction"]:
        budget = (
            f"{entry['budget_mb']:>6g} MB"
            if "budget_mb" in entry
            else f"{entry['budget_fraction'] * 100:>5g}% of values"
        )
        lines.append(
            f"  {budget} = {entry['hot_rows']:>10,} rows: hot inputs {entry['hot_input_share']:.3f}, "
            f"hot lookups {entry['hot_lookup_share']:.3f} (count threshold {entry['count_threshold']})"
        )
    time = stats["over_time"]
    chunks = time["chunks"]
    lines.append(
        f"over time ({len(chunks)} chunks of {stats['settings']['chunk_rows']:,} rows, in read order):"
    )
    if len(chunks) < 2:
        lines.append("  one chunk only: no over-time figures (use a smaller --chunk-rows)")
    else:
        lines.append(
            f"  new-id rate after the first chunk: mean {_num(time['new_id_rate_mean'])}, last "
            f"{_num(time['new_id_rate_last'])} (big tables {_num(time['new_id_rate_big_tables_mean'])})"
        )
        lines.append(
            f"  top-{stats['settings']['top_k']} overlap of consecutive chunks, big tables: "
            f"mean {_num(time['top_overlap_big_tables_mean'])}"
        )
    exact = stats["exact"]
    approximate = [k for k, v in exact.items() if v is False]
    if approximate:
        lines.append(
            f"approximate: {', '.join(approximate)} (per-row figures on {stats['settings']['rows_sampled']:,} "
            f"sampled rows, standard error <= {exact['sample_standard_error']:.4f})"
        )
    else:
        lines.append("all figures exact")
    return "\n".join(lines)


def plot_stats(stats: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """A PNG of the rank-frequency curves, per-table shares, recurrence correlation, hot inputs and time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from slipcache.training.report import STYLE

    out = Path(path)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
        ax = axes[0, 0]
        big = set(stats["big_tables"])
        for table in stats["tables"]:
            curve = np.array(table["rank_frequency"], dtype=float)
            if len(curve):
                ax.loglog(curve[:, 0], curve[:, 1], lw=2 if table["name"] in big else 0.7,
                          label=table["name"] if table["name"] in big else None)  # fmt: skip
        ax.set(xlabel="rank", ylabel="count", title="value counts by rank (bold: big tables)")
        ax.legend()

        ax = axes[0, 1]
        x = np.arange(len(stats["tables"]))
        ax.bar(x - 0.2, [t["recur_share"] for t in stats["tables"]], 0.4, label="rows whose value recurs")
        ax.bar(
            x + 0.2, [t["top_share"]["1%"] for t in stats["tables"]], 0.4, label="lookups on top 1% of values"
        )
        ax.set_xticks(x, [t["name"] for t in stats["tables"]], rotation=90)
        ax.set(ylim=(0, 1.05), title="per table")
        ax.legend()

        ax = axes[0, 2]
        matrix = np.array(
            [[np.nan if v is None else v for v in row] for row in stats["recurrence_correlation"]["matrix"]]
        )
        image = ax.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu_r")
        names = stats["recurrence_correlation"]["tables"]
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title("correlation of recurrence")
        ax.grid(False)
        fig.colorbar(image, ax=ax, shrink=0.8)

        ax = axes[1, 0]
        co = stats["co_recurrence"]
        ax.bar(
            ["all big tables recur", "if independent"],
            [co["all_recur"], co["independent"]],
            color=["C0", "C7"],
        )
        ax.set(ylim=(0, 1), title=f"co-recurrence of {', '.join(stats['big_tables'])}")

        ax = axes[1, 1]
        hot = sorted(stats["hot_inputs"] + stats["hot_inputs_by_fraction"], key=lambda h: h["hot_rows"])
        hot_rows = [max(h["hot_rows"], 1) for h in hot]
        ax.semilogx(hot_rows, [h["hot_input_share"] for h in hot], "o-", label="hot inputs")
        ax.semilogx(hot_rows, [h["hot_lookup_share"] for h in hot], "s--", label="hot lookups")
        for h, x in zip(hot, hot_rows, strict=True):
            tag = f"{h['budget_mb']:g} MB" if "budget_mb" in h else f"{h['budget_fraction']:.0%}"
            ax.annotate(
                tag, (x, h["hot_input_share"]), textcoords="offset points", xytext=(4, -12), fontsize=8
            )
        ax.set(
            xlabel="hot rows (budget in MB at dim 16 fp32, or % of values)",
            ylim=(0, 1.05),
            title="hot inputs",
        )
        ax.legend()

        ax = axes[1, 2]
        chunks = stats["over_time"]["chunks"][1:]
        if chunks:
            starts = [c["start"] for c in chunks]
            ax.plot(starts, [c["new_id_rate"] for c in chunks], "o-", label="new-id rate (all tables)")
            ax.plot(
                starts,
                [c["top_overlap_big_tables"] for c in chunks],
                "s-",
                label="top-row overlap (big tables)",
            )
            ax.legend()
        else:
            ax.text(0.5, 0.5, "one chunk only", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="first row of chunk", ylim=(0, 1.05), title="over time")
        fig.suptitle(f"{stats['source'].get('path', stats['source']['kind'])}: {stats['rows']:,} rows")
        fig.tight_layout()
        fig.savefig(out)
        plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------- CLI


def _positive_list(text: str) -> list[float]:
    """'64,256,1024' -> [64.0, 256.0, 1024.0] (for argparse)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 64,256,1024, got {text!r}"
        ) from exc
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH", help="raw Criteo file or directory (tsv/csv, .gz too) or a dataset"
    )
    parser.add_argument("--max-rows", type=int, default=None, help="measure only the first N rows")
    parser.add_argument("--json", metavar="FILE", help="also write the statistics as JSON ('-': stdout only)")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw them into a PNG")
    parser.add_argument(
        "--budgets-mb", type=_positive_list, default=list(DEFAULT_BUDGETS_MB),
        help="hot-row budgets in MB for the hot-input share (default 64,256,1024)",
    )  # fmt: skip
    parser.add_argument(
        "--hot-fractions", type=_positive_list, default=list(DEFAULT_HOT_FRACTIONS),
        help="hot-row budgets as shares of the sample's values (default 0.01,0.1)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
        help="rows per chunk for the over-time figures (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--sample-rows", type=int, default=DEFAULT_SAMPLE_ROWS,
        help="rows kept for per-row figures; more rows make them estimates (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-values", type=int, default=DEFAULT_MAX_VALUES,
        help="distinct values counted exactly before counts are sampled (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--split", action="append", help="dataset split to read (repeatable; default all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row sample")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_stats(args: argparse.Namespace) -> int:
    stats = compute_stats(
        args.path,
        max_rows=args.max_rows,
        chunk_rows=args.chunk_rows,
        budgets_mb=args.budgets_mb,
        hot_fractions=args.hot_fractions,
        progress=not args.quiet,
        sample_rows=args.sample_rows,
        max_values=args.max_values,
        splits=args.split,
        seed=args.seed,
    )
    if args.plot:
        plot_stats(stats, args.plot)
    if args.json == "-":
        json.dump(stats, sys.stdout, indent=1)
        print()
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=1) + "\n")
    print(format_stats(stats))
    return 0
