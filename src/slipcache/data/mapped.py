"""Arrays read where they lie: memory-mapped .npy files and uncompressed .npz members, and columns
spread over several such files that convert only the rows asked for (`LazyColumn`).

Why: TorchRec / DLRM / MLPerf files are tens of gigabytes; a copy in our format would double the disk.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.errors import SlipcacheError

Convert = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Piece:
    """Rows [start, end) of one memory-mapped array."""

    array: np.ndarray
    start: int
    end: int


class LazyColumn:
    """A column of a split spread over several memory-mapped files, converted as it is indexed.

    Behaves like the read-only array the trainer expects (`shape`, `dtype`, slicing, integer-array
    indexing); only the rows asked for are read and converted.
    """

    def __init__(self, pieces: Sequence[Piece], convert: Convert, tail: tuple[int, ...], dtype: Any) -> None:
        self.pieces = list(pieces)
        self.convert = convert
        self.dtype = np.dtype(dtype)
        self._bounds = np.cumsum([0] + [p.end - p.start for p in self.pieces])
        self.shape = (int(self._bounds[-1]), *tail)
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[:]
        return values if dtype is None else values.astype(dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        n = self.shape[0]
        if isinstance(index, (int, np.integer)):
            return self[np.array([index])][0]
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                return self._read_range(start, max(start, stop))
            index = np.arange(start, stop, step)
        rows = np.asarray(index)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        rows = np.where(rows < 0, rows + n, rows).astype(np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise IndexError(f"row index out of range for a column of {n} rows")
        out = np.empty((rows.size, *self.shape[1:]), dtype=self.dtype)
        which = np.searchsorted(self._bounds, rows, side="right") - 1
        for p in np.unique(which):
            mask = which == p
            piece = self.pieces[p]
            out[mask] = self.convert(piece.array[piece.start + rows[mask] - self._bounds[p]])
        return out

    def _read_range(self, start: int, stop: int) -> np.ndarray:
        parts = []
        for p, piece in enumerate(self.pieces):
            lo, hi = max(start, int(self._bounds[p])), min(stop, int(self._bounds[p + 1]))
            if lo < hi:
                offset = piece.start - int(self._bounds[p])
                parts.append(self.convert(piece.array[offset + lo : offset + hi]))
        if not parts:
            return np.empty((0, *self.shape[1:]), dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def load_npy(path: Path) -> np.ndarray:
    """A memory-mapped .npy; an unreadable file is named in a one-line error, not a numpy traceback."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise SlipcacheError(f"{path}: unreadable array: {exc}") from exc


def npz_members(path: Path) -> dict[str, zipfile.ZipInfo]:
    """The .npz's arrays by name (without `.npy`), as zip entries: what `mmap_npz_member` maps."""
    try:
        with zipfile.ZipFile(path) as zf:
            return {info.filename.removesuffix(".npy"): info for info in zf.infolist()}
    except (OSError, zipfile.BadZipFile) as exc:
        raise SlipcacheError(f"{path}: unreadable .npz: {exc}") from exc


def npz_compressed(path: Path) -> bool:
    """Whether any member is deflated: such files cannot be mapped and are converted once instead."""
    return any(info.compress_type != zipfile.ZIP_STORED for info in npz_members(path).values())


def _member_header(path: Path, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Shape, Fortran order, dtype and data offset of an uncompressed .npz member."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            raise SlipcacheError(f"{path}: corrupt zip entry {info.filename}")
        name_len = int.from_bytes(local[26:28], "little")
        extra_len = int.from_bytes(local[28:30], "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(f)
        return shape, fortran, dtype, f.tell()


def npz_fortran_members(path: Path) -> list[str]:
    """Members of an uncompressed .npz stored in Fortran (column-major) order, as the DLRM reference
    stores ``X_cat``: mappable, but a row read from them touches one page per column."""
    return [
        name
        for name, info in npz_members(path).items()
        if info.compress_type == zipfile.ZIP_STORED and _member_header(path, info)[1]
    ]


def mmap_npz_member(path: Path, info: zipfile.ZipInfo) -> np.ndarray:
    """Memory-map an uncompressed member of an .npz (np.savez) without reading it (C or Fortran order)."""
    shape, fortran, dtype, offset = _member_header(path, info)
    if dtype.hasobject:
        raise SlipcacheError(f"{path}: {info.filename} holds Python objects, not numbers")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def npz_arrays(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The named arrays of an uncompressed .npz, memory-mapped; a missing one is named with those present."""
    members = npz_members(path)
    missing = [n for n in names if n not in members]
    if missing:
        raise SlipcacheError(f"{path}: missing array {missing[0]!r} (has: {', '.join(sorted(members))})")
    return {n: mmap_npz_member(path, members[n]) for n in names}
