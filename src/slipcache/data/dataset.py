"""The binary dataset format of docs/design.md (`CriteoDataset`, `DatasetWriter`); batches are cut by
`slipcache.data.batches` (`Batch`, `BatchIterator`).

A dataset is a directory of `.npy` arrays per split plus `meta.json`; arrays are memory-mapped so a
split never has to fit in memory. `meta.json` is written last (see `DatasetWriter`), so a directory
with a `meta.json` is a complete dataset.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from slipcache.errors import SlipcacheError

FORMAT = "slipcache-dataset"
VERSION = 1
NUM_DENSE = 13
NUM_TABLES = 26
SPLIT_NAMES = ("train", "val", "test")
LABEL_PROBE_ROWS = 1 << 16  # labels checked when a split is opened (every batch's are checked as it is read)


def check_labels(labels: np.ndarray, where: Any) -> np.ndarray:
    """The labels as float32 0/1; anything else (-1/1 labels, soft labels, NaN) is named in one line
    instead of training on a meaningless loss. Every batch of every format passes here (`BatchIterator`);
    readers also call it on the rows they check when a file is opened."""
    values = np.asarray(labels).reshape(-1)
    bad = (values != 0) & (values != 1)
    if bad.any():
        found = ", ".join(sorted({f"{v:g}" for v in values[bad][:1000].tolist()})[:5])
        raise SlipcacheError(f"{where}: labels must be 0 or 1, found {found} ({int(bad.sum())} of {values.size} read)")
    return values.astype(np.float32)


@dataclass(frozen=True)
class SplitArrays:
    """One split: labels float32 [n], dense float32 [n, 13], sparse int32 [n, 26] (memory-mapped);
    `source` names where its labels come from in errors."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    source: str = "labels"

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class CriteoDataset:
    """A dataset directory, validated up front so a wrong path fails with one clear line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not self.path.is_dir():
            raise SlipcacheError(f"{self.path}: no such dataset directory")
        if not meta_path.is_file():
            raise SlipcacheError(f"{self.path}: not a slipcache dataset (no meta.json)")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise SlipcacheError(f"{meta_path}: unreadable meta.json: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise SlipcacheError(f"{meta_path}: not a slipcache dataset (format is not {FORMAT!r})")
        if meta.get("version") != VERSION:
            raise SlipcacheError(
                f"{meta_path}: dataset version {meta.get('version')!r} is not supported (expected {VERSION})"
            )
        try:
            self.table_sizes: list[int] = [int(s) for s in meta["table_sizes"]]
            self.num_dense: int = int(meta["num_dense"])
            self.splits: dict[str, int] = {str(k): int(v) for k, v in meta["splits"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SlipcacheError(f"{meta_path}: malformed meta.json ({exc!r})") from exc
        if int(meta.get("num_tables", len(self.table_sizes))) != len(self.table_sizes) or any(
            s < 1 for s in self.table_sizes
        ):
            raise SlipcacheError(f"{meta_path}: malformed meta.json (bad table_sizes)")
        self.meta: dict[str, Any] = meta
        self._cache: dict[str, SplitArrays] = {}

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    def split(self, name: str) -> SplitArrays:
        """Memory-map one split, checking shapes and dtypes against meta.json."""
        if name in self._cache:
            return self._cache[name]
        if name not in self.splits:
            raise SlipcacheError(f"{self.path}: no split {name!r} (has: {', '.join(self.splits) or 'none'})")
        n = self.splits[name]
        expected = {
            "labels": ((n,), np.float32),
            "dense": ((n, self.num_dense), np.float32),
            "sparse": ((n, self.num_tables), np.int32),
        }
        arrays: dict[str, np.ndarray] = {}
        for part, (shape, dtype) in expected.items():
            file = self.path / f"{name}.{part}.npy"
            try:
                arr = np.load(file, mmap_mode="r")
            except FileNotFoundError as exc:
                raise SlipcacheError(f"{file}: missing file of split {name!r}") from exc
            except (OSError, ValueError) as exc:
                raise SlipcacheError(f"{file}: unreadable array: {exc}") from exc
            if arr.shape != shape or arr.dtype != dtype:
                raise SlipcacheError(
                    f"{file}: expected {np.dtype(dtype).name} {shape}, found {arr.dtype.name} {arr.shape}"
                )
            arrays[part] = arr
        source = str(self.path / f"{name}.labels.npy")
        check_labels(arrays["labels"][:LABEL_PROBE_ROWS], source)  # early: before a model is built on them
        result = SplitArrays(arrays["labels"], arrays["dense"], arrays["sparse"], source)
        self._cache[name] = result
        return result


class DatasetWriter:
    """Writes a dataset into `out_dir/.tmp-<pid>` and moves it in place only when complete.

    Data files are moved first and `meta.json` last (an old one is removed before), so a crash never
    leaves a directory that looks like a complete dataset. Use as a context manager: an exception
    removes the staging directory. Extra files (e.g. `vocab.npz`) written into `staging` move too.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        split_sizes: dict[str, int],
        *,
        num_dense: int = NUM_DENSE,
        num_tables: int = NUM_TABLES,
    ) -> None:
        self.out_dir = Path(out_dir)
        self._made_out_dir = not self.out_dir.exists()  # removed again if the write fails
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SlipcacheError(f"{self.out_dir}: cannot create output directory: {exc.strerror or exc}") from exc
        remove_dead_staging(self.out_dir)
        self.staging = self.out_dir / f".tmp-{os.getpid()}"
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        self.split_sizes = dict(split_sizes)
        self.num_dense = num_dense
        self.num_tables = num_tables
        self.arrays: dict[str, SplitArrays] = {}
        for name, n in self.split_sizes.items():
            self.arrays[name] = SplitArrays(
                *(
                    self._open_array(self.staging / f"{name}.{part}.npy", dtype, shape)
                    for part, dtype, shape in (
                        ("labels", np.float32, (n,)),
                        ("dense", np.float32, (n, num_dense)),
                        ("sparse", np.int32, (n, num_tables)),
                    )
                )
            )

    def _open_array(self, path: Path, dtype: Any, shape: tuple[int, ...]) -> Any:
        """A writable array of the final shape (a memory map: rows may come in any order)."""
        return np.lib.format.open_memmap(path, "w+", dtype, shape)

    def write(
        self, split: str, start: int, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray
    ) -> None:
        arrays = self.arrays[split]
        end = start + len(labels)
        arrays.labels[start:end] = labels
        arrays.dense[start:end] = dense
        arrays.sparse[start:end] = sparse

    def commit(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Flush, write meta.json (format fields filled in) and move everything into `out_dir`."""
        for arrays in self.arrays.values():
            for arr in (arrays.labels, arrays.dense, arrays.sparse):
                arr.flush()  # type: ignore[attr-defined]
        self.arrays.clear()
        full = {
            "format": FORMAT,
            "version": VERSION,
            "num_dense": self.num_dense,
            "num_tables": self.num_tables,
            "splits": self.split_sizes,
            **meta,
        }
        (self.staging / "meta.json").write_text(json.dumps(full, indent=1) + "\n")
        with contextlib.suppress(FileNotFoundError):
            (self.out_dir / "meta.json").unlink()
        remove_replaced_dataset_files(self.out_dir, {p.name for p in self.staging.iterdir()})
        for file in sorted(self.staging.iterdir()):
            if file.name != "meta.json":
                os.replace(file, self.out_dir / file.name)
        os.replace(self.staging / "meta.json", self.out_dir / "meta.json")
        self.staging.rmdir()
        return full

    def abort(self) -> None:
        """Remove the staging directory, and `out_dir` when this writer made it and it stayed empty."""
        self.arrays.clear()
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._made_out_dir:
            with contextlib.suppress(OSError):  # not empty: someone else's files now, keep it
                self.out_dir.rmdir()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None or self.staging.exists():
            self.abort()


_DATASET_FILE = re.compile(
    r"^(?:(?:train|val|test)\.(?:labels|dense|sparse)\.npy|day_\d+_(?:dense|sparse|labels)\.npy"
    r"|vocab\.npz|meta\.json|synthetic\.json)$"
)


def check_output_dir(path: str | os.PathLike[str], *, force: bool) -> Path:
    """Where `synth --out` / `preprocess --out` may write: a new or empty directory, or (with `force`) a
    dataset of ours. Anything else holds someone's files: refused before a byte is written."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise SlipcacheError(f"--out {out} is a file, not a directory")
    entries = [p for p in out.iterdir() if not p.name.startswith(".tmp-")] if out.is_dir() else []
    if not entries:
        return out
    try:
        ours = json.loads((out / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        # A commit cut short (meta.json is removed first and written last), or a TorchRec-layout dataset:
        # ours when every file has the name of one of our dataset files.
        ours = all(_DATASET_FILE.match(p.name) and p.is_file() for p in entries)
    if not ours:
        raise SlipcacheError(
            f"--out {out} is not empty and is not a slipcache dataset; choose a new or empty directory"
        )
    if not force:
        raise SlipcacheError(f"--out {out} already holds a dataset; pass --force to overwrite it")
    return out


def remove_replaced_dataset_files(out_dir: Path, new: set[str]) -> None:
    """Remove the files of the dataset `out_dir` held that the new one (`new`: its file names) does not
    replace, so that `--force` replaces a dataset whole: a TorchRec-layout dataset written over one of ours
    (or the reverse) left the old files beside it, and training read those. Only our dataset files' names
    are removed; the description (`meta.json`, `synthetic.json`) goes first, so a kill part-way leaves
    a directory of dataset files alone, which `--force` takes again."""
    for description in ("meta.json", TORCHREC_DESCRIPTION):
        if description not in new:
            with contextlib.suppress(FileNotFoundError):
                (out_dir / description).unlink()
    for path in sorted(out_dir.iterdir()):
        if path.name not in new and _DATASET_FILE.match(path.name) and path.is_file() and not path.is_symlink():
            path.unlink()


TORCHREC_DESCRIPTION = "synthetic.json"  # what generated a TorchRec-layout directory (`streaming.TORCHREC_INFO`)


def remove_dead_staging(out_dir: Path) -> None:
    """Remove `.tmp-<pid>[-...]` directories of crashed writers (their pid is gone), keeping live ones."""
    for path in out_dir.glob(".tmp-*"):
        try:
            pid = int(path.name.split("-")[1])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
