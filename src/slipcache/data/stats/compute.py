"""One or two passes over a source that turn its rows into the statistics (`compute_stats`)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slipcache.data.stats.counting import Histogram, TableCounter, size_biased_histogram
from slipcache.data.stats.figures import (
    chunk_top_overlap,
    hot_threshold,
    over_time_figures,
    pearson,
    table_figures,
)
from slipcache.data.stats.signal import DEFAULT_SIGNAL_ROWS, lookup_share_by_count, signal_figures
from slipcache.data.stats.sources import READ_ROWS, Chunk, Source, open_source, rechunk
from slipcache.errors import InvalidInputError, SlipcacheError
from slipcache.progress import progress_bar

CRITEO_BIG_TABLES = (2, 3, 11, 15, 20)  # C3, C4, C12, C16, C21: the tables with millions of values
NUM_BIG_TABLES = 5
DEFAULT_BUDGETS_MB = (64, 256, 1024)
DEFAULT_HOT_FRACTIONS = (0.01, 0.1)  # budgets as shares of the sample's values, for samples of any size
DEFAULT_CHUNK_ROWS = 100_000
DEFAULT_SAMPLE_ROWS = 262_144
DEFAULT_MAX_VALUES = 10_000_000  # 24 bytes each, ~50 bytes at the peak of a merge: < 0.5 GB
DEFAULT_TOP_K = 1000
HOT_DIM = 16
HOT_BYTES_PER_VALUE = 4  # fp32


def json_ready(value: Any) -> Any:
    """JSON-ready: numpy scalars to Python, NaN/inf to None, rounded floats."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_ready(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if not math.isfinite(v):
            return None
        return round(v, 6)
    return value


@dataclass
class _Scan:
    """What the pass over the rows collects; every figure is computed from it afterwards."""

    counters: list[TableCounter]  # per table: counts of its (kept) values
    missing_counts: np.ndarray | None  # per table: lookups of the missing value
    reservoir: np.ndarray  # a uniform sample of at most `sample_rows` rows, for the per-row figures
    chunks: list[dict[str, Any]]  # per chunk of `chunk_rows`: new-id rates and top-value overlap
    rows: int
    positives: float
    label_rows: int
    dense_missing: np.ndarray | None  # per dense feature: NaN count
    dense_rows: int
    kept: list[Chunk]  # the first `signal_rows` rows, for the signal figures (`stats.signal`)


def _scan(
    source: Source,
    *,
    max_rows: int | None,
    chunk_rows: int,
    sample_rows: int,
    max_values: int,
    top_k: int,
    seed: int,
    progress: bool,
    signal_rows: int = DEFAULT_SIGNAL_ROWS,
) -> _Scan:
    """One pass in row order: counts within `max_values` (coarsening the biggest table when over), the
    reservoir sample and the per-chunk figures."""
    total = source.total_rows if max_rows is None else min(max_rows, source.total_rows or max_rows)
    rng = np.random.default_rng(seed)
    counters: list[TableCounter] = []
    rows = 0
    positives = 0.0
    label_rows = 0
    dense_missing: np.ndarray | None = None
    dense_rows = 0
    missing_counts: np.ndarray | None = None
    reservoir = np.empty((0, 0), dtype=np.int64)
    reservoir_keys = np.empty(0)
    chunks_out: list[dict[str, Any]] = []
    kept: list[Chunk] = []
    kept_rows = 0
    previous_top: list[np.ndarray | None] = []
    with progress_bar(total=total, unit="rows", unit_scale=True, desc="stats", disable=not progress) as bar:
        for cats, dense, labels in rechunk(source.chunks(), chunk_rows, max_rows):
            n, num_tables = cats.shape
            if not counters:
                counters = [TableCounter(t, source.missing_value) for t in range(num_tables)]
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
                overlap_t, previous_top[t] = chunk_top_overlap(values, counts, hashes, previous_top[t], top_k)
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
            if kept_rows < signal_rows:
                take = min(n, signal_rows - kept_rows)
                kept.append((cats[:take].copy(), None if dense is None else dense[:take].copy(),
                             None if labels is None else labels[:take].copy()))
                kept_rows += take
            if labels is not None:
                positives += float(labels.sum())
                label_rows += n
            if dense is not None and source.dense_nan_is_missing:
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
    return _Scan(counters, missing_counts, reservoir, chunks_out, rows, positives, label_rows, dense_missing,
                 dense_rows, kept)


def _compute(
    source: Source,
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
    signal_rows: int = DEFAULT_SIGNAL_ROWS,
) -> dict[str, Any]:
    """Arguments checked before any row is read, one `_scan`, then every figure from what it collected."""
    if max_rows is not None and max_rows < 1:
        raise SlipcacheError(f"--max-rows must be at least 1, got {max_rows}")
    if chunk_rows < 1 or sample_rows < 1 or max_values < 1 or top_k < 1 or signal_rows < 1:
        raise SlipcacheError("chunk_rows, sample_rows, max_values, top_k and signal_rows must be at least 1")
    if not budgets_mb or any(not b > 0 for b in budgets_mb):
        raise SlipcacheError(f"budgets must be positive megabytes, got {list(budgets_mb)}")
    if any(not 0 < f <= 1 for f in hot_fractions):
        raise SlipcacheError(f"hot fractions must be in (0, 1], got {list(hot_fractions)}")
    scan = _scan(source, max_rows=max_rows, chunk_rows=chunk_rows, sample_rows=sample_rows, max_values=max_values,
                 top_k=top_k, seed=seed, progress=progress, signal_rows=signal_rows)
    counters, reservoir, missing_counts, rows = scan.counters, scan.reservoir, scan.missing_counts, scan.rows

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
        Histogram(c.counts, np.ones(len(c.counts)), c.hashes)
        if c.level == 0
        else size_biased_histogram(sample_counts[:, t], rows)
        for t, c in enumerate(counters)
    ]
    kept = scan.kept
    signal = signal_figures(
        np.concatenate([c for c, _, _ in kept]),
        None if any(d is None for _, d, _ in kept) else np.concatenate([d for _, d, _ in kept]),
        None if any(y is None for _, _, y in kept) else np.concatenate([y for _, _, y in kept]),
        seed=seed,
    )
    tables = []
    for t, (counter, histogram) in enumerate(zip(counters, histograms, strict=True)):
        figures = table_figures(
            histogram.counts,
            histogram.weights,
            rows,
            None if missing_counts is None or source.missing_value is None else int(missing_counts[t]),
        )
        tables.append(
            {"name": names[t], **figures, "exact": counter.level == 0, "sampling_level": counter.level,
             "lookup_share_by_count": lookup_share_by_count(histogram.counts, histogram.weights),
             "target_auc": None if signal["target_auc"] is None else signal["target_auc"][t]}
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
    correlation = pearson(recurs)
    big_pairs = [correlation[a, b] for i, a in enumerate(big) for b in big[i + 1 :]]
    big_pairs = [c for c in big_pairs if np.isfinite(c)]

    total_values = sum(table["distinct"] for table in tables)
    budgets = [("budget_mb", b, int(b * (1 << 20) // (HOT_BYTES_PER_VALUE * HOT_DIM))) for b in budgets_mb]
    budgets += [("budget_fraction", f, int(round(f * total_values))) for f in hot_fractions]
    hot: list[dict[str, Any]] = []
    for kind, budget, budget_rows in budgets:
        t, cutoff, hot_lookups = hot_threshold(histograms, budget_rows)
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
    over_time = over_time_figures(scan.chunks, big)
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
        "positive_rate": scan.positives / scan.label_rows if scan.label_rows else None,
        "dense_missing_rate": None if scan.dense_missing is None else scan.dense_missing / scan.dense_rows,
        "tables": tables,
        "dense": signal["dense"],
        "links": signal["links"],
        "signal_rows": signal["rows"],
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
    return json_ready(result)


def _recount(
    source: Source, reservoir: np.ndarray, chunk_rows: int, max_rows: int | None, progress: bool
) -> np.ndarray:
    """Exact counts over the whole sample of the values in the reservoir (a second pass)."""
    keys = [np.unique(reservoir[:, t]) for t in range(reservoir.shape[1])]
    totals = [np.zeros(len(k), dtype=np.int64) for k in keys]
    chunks = source.chunks(record=False)
    with progress_bar(unit="rows", unit_scale=True, desc="recount", disable=not progress) as bar:
        for cats, _, _ in rechunk(chunks, chunk_rows, max_rows):
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
    signal_rows: int = DEFAULT_SIGNAL_ROWS,
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
        signal_rows=signal_rows,
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
    signal_rows: int = DEFAULT_SIGNAL_ROWS,
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
    source = Source(chunks, info, missing_value, n)
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
        signal_rows=signal_rows,
    )
