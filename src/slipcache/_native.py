"""Optional compiled loops for the CPU hot path: cache lookup, the fused SGD update, the stale-input filter.

Each is a plain loop over the lookups of a batch. In torch they take several passes over
[lookups, ways] temporaries; in C they are one pass. The lookup and the update run on
`torch.get_num_threads()` threads for large batches: thread t takes the lookups whose cache set (lookup)
or slot (update) is t modulo the thread count, in batch order, so no two threads write one slot and
every slot sees its updates in the same order whatever the thread count: results do not depend on it. The C source is compiled with the system's C
compiler on first use (about a second) into a per-user cache and loaded with ctypes; without a
compiler, or with SLIPCACHE_NATIVE=0, the pure-torch path runs. Tests check the two agree.

The cache (`$SLIPCACHE_CACHE_DIR/native`, default `~/.cache/slipcache/native`) is a directory of mode 0700;
a directory or library that another user owns or could write is refused (the torch path runs, with a
warning), builds are renamed into place whole, the file name keys the source, compiler, flags and CPU
architecture, and a cached library that fails to load is rebuilt once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>

/* Run part(arg_t) for t = 0..threads-1: threads-1 new threads and the caller; joined before returning. */
#define MAX_THREADS 64
static void run_parts(void *(*part)(void *), void *args, size_t arg_size, int64_t threads) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], 0, part, (char *)args + t * arg_size) == 0;
    part(args);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], 0);
        else part((char *)args + t * arg_size);  /* no thread to be had: do its share here */
    }
}

/* Must match RowCache.set_of: ((r ^ (r >> 17)) * M >> 5) mod num_sets, with wrapping int64;
   M = 0 marks a cache that holds every row: set r / ways (-1 for a row beyond the last set). */
static inline int64_t set_of(int64_t r, int64_t multiplier, int64_t num_sets, int64_t ways) {
    if (multiplier == 0) return (r >= 0 && r / ways < num_sets) ? r / ways : -1;
    int64_t mixed = (int64_t)((uint64_t)(r ^ (r >> 17)) * (uint64_t)multiplier);
    int64_t s = (mixed >> 5) % num_sets;
    return s < 0 ? s + num_sets : s;
}

typedef struct {
    const void *slot_rows; int wide; int64_t num_sets, ways, multiplier;
    const int64_t *rows; int64_t n; int64_t *out_slots; int32_t *last_used, *use_count; int32_t step;
    int64_t part, parts, hits;
} lookup_args;

static void *lookup_part(void *p) {
    lookup_args *a = (lookup_args *)p;
    int64_t hits = 0;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t r = a->rows[i];
        int64_t set = set_of(r, a->multiplier, a->num_sets, a->ways);
        if (a->parts > 1 && (set < 0 ? 0 : set) % a->parts != a->part) continue;
        int64_t first = set * a->ways, slot = -1;
        for (int64_t w = 0; set >= 0 && w < a->ways; w++) {
            int64_t resident = a->wide ? ((const int64_t *)a->slot_rows)[first + w]
                                       : ((const int32_t *)a->slot_rows)[first + w];
            if (resident == r) { slot = first + w; break; }
        }
        a->out_slots[i] = slot;
        if (slot >= 0) {
            hits++;
            if (a->last_used) a->last_used[slot] = a->step;
            if (a->use_count) a->use_count[slot] += 1;
        }
    }
    a->hits = hits;
    return 0;
}

/* Slot of each row (-1 on a miss); hits get last_used = step and use_count += 1. Returns the hits. */
int64_t lookup(const void *slot_rows, int wide, int64_t num_sets, int64_t ways, int64_t multiplier,
               const int64_t *rows, int64_t n, int64_t *out_slots, int32_t *last_used, int32_t *use_count,
               int32_t step, int64_t threads) {
    lookup_args args[MAX_THREADS];
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 0; t < threads; t++)
        args[t] = (lookup_args){slot_rows, wide, num_sets, ways, multiplier, rows, n, out_slots, last_used,
                                use_count, step, t, threads, 0};
    run_parts(lookup_part, args, sizeof(lookup_args), threads);
    int64_t hits = 0;
    for (int64_t t = 0; t < threads; t++) hits += args[t].hits;
    return hits;
}

/* Stale-input filter: per input, whether at least `required` of its lookups are stale (flag 3) and hot
   (flag != 0). Returns -1, or the index of the first id outside its table (nothing after it is written). */
/* One input: its hot and stale lookups, counted until fewer than `required` hot ones are still possible
   (then neither count can reach it: stale rows are hot); -1, or the table of the first id outside its table.
   Every id is range-checked; the flag reads, random accesses into a byte per row, stop early: with
   required = every lookup (alpha = 1) a cold input costs its first cold lookup, not all of them. */
static inline int64_t classify_one(const int32_t *row, int64_t tables, const int64_t *offsets,
                                   const uint8_t *flags, int64_t required, int64_t *num_hot, int64_t *num_stale) {
    for (int64_t t = 0; t < tables; t++) {
        if (row[t] < 0 || row[t] >= offsets[t + 1] - offsets[t]) return t;
    }
    *num_hot = *num_stale = 0;
    for (int64_t t = 0; t < tables; t++) {
        uint8_t flag = flags[offsets[t] + row[t]];
        *num_hot += flag != 0;
        *num_stale += flag == 3;
        if (*num_hot + (tables - 1 - t) < required) break;
    }
    return -1;
}

int64_t classify_inputs(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                        const uint8_t *flags, int64_t required, uint8_t *stale, uint8_t *hot) {
    for (int64_t i = 0; i < n; i++) {
        int64_t num_hot, num_stale, bad = classify_one(ids + i * tables, tables, offsets, flags, required, &num_hot, &num_stale);
        if (bad >= 0) return i * tables + bad;
        stale[i] = num_stale >= required;
        hot[i] = num_hot >= required;
    }
    return -1;
}

/* Must match detector._uniform: splitmix64 of (seed mix + position of the input in the run), top 53 bits. */
static inline double uniform_at(uint64_t seed_mix, uint64_t position) {
    uint64_t z = position + seed_mix + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

/* The skip filter in one pass: an input with >= required stale lookups is skipped (keep 0) when skipping,
   unless drawn as a control (uniform_at(seed_mix, start + i) < control_share: kept, control 1).
   counts: hot inputs, would-be-skipped inputs, controls. Returns -1 or the index of the first bad id. */
int64_t filter_inputs(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                      const uint8_t *flags, int64_t required, int64_t skipping, double control_share,
                      uint64_t seed_mix, uint64_t start, uint8_t *keep, uint8_t *control, int64_t *counts) {
    int64_t hot = 0, would_skip = 0, controls = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t num_hot, num_stale, bad = classify_one(ids + i * tables, tables, offsets, flags, required, &num_hot, &num_stale);
        if (bad >= 0) return i * tables + bad;
        hot += num_hot >= required;
        int skip = skipping && num_stale >= required;
        int is_control = skip && control_share > 0.0 && uniform_at(seed_mix, start + (uint64_t)i) < control_share;
        would_skip += skip;
        controls += is_control;
        keep[i] = !skip || is_control;
        control[i] = is_control;
    }
    counts[0] = hot; counts[1] = would_skip; counts[2] = controls;
    return -1;
}

/* Update counting of the convergence rule: for every lookup of a hot row (flag != 0), counts[position]++,
   the position found in the open-addressing hash of the hot rows (HotIndex: Fibonacci hash, linear probing,
   keys -1 = empty). Ids are trained ones, validated by the filter already. Returns the lookups counted. */
int64_t count_hot_updates(const int32_t *ids, int64_t n, int64_t tables, const int64_t *offsets,
                          const uint8_t *flags, const int64_t *keys, const int32_t *values, int64_t bits,
                          int64_t *counts) {
    uint64_t mask = ((uint64_t)1 << bits) - 1, shift = 64 - (uint64_t)bits;
    int64_t counted = 0;
    for (int64_t i = 0; i < n * tables; i++) {
        int64_t row = offsets[i % tables] + ids[i];
        if (!flags[row]) continue;
        uint64_t slot = ((uint64_t)row * 0x9E3779B97F4A7C15ULL) >> shift;
        while (keys[slot] != row && keys[slot] != -1) slot = (slot + 1) & mask;
        if (keys[slot] == row) { counts[values[slot]]++; counted++; }
    }
    return counted;
}

typedef struct {
    float *weights; int64_t dim; const int64_t *slots; const float *grad; int64_t n; float lr;
    int64_t part, parts;
} sgd_args;

static void *sgd_part(void *p) {
    sgd_args *a = (sgd_args *)p;
    for (int64_t i = 0; i < a->n; i++) {
        int64_t s = a->slots[i];
        if (a->parts > 1 && s % a->parts != a->part) continue;
        float *w = a->weights + s * a->dim;
        const float *g = a->grad + i * a->dim;
        for (int64_t d = 0; d < a->dim; d++) w[d] -= a->lr * g[d];
    }
    return 0;
}

/* weights[slots[i]] -= lr * grad[i] in batch order per slot. Returns -1, or the index of the first slot
   outside [0, num_slots) (then nothing is written). */
int64_t sgd_update(float *weights, int64_t num_slots, int64_t dim, const int64_t *slots, const float *grad,
                   int64_t n, float lr, int64_t threads) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) return i;
    }
    sgd_args args[MAX_THREADS];
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int64_t t = 0; t < threads; t++) args[t] = (sgd_args){weights, dim, slots, grad, n, lr, t, threads};
    run_parts(sgd_part, args, sizeof(sgd_args), threads);
    return -1;
}
"""

_library: ctypes.CDLL | None = None
_tried = False


_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
BUILD_TIMEOUT_S = 120.0  # a compiler that hangs must not hang training: the torch path runs instead


class UnsafeCacheError(OSError):
    """A cache path that another user could have written: never load from it."""


class NoCompilerError(OSError):
    """No C compiler: the documented torch-only setup, not worth a warning."""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cache_key(compiler: str, flags: tuple[str, ...] = _FLAGS) -> str:
    """Source, compiler (its resolved path and version), flags and CPU architecture: any change rebuilds."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = (_SOURCE, os.path.realpath(compiler), version, " ".join(flags), platform.machine(), sys.platform)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _check_private(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise UnsafeCacheError(f"{path} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise UnsafeCacheError(f"{path} is writable by its group or by everyone (mode {st.st_mode & 0o777:o})")


def private_directory(path: Path) -> Path:
    """`path` created with mode 0700, or checked: a real directory of ours that no one else can write."""
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    root_st = os.stat(root)
    sticky = bool(root_st.st_mode & stat.S_ISVTX)
    if root_st.st_mode & 0o002 and not sticky:  # anyone could swap our directory for theirs
        raise UnsafeCacheError(f"{root} is writable by everyone")
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{path} is not a directory (a link or a file)")
    _check_private(path, st)
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours and not writable by others: make it private as well
    return path


def _build(compiler: str, target: Path) -> None:
    """Compile into a private temporary directory beside `target`, then rename: never half-written."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "native.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        try:
            result = subprocess.run(
                [compiler, *_FLAGS, "-o", str(built), str(source)],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            raise OSError(f"the C compiler took over {BUILD_TIMEOUT_S:g} s") from exc
        if result.returncode != 0:
            raise OSError(f"the C compiler failed: {(result.stderr or '').strip().splitlines()[:1]}")
        os.chmod(built, 0o700)
        os.replace(built, target)


def _open_checked(target: Path) -> ctypes.CDLL:
    """Load `target` once checked to be our own regular file that no one else can write.

    It lies in our 0700 directory, so no one else can swap it between the check and the load.
    """
    st = os.lstat(target)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheError(f"{target} is not a regular file")
    _check_private(target, st)
    return ctypes.CDLL(str(target))


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """The compiled library from `cache_dir`, built there first if needed; OSError says why not.

    A cached file that is not safe to load (not ours, writable by others, a link) or that fails to load
    is removed and built again, once.
    """
    compiler = _compiler()
    if compiler is None:
        raise NoCompilerError("no C compiler found (set CC)")
    directory = private_directory(cache_dir)
    target = directory / f"slipcache_native_{cache_key(compiler)}.so"
    for attempt in range(2):
        if not os.path.lexists(target):
            _build(compiler, target)
        try:
            library = _open_checked(target)
            _declare(library)
            return library
        except (OSError, AttributeError) as exc:  # unsafe, corrupt, or missing a symbol
            if attempt:
                raise OSError(f"{target} does not load after a rebuild: {exc}") from exc
            target.unlink(missing_ok=True)  # our private directory: the file can be replaced
    raise AssertionError("unreachable")


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.lookup.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int32, i64]
    library.lookup.restype = i64
    library.sgd_update.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_float, i64]
    library.sgd_update.restype = i64
    library.classify_inputs.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]
    library.classify_inputs.restype = i64
    library.filter_inputs.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ctypes.c_double, ctypes.c_uint64,
                                      ctypes.c_uint64, ptr, ptr, ptr]
    library.filter_inputs.restype = i64
    library.count_hot_updates.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr]
    library.count_hot_updates.restype = i64


def native() -> ctypes.CDLL | None:
    """The compiled library, or None when disabled or unavailable (then a warning says why, once)."""
    global _library, _tried
    if not _tried:
        _tried = True
        if os.environ.get("SLIPCACHE_NATIVE", "1") != "0":
            from slipcache.data.synthetic import default_cache_root

            try:
                _library = load_library(default_cache_root() / "native")
            except NoCompilerError:
                _library = None
            except OSError as exc:
                _library = None
                warnings.warn(f"slipcache: compiled loops unavailable, using torch: {exc}", stacklevel=2)
    return _library


# Below this many lookups a loop runs on the calling thread: starting threads costs more than it saves.
PARALLEL_MIN = 16_384


def threads_for(n: int, threads: int | None = None) -> int:
    """Threads for a loop over `n` lookups: `threads` if given, else torch's count for large loops."""
    if threads is not None:
        return max(1, threads)
    return torch.get_num_threads() if n >= PARALLEL_MIN else 1


def usable(*tensors: Tensor) -> bool:
    return native() is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _check(name: str, tensor: Tensor | None, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...]) -> None:
    """The C loops trust their pointers: refuse anything but a contiguous CPU tensor of the expected layout."""
    if tensor is None:
        return
    if (
        tensor.device.type != "cpu"
        or tensor.dtype not in dtypes
        or not tensor.is_contiguous()
        or tensor.dim() != len(shape)
        or any(want is not None and have != want for have, want in zip(tensor.shape, shape, strict=True))
    ):
        want_shape = tuple("*" if s is None else s for s in shape)
        raise ValueError(
            f"compiled loop: {name} must be a contiguous CPU tensor of dtype {'/'.join(map(str, dtypes))} "
            f"and shape {want_shape}; got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )


def lookup(
    slot_rows: Tensor,
    num_sets: int,
    ways: int,
    multiplier: int,
    rows: Tensor,
    last_used: Tensor | None,
    use_count: Tensor | None,
    step: int,
    threads: int | None = None,
) -> Tensor:
    """Slot per row (-1 on a miss); hits get last_used = step and use_count += 1 when given."""
    library = native()
    assert library is not None
    rows = rows.contiguous()
    _check("slot_rows", slot_rows, (torch.int32, torch.int64), (num_sets * ways,))
    _check("rows", rows, (torch.int64,), (None,))
    _check("last_used", last_used, (torch.int32,), (num_sets * ways,))
    _check("use_count", use_count, (torch.int32,), (num_sets * ways,))
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
        threads_for(rows.numel(), threads),
    )
    return slots


def sgd_update(weights: Tensor, slots: Tensor, grad: Tensor, lr: float, threads: int | None = None) -> None:
    """weights[slots[i]] -= lr * grad[i], for repeated slots too (in batch order, on any thread count)."""
    library = native()
    assert library is not None
    slots, grad = slots.contiguous(), grad.contiguous().float()  # a read-only input may be converted
    _check("weights", weights, (torch.float32,), (None, None))
    _check("slots", slots, (torch.int64,), (None,))
    _check("grad", grad, (torch.float32,), (slots.numel(), weights.shape[1]))
    bad = library.sgd_update(
        weights.data_ptr(),
        weights.shape[0],
        weights.shape[1],
        slots.data_ptr(),
        grad.data_ptr(),
        slots.numel(),
        lr,
        threads_for(slots.numel(), threads),
    )
    if bad >= 0:
        raise ValueError(f"compiled loop: slot {int(slots[bad])} is outside [0, {weights.shape[0]})")


def classify_inputs(
    ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, required: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(stale, hot) bool[n] for int32 ids [n, T] over per-row flag bytes; None if an id is out of its table.

    The caller checks that the library is there and that ids is a C-contiguous int32 [n, T] array.
    """
    library = native()
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

    Same contract as `classify_inputs` for ids/offsets/flags; the control draw is detector._uniform's.
    """
    library = native()
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
    library = native()
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
