"""The compiled stale-input filter (`filter.c`): classify and filter inputs by their rows' flag bytes, and
count the updates of hot rows, each in one pass over NumPy arrays.

The loops trust their pointers, so every array is checked here first: dtype, C order, shape, and offsets
that keep each table's rows inside `flags` (the loops check every id against its table). A bad array is a
bug of the caller (ValueError); an id outside its table is bad input (None or InvalidInputError).
"""

from __future__ import annotations

import numpy as np

from slipcache import _native
from slipcache.errors import InvalidInputError


def _check_arrays(ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, what: str) -> np.ndarray:
    """int64 offsets [T + 1] of C-contiguous int32 ids [n, T], checked to lie in `flags` (uint8, C order):
    starting at 0 or after, never decreasing, ending within flags. Table t's rows are then
    [offsets[t], offsets[t + 1]) and an id in [0, offsets[t + 1] - offsets[t]) reads a byte of flags."""
    if ids.ndim != 2 or ids.dtype != np.int32 or not ids.flags.c_contiguous:
        raise ValueError(f"compiled loop: {what} needs C-contiguous int32 ids [n, T], got {ids.dtype} {ids.shape}")
    if flags.ndim != 1 or flags.dtype != np.uint8 or not flags.flags.c_contiguous:
        raise ValueError(
            f"compiled loop: {what} needs C-contiguous uint8 flags [rows], got {flags.dtype} {flags.shape}"
        )
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if (offsets.shape != (ids.shape[1] + 1,) or offsets[0] < 0 or (np.diff(offsets) < 0).any()
            or offsets[-1] > flags.size):
        raise ValueError(
            f"compiled loop: {what} needs offsets [T + 1] rising from 0 or more to at most {flags.size} "
            f"(the flag bytes), got {offsets.tolist()[:8]}"
        )
    return offsets


def classify_inputs(
    ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, required: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(stale, hot) bool[n] for int32 ids [n, T] over per-row flag bytes; None if an id is out of its table."""
    library = _native.native()
    assert library is not None
    offsets = _check_arrays(ids, offsets, flags, "classify_inputs")
    n, tables = ids.shape
    stale, hot = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
    bad = library.classify_inputs(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data, required,
                                  stale.ctypes.data, hot.ctypes.data)
    return None if bad >= 0 else (stale, hot)


def filter_inputs(
    ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, required: int, skipping: bool, control_share: float,
    seed_mix: int, start: int,
) -> tuple[np.ndarray, np.ndarray, int, int, int] | None:
    """(keep, control, hot inputs, would-be-skipped, controls) of the skip filter; None if an id is out of range.

    Same contract as `classify_inputs` for ids/offsets/flags; the control draw is filtering.uniform's.
    """
    library = _native.native()
    assert library is not None
    offsets = _check_arrays(ids, offsets, flags, "filter_inputs")
    n, tables = ids.shape
    keep, control = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
    counts = np.zeros(3, dtype=np.int64)
    bad = library.filter_inputs(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data, required,
                                int(skipping), float(control_share), seed_mix, start, keep.ctypes.data,
                                control.ctypes.data, counts.ctypes.data)
    return None if bad >= 0 else (keep, control, int(counts[0]), int(counts[1]), int(counts[2]))


def count_hot_updates(ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, keys: np.ndarray, values: np.ndarray,
                      counts: np.ndarray) -> int:
    """counts[hot position of each hot lookup] += 1, in one pass; returns the lookups counted.

    `keys`/`values` are a HotIndex's table (its size a power of two; keys -1 = empty), `flags` the detector's
    per-row bytes (non-zero = hot), `counts` int64 [hot rows]. An id outside its table raises
    InvalidInputError, a position outside counts ValueError; either way counts are left as they were.
    """
    library = _native.native()
    assert library is not None
    offsets = _check_arrays(ids, offsets, flags, "count_hot_updates")
    n, tables = ids.shape
    bits = int(keys.size).bit_length() - 1
    for name, array, dtype in (("keys", keys, np.int64), ("values", values, np.int32), ("counts", counts, np.int64)):
        if array.ndim != 1 or array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError(f"compiled loop: count_hot_updates needs C-contiguous {np.dtype(dtype)} {name} [size]")
    if keys.size != 1 << bits or bits > 62 or values.size != keys.size:
        raise ValueError(
            f"compiled loop: a hot index of {keys.size} keys and {values.size} values (a power of two each)"
        )
    code = int(library.count_hot_updates(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data,
                                         keys.ctypes.data, values.ctypes.data, bits, counts.ctypes.data, counts.size))
    if code == -1:
        raise ValueError(f"compiled loop: the hot index holds a position outside [0, {counts.size})")
    if code < -1:
        at = -2 - code
        table = at % tables
        raise InvalidInputError(
            f"id {int(ids.flat[at])} of table {table} is out of range [0, {int(offsets[table + 1] - offsets[table])})"
        )
    return code
