"""Raw Criteo files -> the binary dataset format (`slipcache preprocess` is its command, `preprocess_cli.py`).

Choices (documented here because the dataset depends on them):
- The text is parsed once. Rows go to temporary binary files in the output directory; splitting, the
  frequency vocabulary and the final arrays are then computed from those, so `--vocab frequency`'s
  two passes are over binary data, not text.
- Splits are contiguous ranges in input order (Criteo is time-ordered): train first, then val, then
  test. `split="days"`: each input file is a day; the last file is split into val (first half) and
  test (second half), the others are train.
- Frequency vocabulary: counted on the train split only (no leakage from val/test). Per table, values
  seen at least `min_count` times get rows 1.. by descending count (ties: smaller value first); row 0
  is "unknown": rarer values, values never seen in train, and missing values.
- Hash vocabulary: row = 1 + hash(raw value, seed) mod (max_rows - 1); row 0 is the missing value.
  Every table has `max_rows` rows, like DLRM's max-ind-range.
- Dense: log(1 + max(x, 0)), missing -> 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.data.criteo import MISSING, NUM_CATEGORICAL, NUM_DENSE, ReadStats, check_raw_input, read_chunks
from slipcache.data.dataset import DatasetWriter, remove_dead_staging
from slipcache.errors import SlipcacheError
from slipcache.progress import progress_bar

logger = logging.getLogger(__name__)

DEFAULT_SPLIT = "0.8,0.1,0.1"
DEFAULT_MIN_COUNT = 1
DEFAULT_MAX_ROWS = 1_000_000
COPY_ROWS = 262_144  # rows per step when copying from the temporary files
MERGE_MIN = 1 << 20  # value-count pairs collected before merging them into the running counts


def parse_split(split: str | Sequence[float]) -> str | tuple[float, float, float]:
    """'days' or three fractions (train, val, test) summing to 1."""
    if isinstance(split, str):
        if split.strip() == "days":
            return "days"
        try:
            parts = [float(x) for x in split.split(",")]
        except ValueError:
            parts = []
    else:
        parts = [float(x) for x in split]
    if len(parts) != 3 or any(not 0 <= p <= 1 for p in parts) or abs(sum(parts) - 1) > 1e-6:
        raise SlipcacheError(
            f"--split must be 'days' or three fractions summing to 1 (like 0.8,0.1,0.1), got {split!r}"
        )
    return parts[0], parts[1], parts[2]


def dense_transform(dense: np.ndarray) -> np.ndarray:
    """log(1 + max(x, 0)) with missing (NaN) -> 0, as float32."""
    return np.log1p(np.maximum(np.nan_to_num(dense, nan=0.0), 0.0)).astype(np.float32)


def hash_ids(raw: np.ndarray, max_rows: int, seed: int = 0) -> np.ndarray:
    """Rows 1..max_rows-1 from a 64-bit mix of the raw values; missing (MISSING) -> row 0."""
    with np.errstate(over="ignore"):
        x = raw.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % (1 << 64))
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    ids = (x % np.uint64(max_rows - 1)).astype(np.int64) + 1
    return np.where(raw == MISSING, 0, ids).astype(np.int32)


class _ValueCounter:
    """Counts of raw values of one table, merged in batches so each chunk costs little."""

    def __init__(self) -> None:
        self.values = np.empty(0, dtype=np.int64)
        self.counts = np.empty(0, dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, column: np.ndarray) -> None:
        values, counts = np.unique(column[column != MISSING], return_counts=True)
        self._pending.append((values, counts))
        self._pending_size += len(values)
        if self._pending_size > max(MERGE_MIN, len(self.values)):
            self.merge()

    def merge(self) -> None:
        if not self._pending:
            return
        values = np.concatenate([self.values] + [v for v, _ in self._pending])
        counts = np.concatenate([self.counts] + [c for _, c in self._pending])
        self.values, inverse = np.unique(values, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.values)).astype(np.int64)
        self._pending, self._pending_size = [], 0


def _frequency_vocab(counter: _ValueCounter, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw values ascending, their rows) for values with count >= min_count; rows 1.. by frequency."""
    counter.merge()
    keep = counter.counts >= min_count
    values, counts = counter.values[keep], counter.counts[keep]
    order = np.lexsort((values, -counts))
    rows = np.empty(len(values), dtype=np.int32)
    rows[order] = np.arange(1, len(values) + 1, dtype=np.int32)
    return values, rows


OVERSIZE_FACTOR = 10  # hashed tables this many times larger than the distinct values are warned about
EXACT_DISTINCT_ROWS = 1_000_000  # up to this many rows the distinct values are counted, above it bounded


def oversized_tables(max_rows: int, ids: np.ndarray) -> str | None:
    """A one-line warning when `--max-rows` gives every hashed table far more rows than the data has
    distinct values (a 2,000-line sample with DLRM's 10 M rows builds 260 M rows of tables), else None.
    A table can hold no more distinct values than there are rows: above EXACT_DISTINCT_ROWS rows that bound
    is all that is checked, below it the distinct ids are counted."""
    n = ids.shape[0]
    if max_rows <= OVERSIZE_FACTOR * n:
        return None
    if n <= EXACT_DISTINCT_ROWS:
        distinct = max(len(np.unique(np.asarray(ids[:, t]))) for t in range(ids.shape[1]))
        seen = f"at most {distinct:,} distinct values in a table ({n:,} rows)"
    else:
        distinct, seen = n, f"at most {n:,} distinct values in a table (one per row)"
    if max_rows <= OVERSIZE_FACTOR * distinct:
        return None
    fits = 1 << max(4, (4 * distinct - 1).bit_length())  # 4x the values: few hash collisions
    total = max_rows * ids.shape[1]
    return (
        f"--max-rows {max_rows:,} gives every table {max_rows:,} rows ({total:,} in all, "
        f"{total * 64 / 2**30:.1f} GiB as fp32 rows of dim 16) but the data has {seen}: "
        f"--max-rows {fits:,} fits it, or --vocab frequency sizes each table to its values"
    )


def lookup_rows(values: np.ndarray, rows: np.ndarray, column: np.ndarray) -> np.ndarray:
    """The rows of raw values in a frequency vocabulary (`values` ascending); a value without one: row 0."""
    if len(values) == 0:
        return np.zeros(len(column), dtype=np.int32)
    pos = np.minimum(np.searchsorted(values, column), len(values) - 1)
    return np.where(values[pos] == column, rows[pos], 0).astype(np.int32)


def preprocess(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    vocab: str = "frequency",
    min_count: int = DEFAULT_MIN_COUNT,
    max_rows: int = DEFAULT_MAX_ROWS,
    split: str | Sequence[float] = DEFAULT_SPLIT,
    strict: bool = False,
    progress: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Convert raw Criteo files to a dataset in `out_dir` (see the module docstring); returns meta.json.

    `seed` salts the hash of `vocab="hash"` (splits are contiguous, so nothing else is random).
    Output appears atomically: nothing looks like a dataset until it is complete.
    """
    if not inputs:
        raise SlipcacheError("no input files")
    if vocab not in ("frequency", "hash"):
        raise SlipcacheError(f"--vocab must be 'frequency' or 'hash', got {vocab!r}")
    if min_count < 1:
        raise SlipcacheError(f"--min-count must be at least 1, got {min_count}")
    if not 2 <= max_rows <= 2**31:  # rows are int32 ids
        raise SlipcacheError(f"--max-rows must be in [2, 2**31], got {max_rows}")
    spec = parse_split(split)
    if spec == "days" and len(inputs) < 2:
        raise SlipcacheError(
            "--split days needs at least two input files (one day each; the last is val+test)"
        )
    missing = [str(path) for path in inputs if not Path(path).exists()]
    if missing:  # before the output directory is created, so a typo leaves nothing behind
        raise SlipcacheError(f"{missing[0]}: no such file")
    for path in inputs:
        check_raw_input(path)
    out = Path(out_dir)
    made = not out.exists()  # a failed run removes the directory it made (the cache keeps no empty ones)
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(out)  # scratch space of a preprocess that was killed (its pid is gone)
        scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-raw-", dir=out))
    except OSError as exc:
        raise SlipcacheError(f"{out}: cannot create output directory: {exc}") from exc
    try:
        return _preprocess(inputs, out, scratch, vocab, min_count, max_rows, spec, strict, progress, seed)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):  # only if nothing else is in it
                out.rmdir()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _preprocess(
    inputs: Sequence[str | os.PathLike[str]],
    out: Path,
    scratch: Path,
    vocab: str,
    min_count: int,
    max_rows: int,
    spec: str | tuple[float, float, float],
    strict: bool,
    progress: bool,
    seed: int,
) -> dict[str, Any]:
    # Pass 1: parse the text once into temporary binary files (raw values, or ids when hashing).
    stats = ReadStats()
    rows_per_file: list[int] = []
    cat_dtype = np.int64 if vocab == "frequency" else np.int32
    files = {part: open(scratch / part, "wb") for part in ("labels", "dense", "cats")}  # noqa: SIM115
    try:
        with progress_bar(unit="rows", unit_scale=True, desc="parse", disable=not progress) as bar:
            for path in inputs:
                rows = 0
                for chunk in read_chunks(path, strict=strict, stats=stats):
                    cats = (
                        chunk.categorical
                        if vocab == "frequency"
                        else hash_ids(chunk.categorical, max_rows, seed)
                    )
                    files["labels"].write(chunk.labels.tobytes())
                    files["dense"].write(dense_transform(chunk.dense).tobytes())
                    files["cats"].write(cats.astype(cat_dtype).tobytes())
                    rows += len(chunk)
                    bar.update(len(chunk))
                rows_per_file.append(rows)
    finally:
        for fh in files.values():
            fh.close()
    n = sum(rows_per_file)
    if n == 0:
        first = f"; first: {stats.examples[0]}" if stats.examples else ""
        raise SlipcacheError(f"no valid rows in the input ({stats.bad} malformed lines{first})")

    if spec == "days":
        n_train = n - rows_per_file[-1]
        n_val = rows_per_file[-1] // 2
    else:
        n_train = int(n * spec[0])
        n_val = int(n * spec[1])
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, n)}
    if n_train < 1:  # a dataset nothing can train on: said here, not when a run starts on it
        raise SlipcacheError(
            f"{n} valid input row{'s' * (n != 1)} leave the train split empty; give more input "
            "(or a larger train fraction in --split)"
        )

    labels = np.memmap(scratch / "labels", dtype=np.float32, mode="r", shape=(n,))
    dense = np.memmap(scratch / "dense", dtype=np.float32, mode="r", shape=(n, NUM_DENSE))
    cats = np.memmap(scratch / "cats", dtype=cat_dtype, mode="r", shape=(n, NUM_CATEGORICAL))

    # Pass 2 (frequency only): count raw values over the train rows.
    vocabulary: list[tuple[np.ndarray, np.ndarray]] = []
    if vocab == "frequency":
        counters = [_ValueCounter() for _ in range(NUM_CATEGORICAL)]
        for start in range(0, n_train, COPY_ROWS):
            block = np.asarray(cats[start : min(start + COPY_ROWS, n_train)])
            for t, counter in enumerate(counters):
                counter.add(block[:, t])
        vocabulary = [_frequency_vocab(c, min_count) for c in counters]
        table_sizes = [len(values) + 1 for values, _ in vocabulary]
    else:
        table_sizes = [max_rows] * NUM_CATEGORICAL
        warning = oversized_tables(max_rows, cats)
        if warning:
            logger.warning(f"slipcache preprocess: warning: {warning}")

    # Final pass: write the splits.
    positives = {}
    with (
        DatasetWriter(out, {k: b - a for k, (a, b) in bounds.items()}) as writer,
        progress_bar(total=n, unit="rows", unit_scale=True, desc="write", disable=not progress) as bar,
    ):
        for name, (a, b) in bounds.items():
            positives[name] = 0.0
            for start in range(a, b, COPY_ROWS):
                end = min(start + COPY_ROWS, b)
                block = np.asarray(cats[start:end])
                if vocabulary:
                    ids = np.stack(
                        [lookup_rows(v, r, block[:, t]) for t, (v, r) in enumerate(vocabulary)], axis=1
                    )
                else:
                    ids = block
                writer.write(name, start - a, labels[start:end], dense[start:end], ids)
                positives[name] += float(labels[start:end].sum())
                bar.update(end - start)
        if vocabulary:
            arrays: dict[str, Any] = {}  # numpy's savez types its keywords as allow_pickle's bool
            for t, (kept_values, value_rows) in enumerate(vocabulary):
                arrays[f"t{t}"] = kept_values.astype(np.uint32)
                arrays[f"ids{t}"] = value_rows
            np.savez(writer.staging / "vocab.npz", **arrays)
        del labels, dense, cats
        meta = writer.commit(
            {
                "table_sizes": table_sizes,
                "positive_rate": sum(positives.values()) / n,
                "split_positive_rate": {
                    k: (positives[k] / (b - a) if b > a else None) for k, (a, b) in bounds.items()
                },
                "vocabulary": vocab,
                "min_count": min_count if vocab == "frequency" else None,
                "max_rows": max_rows if vocab == "hash" else None,
                "hash_seed": seed if vocab == "hash" else None,
                "unknown_row": 0,
                "dense_transform": "log(1 + max(x, 0)); missing -> 0",
                "split": "days" if spec == "days" else list(spec),
                "source": {
                    "inputs": [str(p) for p in inputs],
                    "formats": stats.formats,
                    "rows_per_file": rows_per_file,
                    "good_lines": stats.good,
                    "bad_lines": stats.bad,
                    "bad_examples": stats.examples,
                },
            }
        )
    return meta
