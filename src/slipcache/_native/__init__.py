"""Optional compiled loops for the CPU hot path: cache lookup, the fused SGD and Adagrad updates, the quantize pass
(`quantize`), the stale-input filter (`filter`).

Each is a plain loop over the lookups of a batch. In torch they take several passes over [lookups, ways]
temporaries; in C they are one pass. `set_threads(n)` splits the lookup, gather and update loops over n
threads of a persistent pool (`pool.c`), with results identical to one thread (docs/design.md says how).
The C files (`loops.c` the cache, `update.c` the backward, `quantize.c`, `filter.c`, each compiling on its own
against `pool.h`) are compiled with the system's C compiler on first use (about a second) into a per-user
cache and loaded with ctypes (`build`: build flags, cache, safety checks, ctypes signatures); without a
compiler, or with SLIPCACHE_NATIVE=0, the pure-torch path runs. Tests check the two agree. The loops trust
their pointers: the wrappers here check every tensor (device, dtype, layout, shape) and every index the
loops do not check themselves.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from slipcache._native.build import (
    NoCompilerError,
    UnsafeCacheError,
    build_flags,
    cache_key,
    load_library,
    private_directory,
)
from slipcache.errors import InvalidInputError, SlipcacheError

__all__ = [
    "NoCompilerError",
    "UnsafeCacheError",
    "build_flags",
    "cache_key",
    "load_library",
    "private_directory",
    "set_simd",
    "set_threads",
    "simd",
    "threads",
]

_library: ctypes.CDLL | None = None
_tried = False

def native() -> ctypes.CDLL | None:
    """The compiled library, or None when disabled or unavailable (then a warning says why, once)."""
    global _library, _tried
    if not _tried:
        _tried = True
        if os.environ.get("SLIPCACHE_NATIVE", "1") != "0":
            from slipcache.cache_dir import default_cache_root

            try:
                _library = load_library(default_cache_root() / "native")
                _library.slipcache_set_threads(threads_for(1))  # SLIPCACHE_LOOP_THREADS, when set
            except NoCompilerError:
                _library = None
            except OSError as exc:
                _library = None
                warnings.warn(f"slipcache: compiled loops unavailable, using torch: {exc}", stacklevel=2)
    return _library




def set_threads(count: int) -> int:
    """Threads of each compiled loop from now on, the calling thread included (1, the default: the calling
    thread only); returns the previous count. `--threads` sets it with torch's. Any count gives the same
    results; the pool's workers start on the first loop that uses them. No-op without the library."""
    if count < 1:
        raise ValueError(f"compiled loops: threads must be positive, got {count}")
    library = native()
    if library is None:
        return 1
    previous = int(library.slipcache_threads())
    library.slipcache_set_threads(count)
    return previous


SIMD_LEVELS = ("scalar", "avx2", "avx512")


def simd() -> str:
    """The row kernels' instruction set now: "scalar" (the plain loops, the reference; also without the
    library), "avx2" or "avx512": the best the CPU offers unless SLIPCACHE_NATIVE_SIMD or `set_simd` lowered it."""
    library = native()
    return "scalar" if library is None else SIMD_LEVELS[int(library.slipcache_simd())]


def set_simd(level: str | None) -> str:
    """Use at most `level` ("scalar", "avx2", "avx512"; None: the default) from now on; returns the level set
    (lowered to what the CPU supports). Every level gives the same bytes: tests run each against "scalar"."""
    if level is not None and level not in SIMD_LEVELS:
        raise ValueError(f"compiled loops: SIMD level must be one of {SIMD_LEVELS} or None, got {level!r}")
    library = native()
    if library is None:
        return "scalar"
    return SIMD_LEVELS[int(library.slipcache_set_simd(-1 if level is None else SIMD_LEVELS.index(level)))]


LOOP_THREADS_VARIABLE = "SLIPCACHE_LOOP_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of the machine's without one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_thread_count(count: int, what: str = "--threads") -> int:
    """`count` threads, refused in one line beyond 4 per usable core: more only wait for each other (and
    `--threads 1000` is a typo more often than a plan)."""
    limit = 4 * usable_cores()
    if count > limit:
        raise SlipcacheError(
            f"{what} {count} is more than 4 per core this process may use ({usable_cores()} cores); at most {limit}"
        )
    return count


def threads_for(requested: int) -> int:
    """The loops' threads for a `--threads N` request: N, unless SLIPCACHE_LOOP_THREADS sets the loops alone
    (torch's OpenMP threads wait for each other and collapse on a busy machine; the pool's parts do not)."""
    given = os.environ.get(LOOP_THREADS_VARIABLE)
    if not given:
        return requested
    if not given.isdigit() or int(given) < 1:
        raise SlipcacheError(f"{LOOP_THREADS_VARIABLE} must be a positive integer, got {given!r}")
    return check_thread_count(int(given), LOOP_THREADS_VARIABLE)


def threads() -> int:
    """Threads of each compiled loop (1 without the library)."""
    library = native()
    return 1 if library is None else int(library.slipcache_threads())


def scratch_bytes() -> int:
    """Bytes the compiled loops keep between calls, every thread's together (0 without the library): per
    calling thread, the backward's position lists, the Adagrad step's distinct-row check, the distinct rows'
    hash table and sort, the slot assignment's tables and the forward's per-table hit counts, each grown to
    the largest batch seen and freed when the thread exits (no allocation per step)."""
    library = native()
    return 0 if library is None else int(library.slipcache_scratch_bytes())


def usable(*tensors: Tensor) -> bool:
    return native() is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _check(name: str, tensor: Tensor | None, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...]) -> None:
    """The C loops trust their pointers: refuse anything but a contiguous CPU tensor of the expected layout."""
    if tensor is None:
        return
    # Called a few dozen times a step: plain comparisons, no generator (the same checks).
    ok = tensor.is_cpu and tensor.dtype in dtypes and tensor.is_contiguous() and tensor.dim() == len(shape)
    if ok:
        have_shape = tensor.shape
        for k, want in enumerate(shape):
            if want is not None and have_shape[k] != want:
                ok = False
                break
    if not ok:
        want_shape = tuple("*" if s is None else s for s in shape)
        raise ValueError(
            f"compiled loop: {name} must be a contiguous CPU tensor of dtype {'/'.join(map(str, dtypes))} "
            f"and shape {want_shape}; got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )


def _check_cache_state(slot_rows: Tensor, last_used: Tensor | None, use_count: Tensor | None, slots: int) -> None:
    """The cache's per-slot arrays, as every cache loop reads them."""
    _check("slot_rows", slot_rows, (torch.int32, torch.int64), (slots,))
    _check("last_used", last_used, (torch.int32,), (slots,))
    _check("use_count", use_count, (torch.int32,), (slots,))


_INT32 = (-(2**31), 2**31 - 1)


def _check_step(step: int) -> None:
    """A step the int32 `last_used` can hold (the loops take it as int32: a larger one would wrap, where the
    torch path refuses it too)."""
    if not _INT32[0] <= step <= _INT32[1]:
        raise InvalidInputError(f"cache step {step} is outside int32 [{_INT32[0]}, {_INT32[1]}], as last_used is")


def lookup(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    rows: Tensor,
    last_used: Tensor | None,
    use_count: Tensor | None,
    step: int,
) -> Tensor:
    """Slot per row (-1 on a miss); hits get last_used = step and use_count += 1 when given."""
    library = native()
    assert library is not None
    rows = rows.contiguous()
    _check_cache_state(slot_rows, last_used, use_count, num_sets * ways)
    _check("rows", rows, (torch.int64,), (None,))
    _check_step(step)
    slots = torch.empty_like(rows)
    library.lookup(
        slot_rows.data_ptr(),
        int(slot_rows.dtype == torch.int64),
        num_sets,
        ways,
        multiplier,
        rows.data_ptr(),
        rows.numel(),
        slots.data_ptr(),
        last_used.data_ptr() if last_used is not None else None,
        use_count.data_ptr() if use_count is not None else None,
        step,
    )
    return slots


def sgd_update(weights: Tensor, slots: Tensor, grad: Tensor, lr: float) -> bool:
    """weights[slots[i]] -= lr * grad[i], for repeated slots too (in batch order).

    Returns whether every value it wrote is finite (False: an update overflowed to inf or NaN)."""
    library = native()
    assert library is not None
    slots, grad = slots.contiguous(), grad.contiguous().float()  # a read-only input may be converted
    return _run_sgd(library.sgd_update, weights, slots, grad, lr) != _OVERFLOWED


_NOT_FINITE, _OVERFLOWED = -2, -3  # the SGD loops' codes: gradient not finite (nothing written); overflow
_REPEATED_SLOT, _REPEATED_STATE_ROW, _NO_MEMORY = -4, -5, -6  # Adagrad's refusals (nothing written)
_REPEATED = {_REPEATED_SLOT: "slot", _REPEATED_STATE_ROW: "state row"}


def _run_sgd(loop: Callable[..., int], weights: Tensor, slots: Tensor, grad: Tensor, lr: float) -> int:
    """Check the arguments of an SGD loop, run it and return its code; a slot out of range raises."""
    _check("weights", weights, (torch.float32,), (None, None))
    _check("slots", slots, (torch.int64,), (None,))
    _check("grad", grad, (torch.float32,), (slots.numel(), weights.shape[1]))
    code = loop(
        weights.data_ptr(),
        weights.shape[0],
        weights.shape[1],
        slots.data_ptr(),
        grad.data_ptr(),
        slots.numel(),
        lr,
    )
    if code >= 0:
        raise ValueError(f"compiled loop: slot {int(slots[code])} is outside [0, {weights.shape[0]})")
    return code


def global_rows(ids: Tensor, offsets: Tensor, out: Tensor | None = None) -> tuple[Tensor, int]:
    """(offsets[t] + ids[:, t] flattened, -1) for int64 ids [B, T], or (partial rows, index of the first id
    outside its table `[0, offsets[t + 1] - offsets[t])`). Written into `out` [B * T] when given."""
    library = native()
    assert library is not None
    _check("ids", ids, (torch.int64,), (None, offsets.numel() - 1))
    _check("offsets", offsets, (torch.int64,), (ids.shape[1] + 1,))
    rows = torch.empty(ids.numel(), dtype=torch.int64) if out is None else out
    _check("out", rows, (torch.int64,), (ids.numel(),))
    bad = library.global_rows(ids.data_ptr(), ids.shape[0], ids.shape[1], offsets.data_ptr(), rows.data_ptr())
    return rows, int(bad)


def lookup_gather(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    rows: Tensor,
    tables: int,
    last_used: Tensor,
    use_count: Tensor | None,
    step: int,
    weights: Tensor,
    out: Tensor,
    counters: Tensor,
    columns: tuple[int, int, int],
    slots: Tensor | None = None,
) -> tuple[Tensor, int]:
    """The forward's one pass over single-hot lookups `rows` [B * T] (table = position mod T): `lookup`'s
    slots and touches, each hit's row of `weights` copied into `out` [B * T, D] (miss rows are left as they
    are), and per-table lookups, hits and misses added to `counters` [T, C] at `columns`. Returns
    (slots, hits); the slots are written into `slots` when given."""
    library = native()
    assert library is not None
    slots_count = num_sets * ways
    _check_cache_state(slot_rows, last_used, use_count, slots_count)
    _check_step(step)
    _check("weights", weights, (torch.float32,), (slots_count, None))
    if tables < 1 or rows.numel() % tables:
        raise ValueError(f"compiled loop: {rows.numel()} lookups are not whole rows of {tables} tables")
    _check("rows", rows, (torch.int64,), (None,))
    _check("out", out, (torch.float32,), (rows.numel(), weights.shape[1]))
    _check("counters", counters, (torch.int64,), (tables, None))
    if not all(0 <= c < counters.shape[1] for c in columns):
        raise ValueError(f"compiled loop: counter columns {columns} outside [0, {counters.shape[1]})")
    slots = torch.empty_like(rows) if slots is None else slots
    _check("slots", slots, (torch.int64,), (rows.numel(),))
    hits = library.lookup_gather(
        slot_rows.data_ptr(),
        int(slot_rows.dtype == torch.int64),
        num_sets,
        ways,
        multiplier,
        rows.data_ptr(),
        rows.numel() // tables,
        tables,
        slots.data_ptr(),
        last_used.data_ptr(),
        use_count.data_ptr() if use_count is not None else None,
        step,
        weights.data_ptr(),
        weights.shape[1],
        out.data_ptr(),
        counters.data_ptr(),
        counters.shape[1],
        *columns,
    )
    if hits < 0:
        raise MemoryError("compiled loop: no memory for the per-table hit counts")
    return slots, int(hits)


def pool_bags(values: Tensor, bags: Tensor, weights: Tensor | None, num_bags: int) -> Tensor:
    """Pooled bags [num_bags, D]: out[bags[i]] += values[i] (* weights[i]), in value order: torch's
    `zeros.index_add_(0, bags, values * weights[:, None])` in one pass, without the weighted copy."""
    library = native()
    assert library is not None
    _check("values", values, (torch.float32,), (None, None))
    _check("bags", bags, (torch.int64,), (values.shape[0],))
    _check("weights", weights, (torch.float32,), (values.shape[0],))
    out = values.new_zeros(num_bags, values.shape[1])
    bad = library.pool_bags(
        values.data_ptr(),
        bags.data_ptr(),
        weights.data_ptr() if weights is not None else None,
        values.shape[0],
        values.shape[1],
        out.data_ptr(),
        num_bags,
    )
    if bad >= 0:
        raise ValueError(f"compiled loop: bag {int(bags[bad])} is outside [0, {num_bags})")
    return out


def unique_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(distinct rows in order of first occurrence, index of each row there): `torch.unique(rows,
    return_inverse=True)` by hashing instead of sorting, for callers that do not need the rows sorted."""
    library = native()
    assert library is not None
    _check("rows", rows, (torch.int64,), (None,))
    unique, inverse = torch.empty_like(rows), torch.empty_like(rows)
    count = library.unique_rows(rows.data_ptr(), rows.numel(), unique.data_ptr(), inverse.data_ptr())
    if count < 0:
        raise MemoryError("compiled loop: no memory for the distinct rows")
    return unique[:count], inverse


def sorted_unique(
    rows: Tensor, slots: Tensor | None = None
) -> tuple[Tensor | None, Tensor, Tensor, Tensor] | None:
    """`torch.unique(taken, return_inverse=True, return_counts=True)` of the taken rows, in one compiled pass
    (hashed, then the distinct rows radix-sorted): the same tensors, as sorting gives them. The taken rows are
    every row, or with `slots` (as many) those at the positions where `slots` is negative (a forward's
    misses). Returns (those positions, or None without `slots`; distinct rows ascending; index of each taken
    row there; uses of each distinct row), or None beyond the loop's 2^30 rows (the caller sorts in torch)."""
    library = native()
    assert library is not None
    _check("rows", rows, (torch.int64,), (None,))
    _check("slots", slots, (torch.int64,), (rows.numel(),))
    n = rows.numel()
    positions = torch.empty_like(rows) if slots is not None else None
    unique, inverse, counts = torch.empty_like(rows), torch.empty_like(rows), torch.empty_like(rows)
    taken = ctypes.c_int64(0)
    count = library.sorted_unique(
        rows.data_ptr(), slots.data_ptr() if slots is not None else None, n,
        positions.data_ptr() if positions is not None else None, unique.data_ptr(), inverse.data_ptr(),
        counts.data_ptr(), ctypes.byref(taken),
    )  # fmt: skip
    if count == -2:
        return None
    if count < 0:
        raise MemoryError("compiled loop: no memory for the distinct rows")
    m = taken.value
    return (
        positions[:m] if positions is not None else None, unique[:count], inverse[:m], counts[:count]
    )


def fill_misses(
    positions: Tensor, inverse: Tensor, assigned: Tensor, slots: Tensor, weights: Tensor, out: Tensor
) -> None:
    """The forward's misses once their rows have slots, in one pass: `slots[positions] = assigned[inverse]`
    and, for each of those with a slot (not -1), `out[position] = weights[slot]` (the rows served from storage
    are left to the caller). Every index is checked first (ValueError, nothing written)."""
    library = native()
    assert library is not None
    _check("positions", positions, (torch.int64,), (None,))
    _check("inverse", inverse, (torch.int64,), (positions.numel(),))
    _check("assigned", assigned, (torch.int64,), (None,))
    _check("slots", slots, (torch.int64,), (None,))
    _check("weights", weights, (torch.float32,), (None, None))
    _check("out", out, (torch.float32,), (slots.numel(), weights.shape[1]))
    bad = library.fill_misses(
        positions.data_ptr(), inverse.data_ptr(), positions.numel(), assigned.data_ptr(), assigned.numel(),
        slots.data_ptr(), slots.numel(), weights.data_ptr(), weights.shape[0], weights.shape[1], out.data_ptr(),
    )  # fmt: skip
    if bad >= 0:
        raise ValueError(f"compiled loop: miss {bad} has a position, row or slot out of range")


def all_finite(values: Tensor) -> bool:
    """Whether every value of a contiguous fp32 CPU tensor is finite, in one pass (torch.isfinite(x).all()
    takes several, with a temporary as large as x)."""
    library = native()
    assert library is not None
    _check("values", values, (torch.float32,), (None,) * values.dim())
    return bool(library.finite_values(values.data_ptr(), values.numel()))


def assign_slots(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    last_used: Tensor,
    use_count: Tensor | None,
    pin_since: int,
    rows: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`RowCache.assign` for LRU/LFU without a window in one pass: (slot of each unique missing row or -1,
    victim slots, victim rows)."""
    library = native()
    assert library is not None
    slots_count = num_sets * ways
    _check_cache_state(slot_rows, last_used, use_count, slots_count)
    _check("rows", rows, (torch.int64,), (None,))
    slots, victim_slots, victim_rows = torch.empty_like(rows), torch.empty_like(rows), torch.empty_like(rows)
    victims = library.assign_slots(
        slot_rows.data_ptr(),
        int(slot_rows.dtype == torch.int64),
        num_sets,
        ways,
        multiplier,
        last_used.data_ptr(),
        use_count.data_ptr() if use_count is not None else None,
        max(_INT32[0], min(pin_since, _INT32[1])),  # beyond int32: no step pins, or every one
        rows.data_ptr(),
        rows.numel(),
        slots.data_ptr(),
        victim_slots.data_ptr(),
        victim_rows.data_ptr(),
    )
    if victims < 0:
        raise MemoryError("compiled loop: no memory for the cache assignment")
    return slots, victim_slots[:victims], victim_rows[:victims]


def sgd_update_finite(weights: Tensor, slots: Tensor, grad: Tensor, lr: float) -> tuple[bool, bool]:
    """`sgd_update` for the lookups with a slot (-1: skipped), applied only if every value of `grad` is
    finite; returns (whether it was applied, whether every value it wrote is finite)."""
    library = native()
    assert library is not None
    code = _run_sgd(library.sgd_update_finite, weights, slots, grad, lr)
    return code != _NOT_FINITE, code != _OVERFLOWED


def sum_rows_finite(index: Tensor, grad: Tensor, count: int) -> Tensor | None:
    """Rows of `grad` [n, D] summed by `index` into [count, D] (each sum in row order, as `sum_rows`), and the
    finite check of `grad` in the same pass: None when a value of `grad` is inf or NaN."""
    library = native()
    assert library is not None
    _check("index", index, (torch.int64,), (None,))
    _check("grad", grad, (torch.float32,), (index.numel(), None))
    summed = grad.new_zeros(count, grad.shape[1])
    code = library.sum_rows_finite(summed.data_ptr(), count, grad.shape[1], index.data_ptr(), grad.data_ptr(),
                                   index.numel())
    if code >= 0:
        raise ValueError(f"compiled loop: row index {int(index[code])} is outside [0, {count})")
    return None if code == _NOT_FINITE else summed


def adagrad_update(
    weights: Tensor, slots: Tensor | None, state: Tensor, state_rows: Tensor, grad: Tensor, lr: float, eps: float
) -> bool:
    """The Adagrad step of unique rows in one pass: per row, the squared gradient is added to its state
    (`state` [rows, D] per value, or [rows] row-wise: the row's mean square) and `weights[slots[i]]` (row i
    when `slots` is None) takes `grad[i] / (sqrt(state) + eps) * -lr`. Slots and state rows must be distinct
    (sum a row's gradients first): a repeat raises InvalidInputError, and nothing is written.

    Not bit-identical to the torch step in every case (row-wise, torch sums the squares in fp32 in its own
    order; here they are summed in double), so tests compare both with a float64 reference within a stated
    tolerance. Returns whether every weight it wrote is finite (False: an update overflowed)."""
    library = native()
    assert library is not None
    _check("weights", weights, (torch.float32,), (None, None))
    dim = weights.shape[1]
    rowwise = state.dim() == 1
    _check("state", state, (torch.float32,), (None,) if rowwise else (None, dim))
    _check("state_rows", state_rows, (torch.int64,), (None,))
    count = state_rows.numel()
    _check("slots", slots, (torch.int64,), (count,))
    _check("grad", grad, (torch.float32,), (count, dim))
    if slots is None and count > weights.shape[0]:
        raise ValueError(f"compiled loop: {count} rows of gradient for {weights.shape[0]} weight rows")
    code = library.adagrad_update(
        weights.data_ptr(),
        weights.shape[0],
        dim,
        slots.data_ptr() if slots is not None else None,
        state.data_ptr(),
        state.shape[0],
        state_rows.data_ptr(),
        grad.data_ptr(),
        count,
        int(rowwise),
        lr,
        eps,
    )
    if code >= 0:
        raise ValueError(f"compiled loop: Adagrad row {code} has a slot or state row out of range")
    if code in _REPEATED:
        what, index = _REPEATED[code], slots if code == _REPEATED_SLOT else state_rows
        values, counts = torch.unique(index, return_counts=True)
        raise InvalidInputError(
            f"Adagrad step: {what} {int(values[counts > 1][0])} appears {int(counts[counts > 1][0])} times; "
            "each row must appear once (sum its gradients first)"
        )
    if code == _NO_MEMORY:
        raise MemoryError("compiled loop: no memory to check that the Adagrad rows are distinct")
    return code != _OVERFLOWED
