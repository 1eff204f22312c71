"""Writing datasets of any length in bounded memory: rows arrive in chunks, in order, and are appended.

A memory-mapped output (`DatasetWriter`'s default) keeps every page it wrote resident until the map is
closed, so writing a 100 GB dataset would hold 100 GB; appending to files lets the kernel write pages back
and drop them. Two writers, both fed chunks of rows in log order by any generator:

- `StreamingDatasetWriter`: slipcache's own format (`train/val/test.{labels,dense,sparse}.npy` + meta.json),
  byte for byte what `DatasetWriter` writes;
- `TorchRecWriter`: TorchRec's Criteo layout, `day_{i}_{dense,sparse,labels}.npy` (float32 [n, 13], int64
  [n, 26], int32 [n, 1]); days 0..N-2 are training, the last day holds validation then test in halves.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from slipcache.data.dataset import (
    NUM_DENSE,
    NUM_TABLES,
    TORCHREC_DESCRIPTION,
    DatasetWriter,
    remove_dead_staging,
    remove_replaced_dataset_files,
)
from slipcache.errors import SlipcacheError

TORCHREC_INFO = TORCHREC_DESCRIPTION  # what generated a TorchRec-layout directory (no meta.json: not our format)


class NpyAppender:
    """A `.npy` file of a known final shape, filled by appending rows in order (`a[start:end] = rows`)."""

    def __init__(self, path: Path, dtype: Any, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.rows = 0
        self._file: BinaryIO | None = open(path, "wb")  # noqa: SIM115 (closed by flush/close)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": self.shape}
        np.lib.format.write_array_header_1_0(self._file, header)

    def __setitem__(self, index: slice, values: np.ndarray) -> None:
        if not isinstance(index, slice) or (index.start or 0) != self.rows:
            raise SlipcacheError(f"{self.path.name}: rows must be appended in order (next is {self.rows})")
        self.append(values)

    def append(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        if values.shape[1:] != self.shape[1:] or self.rows + len(values) > self.shape[0]:
            raise SlipcacheError(f"{self.path.name}: {values.shape} does not continue {self.shape} at row {self.rows}")
        assert self._file is not None
        self._file.write(values.tobytes())
        self.rows += len(values)

    def flush(self) -> None:
        """Close the file; every row must have been written."""
        self.close()
        if self.rows != self.shape[0]:
            raise SlipcacheError(f"{self.path.name}: {self.rows} of {self.shape[0]} rows written")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StreamingDatasetWriter(DatasetWriter):
    """`DatasetWriter` whose rows must come in order per split, appended instead of memory-mapped."""

    def _open_array(self, path: Path, dtype: Any, shape: tuple[int, ...]) -> NpyAppender:
        return NpyAppender(path, dtype, shape)

    def abort(self) -> None:
        for arrays in self.arrays.values():
            for array in (arrays.labels, arrays.dense, arrays.sparse):
                array.close()  # type: ignore[attr-defined]
        super().abort()


def torchrec_day_rows(train: int, held: int, days: int) -> list[int]:
    """Rows of each day file: `train` rows over days - 1 days (extras first), then the held-out day."""
    if days < 2:
        raise SlipcacheError(f"the TorchRec layout needs at least 2 days (training days + one held out), got {days}")
    base, extra = divmod(train, days - 1)
    return [base + (1 if d < extra else 0) for d in range(days - 1)] + [held]


class TorchRecWriter:
    """Rows in log order into TorchRec's day files, staged and moved into `out_dir` only when complete."""

    def __init__(self, out_dir: str | os.PathLike[str], day_rows: list[int]) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(self.out_dir)
        self.staging = self.out_dir / f".tmp-{os.getpid()}"
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        self.day_rows = list(day_rows)
        self.day = 0
        self.files: list[NpyAppender] = []
        self._open_day()

    def _open_day(self) -> None:
        for f in self.files:
            f.flush()
        self.files = []
        if self.day < len(self.day_rows):
            n, stem = self.day_rows[self.day], self.staging / f"day_{self.day}"
            self.files = [
                NpyAppender(stem.with_name(f"{stem.name}_dense.npy"), np.float32, (n, NUM_DENSE)),
                NpyAppender(stem.with_name(f"{stem.name}_sparse.npy"), np.int64, (n, NUM_TABLES)),
                NpyAppender(stem.with_name(f"{stem.name}_labels.npy"), np.int32, (n, 1)),
            ]

    def append(self, labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> None:
        """The next rows of the log (any count: they are cut at day boundaries)."""
        done = 0
        while done < len(labels):
            if not self.files:
                raise SlipcacheError(f"more rows than the {sum(self.day_rows)} the days hold")
            room = self.files[0].shape[0] - self.files[0].rows
            take = min(room, len(labels) - done)
            part = slice(done, done + take)
            self.files[0].append(dense[part])
            self.files[1].append(sparse[part])
            self.files[2].append(np.asarray(labels[part]).reshape(-1, 1))
            done += take
            while self.files and self.files[0].rows == self.files[0].shape[0]:
                self.day += 1
                self._open_day()

    def commit(self, info: dict[str, Any]) -> dict[str, Any]:
        """Check every day is complete, then move the files in place (the description last)."""
        if self.files:
            raise SlipcacheError(f"day {self.day} is incomplete: {self.files[0].rows} of {self.files[0].shape[0]} rows")
        (self.staging / TORCHREC_INFO).write_text(json.dumps(info, indent=1) + "\n")
        with contextlib.suppress(FileNotFoundError):
            (self.out_dir / TORCHREC_INFO).unlink()  # the old description first, as DatasetWriter does
        remove_replaced_dataset_files(self.out_dir, {p.name for p in self.staging.iterdir()})
        for file in sorted(self.staging.iterdir()):
            if file.name != TORCHREC_INFO:
                os.replace(file, self.out_dir / file.name)
        os.replace(self.staging / TORCHREC_INFO, self.out_dir / TORCHREC_INFO)
        self.staging.rmdir()
        return info

    def __enter__(self) -> TorchRecWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None or self.staging.exists():
            for f in self.files:
                f.close()
            shutil.rmtree(self.staging, ignore_errors=True)
