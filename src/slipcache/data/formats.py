"""Criteo data that others preprocessed, read where it lies: TorchRec, DLRM reference and MLPerf files.

Three families, recognised by their file names in a directory:

- ``torchrec``: ``day_{i}_dense.npy`` (float32 [n, 13], already log(1 + x)), ``day_{i}_sparse.npy``
  (int [n, 26]) and ``day_{i}_labels.npy`` (int [n] or [n, 1]). Days 0..N-2 train; the last day is split
  in halves, validation then test (TorchRec's convention).
- ``dlrm``: ``kaggleAdDisplayChallenge_processed.npz`` (7 days), ``terabyte_processed.npz`` (24 days) or
  per-day ``<prefix>_{i}_processed.npz``, each with ``X_int`` (raw counts), ``X_cat``, ``y`` and maybe
  ``counts``. The last day is split test then validation (the DLRM reference's convention).
- ``mlperf``: ``<prefix>_train.bin`` and ``<prefix>_test.bin`` (and ``<prefix>_val.bin``): int32 rows of
  [label, 13 raw counts, 26 ids]. Without a ``_val.bin`` the test file is split test then validation.

Arrays are memory-mapped and converted batch by batch as they are read (`LazyColumn`), so nothing is
copied: labels to float32, raw counts through `dense_transform` (values TorchRec already transformed are
left alone; `meta["dense_transform"]` says which), ids to int32, taken modulo the table sizes when those
are given. Compressed ``.npz`` files cannot be memory-mapped: they are converted once into the binary
dataset format under the cache directory (``$SLIPCACHE_CACHE_DIR`` or ``~/.cache/slipcache``,
``converted/``) and read from there.

Table sizes: given (``table_sizes``; ids are taken modulo them, as TorchRec's ``hashes`` do), else the
``counts`` array of the data (or of a ``*_fea_count.npz`` beside it), else max id + 1 found in one pass
over the files (remembered in the cache directory, keyed by the files' size and mtime).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.cache_dir import default_cache_root
from slipcache.data.dataset import NUM_DENSE, NUM_TABLES, CriteoDataset, DatasetWriter, SplitArrays
from slipcache.data.mapped import LazyColumn, Piece, load_npy, npz_arrays, npz_compressed, npz_members
from slipcache.data.preprocess import dense_transform
from slipcache.errors import SlipcacheError

FORMATS = ("torchrec", "dlrm", "mlperf")
SPLIT_ORDERS = ("val-test", "test-val")
DEFAULT_SPLIT_ORDER = {"torchrec": "val-test", "dlrm": "test-val", "mlperf": "test-val"}
SINGLE_FILE_DAYS = {"kaggleAdDisplayChallenge_processed.npz": 7, "terabyte_processed.npz": 24}
MLPERF_COLUMNS = 1 + NUM_DENSE + NUM_TABLES
READ_ROWS = 1 << 20  # rows per block when scanning or converting
LABEL_PROBE_ROWS = 1 << 16  # labels checked when a file is opened (all are checked as they are read)
_TORCHREC = re.compile(r"^day_(\d+)_(dense|sparse|labels)\.npy$")
_DLRM_DAY = re.compile(r"^(.+)_(\d+)_processed\.npz$")
_MLPERF = re.compile(r"^(.+)_(train|test|val)\.bin$")
_COUNTS = re.compile(r"^.+_fea_count\.npz$")


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


def check_labels(labels: np.ndarray, where: Any) -> np.ndarray:
    """The labels as float32 0/1; anything else (-1/1 labels, soft labels, NaN) is named in one line,
    like the text readers do, instead of training on a negative loss."""
    values = np.asarray(labels).reshape(-1)
    bad = (values != 0) & (values != 1)
    if bad.any():
        found = ", ".join(sorted({f"{v:g}" for v in values[bad][:1000].tolist()})[:5])
        raise SlipcacheError(f"{where}: labels must be 0 or 1, found {found} ({int(bad.sum())} of {values.size} read)")
    return values.astype(np.float32)


# --------------------------------------------------------------------------------------- detection
@dataclass
class Layout:
    """What a directory holds: the format, its files in day order, and the side files."""

    format: str
    files: list[Path]  # torchrec: one dir entry per day (the dense file); dlrm: npz per day; mlperf: bins
    counts_file: Path | None = None
    days: int = 0  # dlrm single file: days it holds


def detect_format(path: str | os.PathLike[str]) -> Layout | None:
    """The external format of a directory, None if it holds none of them; mixed or incomplete: error."""
    path = Path(path)
    if not path.is_dir():
        return None
    names = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    found: dict[str, list[str]] = {}
    for name in names:
        if _TORCHREC.match(name):
            found.setdefault("torchrec", []).append(name)
        elif name in SINGLE_FILE_DAYS or (_DLRM_DAY.match(name) and not _COUNTS.match(name)):
            found.setdefault("dlrm", []).append(name)
        elif _MLPERF.match(name):
            found.setdefault("mlperf", []).append(name)
    if not found:
        return None
    if len(found) > 1:
        (a, fa), (b, fb) = list(found.items())[:2]
        raise SlipcacheError(
            f"{path}: mixed data formats: {fa[0]} ({a}) and {fb[0]} ({b}); keep one per directory"
        )
    fmt, files = next(iter(found.items()))
    counts = next((path / n for n in names if _COUNTS.match(n)), None)
    if fmt == "torchrec":
        days = sorted({int(_TORCHREC.match(n).group(1)) for n in files})  # type: ignore[union-attr]
        for i in range(max(days) + 1):
            for part in ("dense", "sparse", "labels"):
                if f"day_{i}_{part}.npy" not in files:
                    raise SlipcacheError(
                        f"{path / f'day_{i}_{part}.npy'}: missing file of the TorchRec layout"
                    )
        if len(days) < 2:
            raise SlipcacheError(f"{path}: TorchRec layout needs at least 2 days (train days, then val/test)")
        return Layout("torchrec", [path / f"day_{i}_dense.npy" for i in days], counts)
    if fmt == "dlrm":
        single = [n for n in files if n in SINGLE_FILE_DAYS]
        if single:
            if len(files) > 1:
                raise SlipcacheError(
                    f"{path}: {single[0]} beside {[n for n in files if n != single[0]][0]}; keep one"
                )
            return Layout("dlrm", [path / single[0]], counts, SINGLE_FILE_DAYS[single[0]])
        by_prefix: dict[str, dict[int, str]] = {}
        for n in files:
            m = _DLRM_DAY.match(n)
            by_prefix.setdefault(m.group(1), {})[int(m.group(2))] = n  # type: ignore[union-attr]
        if len(by_prefix) > 1:
            raise SlipcacheError(
                f"{path}: per-day files of several prefixes ({', '.join(sorted(by_prefix))})"
            )
        prefix, days_found = next(iter(by_prefix.items()))
        for i in range(max(days_found) + 1):
            if i not in days_found:
                raise SlipcacheError(
                    f"{path / f'{prefix}_{i}_processed.npz'}: missing day of the DLRM layout"
                )
        if len(days_found) < 2:
            raise SlipcacheError(f"{path}: per-day DLRM layout needs at least 2 days")
        return Layout("dlrm", [path / days_found[i] for i in sorted(days_found)], counts, len(days_found))
    by_kind: dict[str, list[str]] = {}
    for n in files:
        m = _MLPERF.match(n)
        by_kind.setdefault(m.group(2), []).append(n)  # type: ignore[union-attr]
    for kind in ("train", "test"):
        if kind not in by_kind:
            other = files[0]
            raise SlipcacheError(f"{path}: {other} has no matching *_{kind}.bin (MLPerf layout)")
    if any(len(v) > 1 for v in by_kind.values()):
        raise SlipcacheError(f"{path}: several MLPerf file sets ({', '.join(files)})")
    ordered = [path / by_kind[k][0] for k in ("train", "test", "val") if k in by_kind]
    return Layout("mlperf", ordered, counts)


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
        self._days = days
        self.transform_dense = transform_dense
        self._ranges = _split_ranges(layout, days, order)
        self.splits = {name: sum(e - s for _, s, e in parts) for name, parts in self._ranges.items()}
        sizes, source = _table_sizes(layout, days, table_sizes)
        self.table_sizes = sizes
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
            "source": {"files": [str(f) for f in layout.files]},
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
                return (a % sizes if modulo else a).astype(np.int32)

            def dense(a: np.ndarray) -> np.ndarray:
                return dense_transform(np.asarray(a)) if self.transform_dense else np.asarray(a, np.float32)

            def labels(a: np.ndarray) -> np.ndarray:
                return check_labels(a, self.path)

            self._cache[name] = SplitArrays(
                LazyColumn([Piece(d.labels, s, e) for d, s, e in parts], labels, (), np.float32),  # type: ignore[arg-type]
                LazyColumn([Piece(d.dense, s, e) for d, s, e in parts], dense, (NUM_DENSE,), np.float32),  # type: ignore[arg-type]
                LazyColumn([Piece(d.sparse, s, e) for d, s, e in parts], sparse, (NUM_TABLES,), np.int32),  # type: ignore[arg-type]
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
        # One file holding `layout.days` days of equal size (the remainder goes to the last), as the DLRM
        # reference splits it.
        n = len(days[0])
        first_held = (n // layout.days) * (layout.days - 1)
        held = days[0]
        train_parts = [(held, 0, first_held)]
        half = first_held + (n - first_held) // 2
        first, second = (held, first_held, half), (held, half, n)
        return _name_halves(train_parts, first, second, order)
    else:
        held = days[-1]
        train_parts = [(d, 0, len(d)) for d in days[:-1]]
    half = len(held) // 2
    return _name_halves(train_parts, (held, 0, half), (held, half, len(held)), order)


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
        if len(sizes) != NUM_TABLES or min(sizes) < 1:
            raise SlipcacheError(f"table sizes: give one positive size or {NUM_TABLES}, got {list(given)}")
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
        counts = np.load(file)["counts"].reshape(-1)
        if counts.size != NUM_TABLES or (counts < 1).any():
            raise SlipcacheError(
                f"{file}: counts must be {NUM_TABLES} positive sizes, got shape {counts.shape}"
            )
        return [int(c) for c in counts]
    return None


def _files_key(files: Sequence[Path], *extra: str) -> str:
    parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("\n".join([*parts, *extra]).encode()).hexdigest()[:16]


def _all_files(layout: Layout) -> list[Path]:
    if layout.format != "torchrec":
        return list(layout.files)
    return [
        f.with_name(f.name.replace("_dense", f"_{p}"))
        for f in layout.files
        for p in ("dense", "sparse", "labels")
    ]


def _max_ids(layout: Layout, days: list[_Day]) -> list[int]:
    """Max id + 1 per table in one pass over every file, remembered in the cache directory."""
    record = default_cache_root() / "formats" / f"max-ids-{_files_key(_all_files(layout))}.json"
    try:
        sizes = json.loads(record.read_text())
        if isinstance(sizes, list) and len(sizes) == NUM_TABLES:
            return [int(s) for s in sizes]
    except (OSError, ValueError):
        pass
    top = np.zeros(NUM_TABLES, dtype=np.int64)
    for day in days:
        for start in range(0, len(day), READ_ROWS):
            block = np.asarray(day.sparse[start : start + READ_ROWS])
            if block.size:
                if int(block.min()) < 0:
                    raise SlipcacheError(
                        f"{day.name}: negative id {int(block.min())}; give --table-sizes to hash ids"
                    )
                np.maximum(top, block.max(axis=0), out=top)
    sizes = [int(t) + 1 for t in top]
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(sizes))
    except OSError:
        pass  # a read-only cache only costs the pass next time
    return sizes


# ---------------------------------------------------------------------------------- compressed npz
def _convert_compressed(
    path: Path, layout: Layout, table_sizes: Sequence[int] | None, split_order: str | None
) -> Path:
    """Decompress DLRM .npz files once into the binary dataset format under the cache directory."""
    order = split_order or DEFAULT_SPLIT_ORDER["dlrm"]
    given = ",".join(str(s) for s in table_sizes) if table_sizes else ""
    key = _files_key(_all_files(layout) + ([layout.counts_file] if layout.counts_file else []), given, order)
    out = default_cache_root() / "converted" / f"{path.resolve().name}-dlrm-{key}"
    if (out / "meta.json").is_file():
        return out
    scratch = out.with_name(out.name + ".decompressed")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        decompressed = [_decompress_npz(f, scratch / f"{i}") for i, f in enumerate(layout.files)]
        plain = Layout("dlrm", decompressed, layout.counts_file, layout.days)
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
                "files": [str(f) for f in layout.files],
                "converted_from": "compressed DLRM .npz",
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
    with (
        zipfile.ZipFile(file) as src,
        zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as dst,
    ):
        for info in src.infolist():
            with src.open(info) as reader, dst.open(info.filename, "w", force_zip64=True) as writer:
                while chunk := reader.read(1 << 24):
                    writer.write(chunk)
    return target


# ------------------------------------------------------------------------------------ entry point
def open_any(
    path: str | os.PathLike[str],
    *,
    table_sizes: Sequence[int] | None = None,
    split_order: str | None = None,
) -> CriteoDataset | ExternalDataset:
    """Open a slipcache dataset directory or a directory of one of the external formats."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return CriteoDataset(path)
    layout = detect_format(path)
    if layout is None:
        return CriteoDataset(path)  # its error says what is missing
    if layout.format == "dlrm" and any(npz_compressed(f) for f in layout.files):
        return CriteoDataset(_convert_compressed(path, layout, table_sizes, split_order))
    return ExternalDataset(path, layout, table_sizes, split_order)
