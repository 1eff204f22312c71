"""Criteo data that others preprocessed, read where it lies: TorchRec, DLRM reference and MLPerf files.

Three families, recognised by their file names in a directory:

- ``torchrec``: ``day_{i}_dense.npy`` (float32 [n, 13], already log(x - m + 2), m the file's smallest raw
  value: TorchRec's ``tsv_to_npys``), ``day_{i}_sparse.npy`` (int [n, 26]) and ``day_{i}_labels.npy`` (int [n]
  or [n, 1]). Days 0..N-2 train; the last day is split in halves, validation then test (TorchRec's convention).
- ``dlrm``: ``kaggleAdDisplayChallenge_processed.npz`` (7 days), ``terabyte_processed.npz`` (24 days) or
  per-day ``<prefix>_{i}_processed.npz``, each with ``X_int`` (raw counts), ``X_cat``, ``y`` and maybe
  ``counts``. The last day is split test then validation (the DLRM reference's convention).
- ``mlperf``: ``<prefix>_train.bin`` and ``<prefix>_test.bin`` (and ``<prefix>_val.bin``): int32 rows of
  [label, 13 raw counts, 26 ids]. Without a ``_val.bin`` the test file is split test then validation.

Arrays are memory-mapped and converted batch by batch as they are read (`LazyColumn`), so nothing is
copied: labels to float32, raw counts through `dense_transform` (values TorchRec already transformed are
left alone; `meta["dense_transform"]` says which), ids to int32, taken modulo the table sizes when those
are given. Compressed ``.npz`` files cannot be memory-mapped, and Fortran-ordered ones (the DLRM
reference stores ``X_cat`` as the transpose of a float64 array) would read one page per column for every
shuffled row: both are converted once into the binary dataset format under the cache directory
(``$SLIPCACHE_CACHE_DIR`` or ``~/.cache/slipcache``, ``converted/``) and read from there.

Table sizes: given (``table_sizes``; ids are taken modulo them, as TorchRec's ``hashes`` do), else the
``counts`` array of the data (or of a ``*_fea_count.npz`` beside it), else max id + 1 found in one pass
over the files (remembered in the cache directory, keyed by the files' size and mtime).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.cache_dir import default_cache_root
from slipcache.data.dataset import NUM_DENSE, NUM_TABLES, CriteoDataset, DatasetWriter, SplitArrays, check_labels
from slipcache.data.layouts import Layout, detect_format
from slipcache.data.mapped import (
    LazyColumn,
    Piece,
    load_npy,
    npz_arrays,
    npz_compressed,
    npz_fortran_members,
    npz_members,
)
from slipcache.data.preprocess import dense_transform
from slipcache.data.sampled import sampled_digest
from slipcache.errors import SlipcacheError

logger = logging.getLogger(__name__)

FORMATS = ("torchrec", "dlrm", "mlperf")
SPLIT_ORDERS = ("val-test", "test-val")
DEFAULT_SPLIT_ORDER = {"torchrec": "val-test", "dlrm": "test-val", "mlperf": "test-val"}
MLPERF_COLUMNS = 1 + NUM_DENSE + NUM_TABLES
READ_ROWS = 1 << 20  # rows per block when scanning or converting
MAX_TABLE_ROWS = 2**31  # ids are int32 once read
LABEL_PROBE_ROWS = 1 << 16  # labels checked when a file is opened (all are checked as they are read)


# ------------------------------------------------------------------------------------- one "day"
@dataclass
class _Day:
    """One file set's raw arrays and how each becomes our labels / dense / sparse."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    name: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _check_day(day: _Day, where: Path) -> None:
    n = len(day)
    if (
        day.dense.shape != (n, NUM_DENSE)
        or day.sparse.shape != (n, NUM_TABLES)
        or day.labels.shape not in ((n,), (n, 1))
    ):
        raise SlipcacheError(
            f"{where}: expected {n} rows of 13 dense and 26 sparse values, found dense {day.dense.shape}, "
            f"sparse {day.sparse.shape}, labels {day.labels.shape}"
        )
    check_labels(day.labels[:LABEL_PROBE_ROWS], where)  # early: before a model is built on them


# ------------------------------------------------------------------------------------- the dataset
class ExternalDataset:
    """The `CriteoDataset` interface (table_sizes, splits, split(name), meta) over external files."""

    def __init__(
        self, path: Path, layout: Layout, table_sizes: Sequence[int] | None, split_order: str | None
    ) -> None:
        self.path = path
        self.layout = layout
        self.num_dense = NUM_DENSE
        order = split_order or DEFAULT_SPLIT_ORDER[layout.format]
        if order not in SPLIT_ORDERS:
            raise SlipcacheError(f"split order must be one of {', '.join(SPLIT_ORDERS)}, got {order!r}")
        days, transform_dense = _open_days(layout)
        self.transform_dense = transform_dense
        self._ranges = _split_ranges(layout, days, order)
        self.splits = {name: sum(e - s for _, s, e in parts) for name, parts in self._ranges.items()}
        sizes, source = _table_sizes(layout, days, table_sizes)
        self.table_sizes = sizes
        # Sizes measured from the files once and remembered in the cache: an id beyond them names that record.
        self._measured = _max_ids_record(layout) if source == "max id + 1" else None
        self.modulo = source == "given"
        self.meta: dict[str, Any] = {
            "format": f"external-{layout.format}",
            "num_dense": NUM_DENSE,
            "num_tables": NUM_TABLES,
            "table_sizes": sizes,
            "table_sizes_from": source,
            "splits": self.splits,
            "split_order": order,
            "dense_transform": "log(1 + max(x, 0)), applied on read"
            if transform_dense
            else "none: the files hold log-transformed values already (not applied twice)",
            "source": {"files": [str(f) for f in layout.files], "ignored": [str(f) for f in layout.ignored]},
        }
        self._cache: dict[str, SplitArrays] = {}

    @property
    def num_tables(self) -> int:
        return NUM_TABLES

    def split(self, name: str) -> SplitArrays:
        if name not in self.splits:
            raise SlipcacheError(f"{self.path}: no split {name!r} (has: {', '.join(self.splits)})")
        if name not in self._cache:
            parts = self._ranges[name]
            sizes = np.asarray(self.table_sizes, dtype=np.int64)
            modulo = self.modulo

            def sparse(a: np.ndarray) -> np.ndarray:
                a = np.asarray(a)
                if self._measured is not None and a.size and (a.reshape(-1, NUM_TABLES) >= sizes).any():
                    t = int(np.flatnonzero((a.reshape(-1, NUM_TABLES) >= sizes).any(axis=0))[0])
                    raise SlipcacheError(
                        f"{self.path}: an id of table {t} is beyond the {sizes[t]} rows measured when these files "
                        f"were first read (remembered in {self._measured}); a file changed since: delete that "
                        "record to measure again, or give --table-sizes"
                    )
                if modulo:  # unsigned ids modulo unsigned sizes: int64 sizes would turn them into floats
                    a = a % (sizes.astype(np.uint64) if a.dtype.kind == "u" else sizes)
                return a.astype(np.int32)

            def dense(a: np.ndarray) -> np.ndarray:
                return dense_transform(np.asarray(a)) if self.transform_dense else np.asarray(a, np.float32)

            def labels(a: np.ndarray) -> np.ndarray:
                return check_labels(a, self.path)

            self._cache[name] = SplitArrays(
                LazyColumn([Piece(d.labels, s, e) for d, s, e in parts], labels, (), np.float32),  # type: ignore[arg-type]
                LazyColumn([Piece(d.dense, s, e) for d, s, e in parts], dense, (NUM_DENSE,), np.float32),  # type: ignore[arg-type]
                LazyColumn([Piece(d.sparse, s, e) for d, s, e in parts], sparse, (NUM_TABLES,), np.int32),  # type: ignore[arg-type]
                str(self.path),
            )
        return self._cache[name]


def _open_days(layout: Layout) -> tuple[list[_Day], bool]:
    """The raw arrays of each file set and whether the dense values still need the log transform."""
    days: list[_Day] = []
    if layout.format == "torchrec":
        for dense_file in layout.files:
            stem = dense_file.name.removesuffix("_dense.npy")
            day = _Day(
                load_npy(dense_file.with_name(f"{stem}_labels.npy")),
                load_npy(dense_file),
                load_npy(dense_file.with_name(f"{stem}_sparse.npy")),
                stem,
            )
            _check_day(day, dense_file.parent / stem)
            days.append(day)
        return days, False
    if layout.format == "dlrm":
        for file in layout.files:
            arrays = npz_arrays(file, ("X_int", "X_cat", "y"))
            day = _Day(arrays["y"], arrays["X_int"], arrays["X_cat"], file.name)
            _check_day(day, file)
            days.append(day)
        return days, True
    for file in layout.files:
        size = file.stat().st_size
        if size % (MLPERF_COLUMNS * 4):
            raise SlipcacheError(f"{file}: size {size} is not a whole number of 160-byte MLPerf rows")
        rows = np.memmap(file, dtype=np.int32, mode="r", shape=(size // (MLPERF_COLUMNS * 4), MLPERF_COLUMNS))
        days.append(_Day(rows[:, 0], rows[:, 1 : 1 + NUM_DENSE], rows[:, 1 + NUM_DENSE :], file.name))
        check_labels(days[-1].labels[:LABEL_PROBE_ROWS], file)
    return days, True


def _split_ranges(layout: Layout, days: list[_Day], order: str) -> dict[str, list[tuple[_Day, int, int]]]:
    """(day, start, end) pieces of each split: last day (or test file) halved in `order`."""
    if layout.format == "mlperf":
        train, test = days[0], days[1]
        if len(days) == 3:
            return {
                "train": [(train, 0, len(train))],
                "val": [(days[2], 0, len(days[2]))],
                "test": [(test, 0, len(test))],
            }
        held, train_parts = test, [(train, 0, len(train))]
    elif layout.format == "dlrm" and len(days) == 1:
        # One file holding `layout.days` days, cut where the reference's loader cuts it: at its
        # `*_day_count.npz` when present, else in equal days with the remainder on the first days.
        held = days[0]
        per_day = _rows_per_day(layout, len(held))
        first_held = sum(per_day[:-1])
        train_parts = [(held, 0, first_held)]
        half = first_held + (len(held) - first_held + 1) // 2
        return _name_halves(train_parts, (held, first_held, half), (held, half, len(held)), order)
    else:
        held = days[-1]
        train_parts = [(d, 0, len(d)) for d in days[:-1]]
    half = (len(held) + 1) // 2  # the first half takes the odd row, as TorchRec's and the DLRM reference's do
    return _name_halves(train_parts, (held, 0, half), (held, half, len(held)), order)


def _rows_per_day(layout: Layout, rows: int) -> list[int]:
    """Rows of each day of a combined DLRM file: its day counts file, else rows / days, extras first."""
    if layout.day_counts_file is not None:
        if "total_per_file" not in npz_members(layout.day_counts_file):
            raise SlipcacheError(f"{layout.day_counts_file}: no total_per_file array (rows per day)")
        per_day = [int(n) for n in np.load(layout.day_counts_file)["total_per_file"].reshape(-1)]
        if sum(per_day) != rows or len(per_day) < 2 or min(per_day) < 0:
            raise SlipcacheError(
                f"{layout.day_counts_file}: rows per day {per_day[:4]}... add up to {sum(per_day)}, "
                f"the data holds {rows}"
            )
        return per_day
    base, extra = divmod(rows, layout.days)
    return [base + (1 if d < extra else 0) for d in range(layout.days)]


def _name_halves(
    train: list[tuple[_Day, int, int]],
    first: tuple[_Day, int, int],
    second: tuple[_Day, int, int],
    order: str,
) -> dict[str, list[tuple[_Day, int, int]]]:
    a, b = order.split("-")
    return {"train": train, a: [first], b: [second]}


def _table_sizes(layout: Layout, days: list[_Day], given: Sequence[int] | None) -> tuple[list[int], str]:
    if given:
        sizes = [int(s) for s in given]
        if len(sizes) == 1:
            sizes = sizes * NUM_TABLES
        if len(sizes) != NUM_TABLES or min(sizes) < 1 or max(sizes) > MAX_TABLE_ROWS:
            raise SlipcacheError(
                f"table sizes: give one size in [1, 2**31] or {NUM_TABLES}, got {list(given)}"
            )
        return sizes, "given"
    counts = _read_counts(layout)
    if counts is not None:
        return counts, "counts"
    return _max_ids(layout, days), "max id + 1"


def _read_counts(layout: Layout) -> list[int] | None:
    candidates = [layout.counts_file] if layout.counts_file else []
    if layout.format == "dlrm" and len(layout.files) == 1:
        candidates.insert(0, layout.files[0])
    for file in candidates:
        assert file is not None
        if "counts" not in npz_members(file):
            continue
        try:
            counts = np.load(file)["counts"].reshape(-1)
        except (zlib.error, zipfile.BadZipFile, EOFError, ValueError) as exc:
            raise SlipcacheError(f"{file}: damaged .npz ({str(exc).splitlines()[0]})") from exc
        if counts.size != NUM_TABLES or (counts < 1).any():
            raise SlipcacheError(
                f"{file}: counts must be {NUM_TABLES} positive sizes, got shape {counts.shape}"
            )
        return [int(c) for c in counts]
    return None


def _files_key(files: Sequence[Path], *extra: str) -> str:
    """What the cache's records of these files are keyed by: each file's path, size, time and sampled
    content (a file rewritten in place with its time kept gets another key, as far as sampling sees)."""
    parts = [
        f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}:{sampled_digest(p, p.stat().st_size)}" for p in files
    ]
    return hashlib.sha256("\n".join([*parts, *extra]).encode()).hexdigest()[:16]


def _all_files(layout: Layout) -> list[Path]:
    if layout.format != "torchrec":
        return list(layout.files)
    return [
        f.with_name(f.name.replace("_dense", f"_{p}"))
        for f in layout.files
        for p in ("dense", "sparse", "labels")
    ]


def _check_ids(block: np.ndarray, where: str) -> None:
    """Ids that can size a table: integers (integral floats pass), not negative, below 2**31."""
    if block.dtype.kind == "f" and not np.array_equal(block, np.floor(block)):
        bad = block[block != np.floor(block)][0]
        raise SlipcacheError(f"{where}: ids must be integers, found {float(bad):g}")
    if block.dtype.kind not in "iuf":
        raise SlipcacheError(f"{where}: ids must be integers, found {block.dtype} values")
    low, high = block.min(), block.max()
    if low < 0:
        raise SlipcacheError(f"{where}: negative id {low}; give --table-sizes to hash ids")
    if high > MAX_TABLE_ROWS - 1:
        raise SlipcacheError(
            f"{where}: id {int(high)} is beyond {MAX_TABLE_ROWS - 1}, the largest a table holds; "
            "give --table-sizes to take ids modulo a table size"
        )


def _max_ids_record(layout: Layout) -> Path:
    return default_cache_root() / "formats" / f"max-ids-{_files_key(_all_files(layout))}.json"


def _max_ids(layout: Layout, days: list[_Day]) -> list[int]:
    """Max id + 1 per table in one pass over every file, remembered in the cache directory."""
    record = _max_ids_record(layout)
    try:
        sizes = json.loads(record.read_text())
        if isinstance(sizes, list) and len(sizes) == NUM_TABLES:
            return [int(s) for s in sizes]
    except (OSError, ValueError):
        pass
    top = [0] * NUM_TABLES
    for day in days:
        for start in range(0, len(day), READ_ROWS):
            block = np.asarray(day.sparse[start : start + READ_ROWS])
            if block.size:
                _check_ids(block, day.name)
                top = [max(t, int(m)) for t, m in zip(top, block.max(axis=0).tolist(), strict=True)]
    sizes = [t + 1 for t in top]
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(sizes))
    except OSError:
        pass  # a read-only cache only costs the pass next time
    return sizes


# ---------------------------------------------------------------------------------- compressed npz
def _needs_conversion(layout: Layout) -> str | None:
    """Why DLRM files cannot be read in place, or None: compressed members cannot be mapped, and a
    Fortran-ordered ``X_cat`` (the reference's) would cost a page per column for every shuffled row."""
    if layout.format != "dlrm":
        return None
    if any(npz_compressed(f) for f in layout.files):
        return "compressed DLRM .npz"
    if any(npz_fortran_members(f) for f in layout.files):
        return "DLRM .npz with Fortran-ordered arrays"
    return None


def _convert_to_cache(
    path: Path, layout: Layout, table_sizes: Sequence[int] | None, split_order: str | None, reason: str
) -> Path:
    """Convert DLRM .npz files once into the binary dataset format under the cache directory."""
    order = split_order or DEFAULT_SPLIT_ORDER["dlrm"]
    given = ",".join(str(s) for s in table_sizes) if table_sizes else ""
    sides = [f for f in (layout.counts_file, layout.day_counts_file) if f is not None]
    key = _files_key(_all_files(layout) + sides, given, order)
    out = default_cache_root() / "converted" / f"{path.resolve().name}-dlrm-{key}"
    if (out / "meta.json").is_file():
        return out
    scratch = out.with_name(out.name + ".decompressed")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        readable = [
            _decompress_npz(f, scratch / f"{i}") if npz_compressed(f) else f for i, f in enumerate(layout.files)
        ]
        plain = dataclasses.replace(layout, files=readable)
        source = ExternalDataset(path, plain, table_sizes, order)
        with DatasetWriter(out, source.splits) as writer:
            for name in source.splits:
                split = source.split(name)
                for start in range(0, len(split), READ_ROWS):
                    end = start + READ_ROWS
                    writer.write(
                        name, start, split.labels[start:end], split.dense[start:end], split.sparse[start:end]
                    )
            meta = {
                k: v
                for k, v in source.meta.items()
                if k not in ("format", "num_dense", "num_tables", "splits")
            }
            meta["dense_transform"] = "log(1 + max(x, 0)), applied when converting"
            meta["source"] = {
                **source.meta["source"], "files": [str(f) for f in layout.files], "converted_from": reason
            }
            writer.commit(meta)
    finally:
        for file in scratch.glob("*/*"):
            file.unlink()
        for folder in sorted(scratch.glob("*"), reverse=True):
            folder.rmdir()
        scratch.rmdir()
    return out


def _decompress_npz(file: Path, folder: Path) -> Path:
    """Re-write a compressed .npz uncompressed (streamed member by member) so it can be memory-mapped."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / file.name
    try:
        with (
            zipfile.ZipFile(file) as src,
            zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as dst,
        ):
            for info in src.infolist():
                with src.open(info) as reader, dst.open(info.filename, "w", force_zip64=True) as writer:
                    while chunk := reader.read(1 << 24):
                        writer.write(chunk)
    except (zlib.error, zipfile.BadZipFile, EOFError) as exc:  # damaged deflate stream, CRC, truncation
        raise SlipcacheError(f"{file}: damaged compressed .npz ({str(exc).splitlines()[0]})") from exc
    return target


# ------------------------------------------------------------------------------------ entry point
Dataset = CriteoDataset | ExternalDataset  # what `open_any` opens: one interface over every layout


def open_any(
    path: str | os.PathLike[str],
    *,
    table_sizes: Sequence[int] | None = None,
    split_order: str | None = None,
) -> Dataset:
    """Open a slipcache dataset directory or a directory of one of the external formats."""
    path = Path(path)
    layout = detect_format(path)  # a directory holding two formats' files is refused here, whichever
    if (path / "meta.json").is_file():
        dataset = CriteoDataset(path)
        if table_sizes and list(table_sizes) != list(dataset.table_sizes):
            raise SlipcacheError(
                f"{path}: the dataset's tables have {dataset.table_sizes[:4]}... rows, not the given "
                f"{list(table_sizes)[:4]}... (a slipcache dataset keeps its own sizes: drop --table-sizes)"
            )
        return dataset
    if layout is None:
        return CriteoDataset(path)  # its error says what is missing
    if layout.ignored:
        logger.warning(
            f"{path}: reading {layout.files[0].name}, the DLRM reference's combined file (what its loader reads); "
            f"the {len(layout.ignored)} per-day files beside it are not read"
        )
    reason = _needs_conversion(layout)
    if reason is not None:
        return CriteoDataset(_convert_to_cache(path, layout, table_sizes, split_order, reason))
    return ExternalDataset(path, layout, table_sizes, split_order)
