"""Building and loading the compiled loops: the C files beside this one compiled with the system's C compiler
on first use into one library in a private per-user cache, loaded with ctypes.

The cache (`$SLIPCACHE_CACHE_DIR/native`, default `~/.cache/slipcache/native`) is a directory of mode 0700;
a directory or library that another user owns or could write is refused (the torch path runs, with a
warning), builds are renamed into place whole, the file name keys the sources (every .c file and the
header they share), compiler, flags and CPU architecture, and a cached library that fails to load is
rebuilt once.
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
import time
from pathlib import Path

# The loops themselves: plain C beside this file, shipped as package data. Each .c file compiles on its own
# against the header they share (`pool.h`: the worker pool's interface and the loops' helpers); one compiler
# run builds them into one library. Read once: what is compiled is what keys the cache.
HEADER = "pool.h"
SOURCES = ("pool.c", "loops.c", "filter.c", "update.c", "quantize.c", "simd.c")
_TEXTS = {name: Path(__file__).with_name(name).read_text() for name in (HEADER, *SOURCES)}

_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
# SLIPCACHE_NATIVE_SANITIZE=1 builds the loops with AddressSanitizer and UndefinedBehaviorSanitizer (a library
# of its own, keyed by the flags): the loops trust their pointers, CI runs the native tests against this build.
# Loading it into Python needs the sanitizer runtime first: LD_PRELOAD="$(cc -print-file-name=libasan.so)".
_SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")


def build_flags() -> tuple[str, ...]:
    """The compiler flags of this process's library (sanitizers on with SLIPCACHE_NATIVE_SANITIZE=1)."""
    return _FLAGS + (_SANITIZE_FLAGS if os.environ.get("SLIPCACHE_NATIVE_SANITIZE") == "1" else ())
# A compiler or C library without ifunc support (target_clones) builds the same source once more without it.
_FALLBACK_FLAGS = ("-DSLIPCACHE_NO_CLONES",)
BUILD_TIMEOUT_S = 120.0  # a compiler that hangs must not hang training: the torch path runs instead


class UnsafeCacheError(OSError):
    """A cache path that another user could have written: never load from it."""


class NoCompilerError(OSError):
    """No C compiler: the documented torch-only setup, not worth a warning."""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cache_key(compiler: str, flags: tuple[str, ...] | None = None) -> str:
    """Source, compiler (its resolved path and version), flags and CPU architecture: any change rebuilds."""
    flags = build_flags() if flags is None else flags
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    sources = [f"{name}\0{text}" for name, text in _TEXTS.items()]
    parts = (*sources, os.path.realpath(compiler), version, " ".join(flags), platform.machine(), sys.platform)
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
        for name, text in _TEXTS.items():
            (Path(tmp) / name).write_text(text)
        sources = [str(Path(tmp) / name) for name in SOURCES]
        built = Path(tmp) / target.name
        for extra in ((), _FALLBACK_FLAGS):
            try:
                result = subprocess.run(
                    [compiler, *build_flags(), *extra, "-o", str(built), *sources],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired as exc:
                raise OSError(f"the C compiler took over {BUILD_TIMEOUT_S:g} s") from exc
            if result.returncode == 0:
                break
        if result.returncode != 0:
            raise OSError(f"the C compiler failed: {(result.stderr or '').strip().splitlines()[:1]}")
        os.chmod(built, 0o700)
        os.replace(built, target)


def _open_checked_stat(target: Path) -> None:
    st = os.lstat(target)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCacheError(f"{target} is not a regular file")
    _check_private(target, st)


def _open_checked(target: Path) -> ctypes.CDLL:
    """Load `target` once checked to be our own regular file that no one else can write.

    It lies in our 0700 directory, so no one else can swap it between the check and the load.
    """
    _open_checked_stat(target)
    return ctypes.CDLL(str(target))


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """The compiled library from `cache_dir`, built there first if needed; OSError says why not.

    A cached file that is not safe to load (not ours, writable by others, a link) or that fails to load
    is removed and built again, once. The rebuild is loaded under a name of its own: a file that loaded but
    lacked our symbols stays loaded in this process, and loading the same path again would return it.
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
            library = _open_checked(target) if not attempt else _open_fresh(target)
            _declare(library)
            return library
        except (OSError, AttributeError) as exc:  # unsafe, corrupt, or missing a symbol
            if attempt:
                raise OSError(f"{target} does not load after a rebuild: {exc}") from exc
            target.unlink(missing_ok=True)  # our private directory: the file can be replaced
    raise AssertionError("unreachable")


def _open_fresh(target: Path) -> ctypes.CDLL:
    """Load `target` through a hard link of a name this process never loaded; the link goes once loaded."""
    _open_checked_stat(target)
    link = target.with_name(f"{target.stem}.{os.getpid()}.{time.monotonic_ns()}.so")
    os.link(target, link)
    try:
        return _open_checked(link)
    finally:
        link.unlink(missing_ok=True)


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.lookup.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int32]
    library.lookup.restype = i64
    library.sgd_update.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_float]
    library.sgd_update.restype = i64
    library.classify_inputs.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr]
    library.classify_inputs.restype = i64
    library.filter_inputs.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ctypes.c_double, ctypes.c_uint64,
                                      ctypes.c_uint64, ptr, ptr, ptr]
    library.filter_inputs.restype = i64
    library.count_hot_updates.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64]
    library.count_hot_updates.restype = i64
    library.global_rows.argtypes = [ptr, i64, i64, ptr, ptr]
    library.global_rows.restype = i64
    library.lookup_gather.argtypes = [
        ptr, ctypes.c_int, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int32, ptr, i64, ptr, ptr,
        i64, i64, i64, i64,
    ]
    library.lookup_gather.restype = i64
    library.unique_rows.argtypes = [ptr, i64, ptr, ptr]
    library.unique_rows.restype = i64
    library.sorted_unique.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr]
    library.sorted_unique.restype = i64
    library.fill_misses.argtypes = [ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ptr]
    library.fill_misses.restype = i64
    library.finite_values.argtypes = [ptr, i64]
    library.finite_values.restype = i64
    library.assign_slots.argtypes = [
        ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ctypes.c_int32, ptr, i64, ptr, ptr, ptr,
    ]
    library.assign_slots.restype = i64
    library.sgd_update_finite.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_float]
    library.sgd_update_finite.restype = i64
    library.sum_rows_finite.argtypes = [ptr, i64, i64, ptr, ptr, i64]
    library.sum_rows_finite.restype = i64
    library.adagrad_update.argtypes = [
        ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int, ctypes.c_float, ctypes.c_float,
    ]
    library.adagrad_update.restype = i64
    f32 = ctypes.c_float
    library.quantize_rows.argtypes = [
        ptr, i64, i64, ctypes.c_int, ptr, ptr, f32, f32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64,
    ]
    library.quantize_rows.restype = i64
    library.dequantize_rows.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64]
    library.dequantize_rows.restype = i64
    library.torch_uniform.argtypes = [ptr, ptr, i64]
    library.torch_uniform.restype = i64
    library.pool_bags.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64]
    library.pool_bags.restype = i64
    library.slipcache_set_threads.argtypes = [i64]
    library.slipcache_set_threads.restype = i64
    library.slipcache_threads.argtypes = []
    library.slipcache_threads.restype = i64
    library.slipcache_pool_workers.argtypes = []
    library.slipcache_pool_workers.restype = i64
    library.slipcache_scratch_bytes.argtypes = []
    library.slipcache_scratch_bytes.restype = i64
    library.slipcache_set_simd.argtypes = [i64]
    library.slipcache_set_simd.restype = i64
    library.slipcache_simd.argtypes = []
    library.slipcache_simd.restype = i64
