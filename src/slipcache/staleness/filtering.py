"""Classifying training inputs from per-row flag bytes: the one pass that runs on every training input.

Each row of every table has a flag byte (bit 0: hot, bit 1: stale; 3 = hot and stale). ``classify`` says
which inputs are stale and hot under the required count of lookups; ``filter_inputs`` also picks the kept
share of the would-be-skipped inputs (the control group) by a stateless hash of the input's position in the
run; ``count_hot_lookups`` counts the trained inputs' lookups of each hot row. Each chooses once between one
compiled pass (``slipcache._native``), when it is available and the ids are C-contiguous int32 [n, T] (as the
splits hold them; counting converts them), and the NumPy code, the reference, tested equal.

Why a flag byte for every row of every table: the filter classifies each training input, 26 lookups, and
a direct index is about 50x faster than a binary search of the sorted hot rows. It costs one byte per row
(34 MB for the Criteo Kaggle tables), reported as ``flag_bytes`` in the stats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipcache import _native
from slipcache._native import filter as native_filter
from slipcache.errors import InvalidInputError
from slipcache.staleness.hotset import HotIndex, _global_rows, _to_numpy

__all__ = ["Counters", "classify", "count_hot_lookups", "filter_inputs", "lookup_flags", "uniform", "seed_mix"]


@dataclass
class Counters:
    """Per-epoch input counts seen through ``sample_filter`` (or ``count``)."""

    inputs: int = 0
    hot_inputs: int = 0
    skipped: int = 0
    skipped_hot: int = 0
    controls: int = 0  # would-be-skipped inputs trained anyway as the guard's control group


def lookup_flags(sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, row_flags: np.ndarray) -> np.ndarray:
    """uint8 [n, T]: per lookup 0 (cold), 1 (hot) or 3 (hot and stale)."""
    return np.take(row_flags, _global_rows(sparse, offsets))


def _compiled(ids: np.ndarray, num_tables: int) -> bool:
    return (ids.dtype == np.int32 and ids.ndim == 2 and ids.shape[1] == num_tables
            and ids.flags.c_contiguous and _native.native() is not None)


def classify(sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, row_flags: np.ndarray,
             required: int) -> tuple[np.ndarray, np.ndarray]:
    """(stale: at least ``required`` lookups stale, hot: at least ``required`` lookups hot), bool[n] each.

    In NumPy the common case (every lookup required) takes one reduction: the smallest flag decides both.
    """
    num_tables = offsets.size - 1
    ids = _to_numpy(sparse)
    if _compiled(ids, num_tables):
        result = native_filter.classify_inputs(ids, offsets, row_flags, required)
        if result is None:
            raise InvalidInputError("sparse ids out of range for their tables")
        return result
    flags = lookup_flags(sparse, offsets, row_flags)
    if required == num_tables:
        lowest = flags.min(axis=1, initial=3)
        return lowest == 3, lowest >= 1
    return np.count_nonzero(flags == 3, axis=1) >= required, np.count_nonzero(flags, axis=1) >= required


def filter_inputs(sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, row_flags: np.ndarray, required: int,
                  skipping: bool, control_share: float, seed: int,
                  position: int) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """(keep, control, hot inputs, would-be-skipped inputs, controls) of a batch of inputs.

    ``position``: the run position of the first input, which with ``seed`` decides the control draws, so a
    resumed run draws what the uninterrupted one drew.
    """
    ids = _to_numpy(sparse)
    if _compiled(ids, offsets.size - 1):  # one C pass: a few NumPy passes less
        result = native_filter.filter_inputs(ids, offsets, row_flags, required, skipping, control_share,
                                             seed_mix(seed), position)
        if result is None:
            raise InvalidInputError("sparse ids out of range for their tables")
        return result
    skip, hot = classify(sparse, offsets, row_flags, required)
    control = np.zeros_like(skip)
    would_skip = np.flatnonzero(skip) if skipping else np.zeros(0, dtype=np.int64)
    if control_share > 0.0 and would_skip.size:
        # draws for the would-be-skipped inputs only; the same values a draw for every input gives them
        control[would_skip[uniform(seed, position + would_skip) < control_share]] = True
    keep = np.ones_like(skip)
    keep[would_skip] = False
    keep |= control
    return keep, control, int(np.count_nonzero(hot)), int(would_skip.size), int(np.count_nonzero(control))


def count_hot_lookups(ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, index: HotIndex,
                      counts: np.ndarray) -> np.ndarray:
    """Count the hot lookups of trained ids [n, T] (in range: the filter checked them) per hot-set position.

    The compiled pass adds them to ``counts`` (flag byte, hash probe and increment per lookup; ~6x faster
    than NumPy; it checks every id against its table first, a sequential pass) and returns no position; the
    NumPy reference returns the hot positions for the caller to add, with other batches', in one
    ``np.bincount``. Either way the sums are the same.
    """
    if ids.ndim == 2 and ids.dtype.kind in "iu" and _native.native() is not None:
        # Batches hold int64 ids; ids index a table, so int32 holds them (the copy is of the counted share).
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        native_filter.count_hot_updates(ids, offsets, flags, index.keys, index.values, counts)
        return np.zeros(0, dtype=np.int32)
    rows = (ids + offsets[:-1].astype(ids.dtype)).reshape(-1)
    rows = rows[np.take(flags, rows) != 0]  # hot lookups only: the flag byte says so
    positions = index.find(rows)
    return positions[positions >= 0]


def uniform(seed: int, positions: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) values for inputs at these positions of a run: splitmix64 of (seed, position).

    Stateless, so a resumed run draws exactly what the uninterrupted one drew for the same inputs. The
    compiled filter (``_native/filter.c``) computes the same values.
    """
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) + np.uint64(seed_mix(seed))
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def seed_mix(seed: int) -> int:
    return (seed * 0x632BE59BD9B4E019) % 2**64
