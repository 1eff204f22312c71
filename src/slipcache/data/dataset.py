"""The binary dataset format of docs/design.md, `Batch`, and `BatchIterator` with lookahead.

A dataset is a directory of `.npy` arrays per split plus `meta.json`; arrays are memory-mapped so a
split never has to fit in memory. `meta.json` is written last (see `DatasetWriter`), so a directory
with a `meta.json` is a complete dataset.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from slipcache.errors import SlipcacheError

FORMAT = "slipcache-dataset"
VERSION = 1
NUM_DENSE = 13
NUM_TABLES = 26
SPLIT_NAMES = ("train", "val", "test")
PARTS = ("labels", "dense", "sparse")

SampleFilter = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class SplitArrays:
    """One split: labels float32 [n], dense float32 [n, 13], sparse int32 [n, 26] (memory-mapped)."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

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
        result = SplitArrays(arrays["labels"], arrays["dense"], arrays["sparse"])
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
        ours = False
    if not ours:
        raise SlipcacheError(f"--out {out} is not empty and is not a slipcache dataset; choose a new or empty directory")
    if not force:
        raise SlipcacheError(f"--out {out} already holds a dataset; pass --force to overwrite it")
    return out


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


@dataclass
class Batch:
    """dense float32 [B, 13], sparse int64 [B, 26], labels float32 [B]."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )


class BatchIterator:
    """One epoch of batches over a split, read `chunk_batches` batches at a time so memory stays bounded.

    Order: with `shuffle`, chunks (contiguous sample ranges) are visited in a permuted order and samples
    are permuted within each chunk, both derived from (seed, epoch), so an epoch is reproducible. With
    `in_order` too, chunks keep their order and only samples within a chunk are permuted: time-ordered
    data (synthetic v3, Criteo days) is then trained earlier days first, shuffled within windows.
    `sample_filter(sparse int32 [n, 26]) -> bool [n]` drops samples before batches are cut, so every
    batch but the last is full; it is called on batch-sized pieces only when a batch is assembled (on
    `next`, `peek` or `lookahead`), so a stateful filter sees the state of the batches consumed so far.
    `start_batch` resumes mid-epoch: the batches that follow are exactly those an uninterrupted iterator
    would yield (without a filter it jumps there directly; with one it re-runs the filter over the skipped
    batches, so the filter must decide the same way again). `peek(k)` returns the next k batches without
    consuming them; `lookahead` keeps that many assembled ahead after each step.

    Counters: `samples_seen` counts samples in yielded batches, `samples_dropped` those the filter
    removed before them (the filter's drops after the last batch are added when the epoch ends);
    `batch_index` is the index of the next batch, usable as a later `start_batch`.
    """

    def __init__(
        self,
        split: SplitArrays,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        lookahead: int = 0,
        sample_filter: SampleFilter | None = None,
        start_batch: int = 0,
        chunk_batches: int = 64,
        in_order: bool = False,
    ) -> None:
        if batch_size < 1:
            raise SlipcacheError(f"batch size must be at least 1, got {batch_size}")
        if lookahead < 0 or start_batch < 0 or chunk_batches < 1:
            raise SlipcacheError("lookahead and start_batch must be >= 0 and chunk_batches >= 1")
        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.drop_last = drop_last
        self.lookahead = lookahead
        self.sample_filter = sample_filter
        self.chunk_size = batch_size * chunk_batches
        n = len(split)
        starts = np.arange(0, n, self.chunk_size, dtype=np.int64)
        self._chunks = [(int(s), int(min(s + self.chunk_size, n))) for s in starts]
        if shuffle and not in_order:
            order = np.random.default_rng([seed, epoch]).permutation(len(self._chunks))
            self._order = [int(i) for i in order]
        else:
            self._order = list(range(len(self._chunks)))
        self.samples_seen = 0
        self.samples_dropped = 0
        self.batch_index = 0
        self._tail_dropped = 0
        self._exhausted = False
        self._buffer: deque[tuple[Batch, int]] = deque()
        self._gen = self._generate(start_batch)
        self._fill(lookahead)

    def __len__(self) -> int:
        """Batches in the whole epoch (not the remaining ones); unknown with a sample filter."""
        if self.sample_filter is not None:
            raise TypeError("the number of batches is unknown when a sample_filter is set")
        n = len(self.split)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if not self._buffer:
            self._fill(1)
        if not self._buffer:
            if not self._exhausted:
                self._exhausted = True
                self.samples_dropped += self._tail_dropped
            raise StopIteration
        batch, dropped = self._buffer.popleft()
        self.samples_seen += len(batch)
        self.samples_dropped += dropped
        self.batch_index += 1
        self._fill(self.lookahead)
        return batch

    def peek(self, k: int) -> list[Batch]:
        """The next k batches (fewer at the end of the epoch), without consuming them."""
        self._fill(k)
        return [batch for batch, _ in list(self._buffer)[:k]]

    def _fill(self, k: int) -> None:
        while len(self._buffer) < k:
            item = next(self._gen, None)
            if item is None:
                return
            self._buffer.append(item)

    def _read_chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(labels, dense, sparse, positions in the split) of one chunk, in the epoch's order."""
        start, end = self._chunks[chunk]
        labels = np.array(self.split.labels[start:end])
        dense = np.array(self.split.dense[start:end])
        sparse = np.array(self.split.sparse[start:end])
        positions = np.arange(start, end, dtype=np.int64)
        if self.shuffle:
            perm = np.random.default_rng([self.seed, self.epoch, chunk]).permutation(end - start)
            labels, dense, sparse, positions = labels[perm], dense[perm], sparse[perm], positions[perm]
        return labels, dense, sparse, positions

    def _generate(self, start_batch: int) -> Iterator[tuple[Batch, int]]:
        """Yield (batch, samples dropped by the filter since the previous batch)."""
        first_chunk, offset = 0, 0
        skip = start_batch
        if self.sample_filter is None and start_batch > 0:
            # Without a filter batch i is samples [i*B, (i+1)*B) of the epoch's order: jump straight there.
            sizes = np.array([self._chunks[c][1] - self._chunks[c][0] for c in self._order], dtype=np.int64)
            position = min(start_batch * self.batch_size, int(sizes.sum()))
            ends = np.cumsum(sizes)
            first_chunk = int(np.searchsorted(ends, position, side="right"))
            offset = position - int(ends[first_chunk - 1] if first_chunk > 0 else 0)
            self.samples_seen = position
            self.batch_index = start_batch
            skip = 0
        B = self.batch_size
        carry: tuple[np.ndarray, ...] | None = None
        dropped = 0
        for chunk in self._order[first_chunk:]:
            labels, dense, sparse, positions = self._read_chunk(chunk)
            if offset:
                labels, dense, sparse, positions = labels[offset:], dense[offset:], sparse[offset:], positions[offset:]
                offset = 0
            pieces = [(labels, dense, sparse, positions)]
            if self.sample_filter is not None:
                # Filter a batch-sized piece at a time, as late as possible: a stateful filter (stale-input
                # skipping) then decides with its state as of the batches consumed so far.
                pieces = [
                    (labels[i : i + B], dense[i : i + B], sparse[i : i + B], positions[i : i + B])
                    for i in range(0, len(labels), B)
                ]
            for labels, dense, sparse, positions in pieces:
                if self.sample_filter is not None:
                    # A filter that keeps per-input state (loss pruning) also gets the split positions.
                    wants = getattr(self.sample_filter, "wants_positions", False)
                    mask = self.sample_filter(sparse, positions) if wants else self.sample_filter(sparse)
                    mask = np.asarray(mask, dtype=bool)
                    if mask.shape != labels.shape:
                        raise SlipcacheError(
                            f"sample_filter returned shape {mask.shape}, expected {labels.shape}"
                        )
                    dropped += int(len(mask) - mask.sum())
                    labels, dense, sparse = labels[mask], dense[mask], sparse[mask]
                if carry is not None:
                    labels, dense, sparse = (
                        np.concatenate([c, a]) for c, a in zip(carry, (labels, dense, sparse), strict=True)
                    )
                full = len(labels) // B
                for i in range(full):
                    part = slice(i * B, (i + 1) * B)
                    item = (_to_batch(labels[part], dense[part], sparse[part]), dropped)
                    dropped = 0
                    if skip:
                        skip -= 1
                        self.samples_seen += B
                        self.samples_dropped += item[1]
                        self.batch_index += 1
                        continue
                    yield item
                carry = (labels[full * B :], dense[full * B :], sparse[full * B :])
        if carry is not None and len(carry[0]) and not self.drop_last:
            if skip:
                self.samples_seen += len(carry[0])
                self.samples_dropped += dropped
                self.batch_index += 1
            else:
                yield _to_batch(*carry), dropped
            dropped = 0
        self._tail_dropped = dropped


def _to_batch(labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> Batch:
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse=torch.from_numpy(sparse.astype(np.int64)),
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
    )
