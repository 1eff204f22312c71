"""Reading rows ahead from storage in a mapped file (`--storage-path`), so that a step does not wait on the disk.

The storage map is advised random (`hostmem.StorageFile`): the kernel reads only the page a miss touches.
A miss that faults still waits for the disk, one page at a time. The training loop knows the batches ahead
(`set_lookahead`), so the rows of the farthest one that the cache does not hold are asked for here, each
step, with `madvise(MADV_WILLNEED)` on their pages: the kernel queues every read at once and returns, and
the disk serves them in parallel while the steps in between compute. By the time that batch runs, its
rows are in the page cache and a miss costs a minor fault. Rows the cache takes in meanwhile were read for
nothing (at most a page each); rows it evicts meanwhile are read from the disk when their batch runs.

The madvise calls run on a thread of their own (one call per run of consecutive pages: thousands a step
at the MLPerf sizes); a request still queued when the next comes is dropped, as the disk is then behind.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from slipcache.embedding.hostmem import advise_pages
from slipcache.embedding.quant import RowStorage, TableRowStorage


def row_pages(rows: Tensor, row_bytes: int, page: int = mmap.PAGESIZE) -> Tensor:
    """Sorted unique pages (from the first byte) holding `rows` of `row_bytes` each: one or two a row."""
    rows = rows.long()
    first = rows * row_bytes // page
    last = ((rows + 1) * row_bytes - 1) // page
    return torch.unique(torch.cat((first, last)))


class DiskReadahead:
    """Asks the kernel for the pages of rows a few steps before they are read; see the module docstring."""

    def __init__(self, storage: RowStorage | TableRowStorage) -> None:
        self.storage = storage
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.requested_pages = 0  # pages asked for so far (resident ones included: the kernel skips them)
        self.dropped = 0  # requests dropped because the previous one was still running

    @staticmethod
    def wanted(storage: RowStorage | TableRowStorage) -> bool:
        """Whether some of the storage lives in a mapped file: the only storage that reads from a disk."""
        parts = storage.parts.values() if isinstance(storage, TableRowStorage) else (storage,)
        return any(getattr(part, "in_file", False) for part in parts)

    def start(self, rows: Tensor) -> bool:
        """Ask for the pages of global `rows` in the background; False when the previous request was still
        running (this one is dropped)."""
        if self._pending is not None and not self._pending.done():
            self.dropped += 1
            return False
        if self._pending is not None:
            self._pending.result()  # its errors surface here
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipcache-readahead")
        self._pending = self._executor.submit(self.advise, rows.cpu())
        return True

    def advise(self, rows: Tensor) -> int:
        """MADV_WILLNEED on the payload pages of global `rows` (in the calling thread); returns the pages."""
        storage = self.storage
        if isinstance(storage, TableRowStorage):
            part_of, local = storage._locate(rows)
            parts = [(part, local[part_of == i]) for i, part in enumerate(storage.parts.values())]
        else:
            parts = [(storage, rows)]
        asked = 0
        for part, mine in parts:
            if not getattr(part, "in_file", False) or not mine.numel():
                continue
            payload = part.payload
            pages = row_pages(mine, payload[0].numel() * payload.element_size())
            advise_pages(payload, pages)
            asked += int(pages.numel())
        self.requested_pages += asked
        return asked

    def join(self) -> None:
        """Wait for the request in flight, if any (its errors surface here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its thread (a copy starts its own)."""
        self.join()
        return {**self.__dict__, "_executor": None, "_pending": None}
