"""The compiled loops of the stale-input filter (`slipcache.staleness`): classify, filter, count updates."""

from __future__ import annotations

import numpy as np

from slipcache import _native


def classify_inputs(
    ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, required: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(stale, hot) bool[n] for int32 ids [n, T] over per-row flag bytes; None if an id is out of its table.

    The caller checks that the library is there and that ids is a C-contiguous int32 [n, T] array.
    """
    library = _native.native()
    assert library is not None
    n, tables = ids.shape
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if (
        ids.dtype != np.int32
        or not ids.flags.c_contiguous
        or flags.dtype != np.uint8
        or not flags.flags.c_contiguous
        or offsets.shape != (tables + 1,)
        or flags.shape[0] < offsets[-1]
    ):
        raise ValueError(
            "compiled loop: ids must be C-contiguous int32 [n, T], offsets [T + 1], flags uint8 covering every row"
        )
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
    n, tables = ids.shape
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if (ids.dtype != np.int32 or not ids.flags.c_contiguous or flags.dtype != np.uint8 or not flags.flags.c_contiguous
            or offsets.shape != (tables + 1,) or flags.shape[0] < offsets[-1]):
        raise ValueError("compiled loop: bad arrays for filter_inputs")
    keep, control = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
    counts = np.zeros(3, dtype=np.int64)
    bad = library.filter_inputs(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data, required,
                                int(skipping), float(control_share), seed_mix, start, keep.ctypes.data,
                                control.ctypes.data, counts.ctypes.data)
    return None if bad >= 0 else (keep, control, int(counts[0]), int(counts[1]), int(counts[2]))


def count_hot_updates(ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, keys: np.ndarray, values: np.ndarray,
                      counts: np.ndarray) -> int:
    """counts[hot position of each hot lookup] += 1, in one pass; returns the lookups counted.

    `keys`/`values` are a HotIndex's table (its size a power of two), `flags` the detector's per-row bytes
    (non-zero = hot). The caller checks that the library is there; ids must be valid C-contiguous int32 [n, T].
    """
    library = _native.native()
    assert library is not None
    n, tables = ids.shape
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    bits = int(keys.size).bit_length() - 1
    if (
        ids.dtype != np.int32 or not ids.flags.c_contiguous or offsets.shape != (tables + 1,)
        or flags.dtype != np.uint8 or flags.shape[0] < offsets[-1] or keys.dtype != np.int64
        or values.dtype != np.int32 or keys.size != 1 << bits or values.size != keys.size
        or counts.dtype != np.int64 or not counts.flags.c_contiguous
    ):
        raise ValueError("compiled loop: bad arrays for count_hot_updates")
    return int(library.count_hot_updates(ids.ctypes.data, n, tables, offsets.ctypes.data, flags.ctypes.data,
                                         keys.ctypes.data, values.ctypes.data, bits, counts.ctypes.data))
