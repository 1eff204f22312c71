"""Host memory for the collection's big tensors (row storage, cache, optimizer state), optionally backed by
transparent huge pages.

A random row lookup in a table of gigabytes misses the TLB almost every time with 4 KiB pages; with 2 MiB
pages the page walk is shorter and the TLB covers 512x more memory. Linux gives such pages to anonymous
memory marked `madvise(MADV_HUGEPAGE)` when `/sys/kernel/mm/transparent_hugepage/enabled` says `madvise`
(or to all memory when it says `always`). With huge pages on, a tensor of at least one huge page is an
anonymous memory map of exactly its bytes (the kernel aligns a map whose length is a multiple of 2 MiB to
2 MiB) marked for huge pages, wrapped as a tensor that unmaps it when the tensor dies. Only the 2 MiB-aligned
interior is marked: the last partial 2 MiB stays in 4 KiB pages, so nothing beyond the tensor's own bytes
becomes resident and the memory accounting (which counts the tensors' bytes) stays exact.

`EmbeddingConfig.huge_pages` = on | off | auto chooses, per collection (auto: tensors of 64 MiB and more, far
beyond what the TLB covers in 4 KiB pages); the commands' `--huge-pages` sets it. Default `off`: on this
machine they made the embedding bench 1.12-1.43x faster (quiet) but training at the MLPerf sizes no faster
(docs/scale.md). Where huge pages are unavailable
(`never`, not Linux, no `madvise`) every mode allocates as torch does, silently.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slipcache.errors import SlipcacheError
from slipcache.units import amount

HUGE_PAGE = 2 << 20
HUGE_PAGE_MODES = ("off", "on", "auto")  # `EmbeddingConfig.huge_pages`, `--huge-pages`
# auto: huge pages only for tensors this large (the TLB covers about 8 MiB in 4 KiB pages), where a random
# row's read misses the TLB; small tables (tests, --quick) are allocated as torch does
AUTO_MIN_BYTES = 64 << 20
MIN_BYTES = HUGE_PAGE  # a smaller tensor cannot hold a huge page
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

def thp_setting(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page setting (always, madvise, never); None where there is none."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


def huge_pages_available() -> bool:
    """Whether memory marked with madvise can get huge pages here."""
    return thp_setting() in ("always", "madvise")


def uses_huge_pages(nbytes: int, device: torch.device, mode: str) -> bool:
    """Whether a host tensor of `nbytes` gets huge pages in `mode` (one of HUGE_PAGE_MODES)."""
    if mode not in HUGE_PAGE_MODES:
        raise SlipcacheError(f"huge pages must be one of {', '.join(HUGE_PAGE_MODES)}, got {mode!r}")
    if mode == "off" or device.type != "cpu" or nbytes < max(MIN_BYTES, 1):
        return False
    if mode == "auto" and nbytes < AUTO_MIN_BYTES:
        return False
    return huge_pages_available()


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, make: Callable,
                 huge_pages: str) -> Tensor:
    """`make(shape, dtype=, device=)`, or a fresh memory map (zero already) on huge pages where the mode says so."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if not uses_huge_pages(nbytes, device, huge_pages):
        return make(shape, dtype=dtype, device=device)
    return huge_page_map(nbytes).view(dtype).view(shape)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               huge_pages: str = "off") -> Tensor:
    """An uninitialized tensor (zeros where it is a fresh memory map), on huge pages where the mode says so."""
    return _host_tensor(shape, dtype, device, torch.empty, huge_pages)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               huge_pages: str = "off") -> Tensor:
    """`torch.zeros`, on huge pages where the mode says so (a fresh map is zero already: no pass)."""
    return _host_tensor(shape, dtype, device, torch.zeros, huge_pages)


class StorageFile:
    """Zeros in an unnamed file in `directory`, mapped shared (`tensor`, uint8): the OS pages them in on use and
    writes them back when it needs the memory, so the rows may be larger than RAM.

    The file's blocks are reserved up front (a full disk is one line now, not a crash mid-run); it is
    unlinked at once, so it goes with the process whatever happens and nothing is left in `directory`.
    The map is advised random (`MADV_RANDOM`): a row read from a page that is not resident reads that page
    alone, where the kernel's read-around for mapped files would read the device's whole readahead window
    (8 MiB on a virtio disk) for one row of 64 bytes. What is read ahead is what `advise_pages` asks for.

    Long runs of bytes go in through `write` (pwrite), not the map: every page first written through a
    shared map is a fault of its own (a 28.9 GB checkpoint read into the file: 6.4 M faults and 58 s of
    system time through the map, 20 faults and 22 s with pwrite; docs/scale.md)."""

    def __init__(self, nbytes: int, directory: str | os.PathLike[str]) -> None:
        self.fd: int | None = None
        if nbytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:  # a file there, or on the way
            raise SlipcacheError(
                f"storage path {directory} is not a directory ({exc.strerror}); give a directory"
            ) from exc
        fd, name = tempfile.mkstemp(prefix="slipcache-storage-", suffix=".bin", dir=directory)
        try:
            os.unlink(name)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    free = shutil.disk_usage(directory).free
                    raise SlipcacheError(
                        f"storage path {directory}: {amount(nbytes)} of rows do not fit the {amount(free)} free there"
                    ) from exc
                os.ftruncate(fd, nbytes)  # a file system without fallocate: blocks taken as rows are written
            region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        weakref.finalize(self, os.close, fd)  # the map outlives the descriptor: it needs none
        if hasattr(mmap, "MADV_RANDOM"):
            region.madvise(mmap.MADV_RANDOM)
        self.tensor = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) holds the bytes, not the file: its descriptor is this process's, owned
        by this object, so the copy writes through its own tensor instead (`holds` is False)."""
        return {**self.__dict__, "fd": None}

    def holds(self, tensor: Tensor) -> bool:
        """Whether `tensor` is (a view of) this file's map: a moved, copied or replaced buffer is not."""
        base = self.tensor.data_ptr()
        return self.fd is not None and base <= tensor.data_ptr() < base + self.tensor.numel()

    def offset_of(self, tensor: Tensor) -> int:
        """The byte of the file where a tensor that this file's map holds starts."""
        return tensor.data_ptr() - self.tensor.data_ptr()

    def write(self, offset: int, data: Tensor | memoryview) -> None:
        """Write bytes (a CPU tensor's, or a buffer's) at byte `offset` of the file (what the map then shows)."""
        if self.fd is None:
            raise SlipcacheError("an empty storage file holds no bytes to write")
        if isinstance(data, Tensor):
            data = data.contiguous().reshape(-1).view(torch.uint8).numpy().data
        view = data.cast("B")
        while view:
            written = os.pwrite(self.fd, view, offset)
            if written == 0:  # no progress: not an error the call reports, but no byte will follow
                raise OSError(errno.EIO, f"pwrite wrote nothing at byte {offset} of a storage file")
            view, offset = view[written:], offset + written


def _libc_madvise() -> Callable[..., int] | None:
    """libc's madvise (by address: a tensor's pages, not a Python map's), None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call


_MADVISE = _libc_madvise()

# MADV_WILLNEED reads at most the device's readahead window per call (8 MiB on a virtio disk, 128 KiB by
# default) and drops the rest of a longer range: a range is asked for in pieces no longer than this.
READ_AHEAD_PIECE = 1 << 20


def _advise_range(start: int, end: int, advice: int) -> None:
    """madvise on the addresses [start, end), start on a page, in pieces of at most READ_AHEAD_PIECE."""
    if _MADVISE is None:  # the callers ask only where there is one
        return
    for address in range(start, end, READ_AHEAD_PIECE):
        _MADVISE(address, min(READ_AHEAD_PIECE, end - address), advice)


def advise_pages(tensor: Tensor, pages: Tensor, advice: int = getattr(mmap, "MADV_WILLNEED", 3)) -> int:
    """`madvise(advice)` on the given pages (sorted, unique page indices from the tensor's first byte) of a
    page-aligned tensor, a run of consecutive pages at a time; returns the runs (0 where madvise is
    unavailable). With MADV_WILLNEED the kernel starts reading the pages that are not resident and returns:
    a thread can ask for thousands of scattered pages and the disk reads them in parallel."""
    if _MADVISE is None or not pages.numel():
        return 0
    base = tensor.data_ptr()
    if base % mmap.PAGESIZE:
        raise ValueError("advise_pages needs a tensor that starts on a page")
    pages = pages.long()
    starts = torch.ones_like(pages, dtype=torch.bool)
    starts[1:] = pages[1:] != pages[:-1] + 1
    first = torch.nonzero(starts).squeeze(1)
    lengths = torch.diff(first, append=torch.tensor([pages.numel()]))
    for page, length in zip(pages[first].tolist(), lengths.tolist(), strict=True):
        _advise_range(base + page * mmap.PAGESIZE, base + (page + length) * mmap.PAGESIZE, advice)
    return int(first.numel())


def read_ahead(tensor: Tensor, start: int, length: int) -> bool:
    """Ask the kernel to start reading bytes [start, start + length) of a tensor's data (`MADV_WILLNEED` on
    the pages holding them), for a reader about to stream through them. A map advised random
    (`StorageFile`) is otherwise read a page per fault, one fault at a time: tens of MB/s where the disk
    streams hundreds. Harmless on anonymous memory; False where madvise is unavailable or nothing is left."""
    nbytes = tensor.numel() * tensor.element_size()
    start, end = max(0, start), min(nbytes, start + length)
    if _MADVISE is None or end <= start:
        return False
    first = (tensor.data_ptr() + start) // mmap.PAGESIZE * mmap.PAGESIZE
    _advise_range(first, tensor.data_ptr() + end, getattr(mmap, "MADV_WILLNEED", 3))
    return True


def huge_page_map(nbytes: int) -> Tensor:
    """`nbytes` zero bytes (uint8) in an anonymous map whose whole 2 MiB pages are marked for huge pages.

    The map is the tensor's buffer: it is unmapped when the tensor (and every view of it) is gone."""
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # a multiple of 2 MiB: the kernel aligns its start to 2 MiB
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, 0, whole)
        if length > whole:  # the last, partial 2 MiB: 4 KiB pages, so only the tensor's bytes become resident
            region.madvise(mmap.MADV_NOHUGEPAGE, whole, length - whole)
    except OSError:  # THP switched off since it was read, or madvise refused: plain pages, same bytes
        pass
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
