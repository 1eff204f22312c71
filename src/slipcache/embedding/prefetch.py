"""Lookahead and prefetch: the next batches' rows (`set_lookahead`) feed the lookahead eviction policies,
the next batch's missing rows are brought into the cache in the background, and with storage in a mapped
file the farthest batch's missing rows are asked of the disk (`readahead.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch
from torch import Tensor

from slipcache.embedding.accounting import TrafficCounters
from slipcache.embedding.cache import RowCache
from slipcache.embedding.lookahead import Window
from slipcache.embedding.quant import RowStorage, TableRowStorage
from slipcache.embedding.readahead import DiskReadahead
from slipcache.embedding.writeback import RowWriter

if TYPE_CHECKING:
    from slipcache.embedding.inputs import LookupInputs, SparseFeatures
    from slipcache.embedding.plan import StepPlanner


class Prefetcher:
    """The lookahead window of the next training step and the background prefetch it may start.

    Owns the window, the prefetch in flight (on a thread of its own, or a side stream on GPU), its rounding
    generator (draws never interleave with the main thread's by timing) and the count of prefetched rows.
    The collection's methods that read or change the cache or storage are marked `@after_prefetch`, so
    none of them runs while a prefetch is in flight.
    """

    def __init__(
        self,
        inputs: LookupInputs,
        planner: StepPlanner,
        cache: RowCache,
        storage: RowStorage | TableRowStorage,
        counters: TrafficCounters,
        rounding: str,
        seed: int,
    ) -> None:
        self.inputs, self.planner, self.cache, self.storage, self.counters = inputs, planner, cache, storage, counters
        self.rounding, self.seed = rounding, seed
        self.window: Window | None = None  # for the next step only
        self.prefetch_next = False
        self._upcoming_rows: list[tuple[object, Tensor]] = []
        self._prefetching: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._side_stream: Any = None
        self.generator: torch.Generator | None = None  # made on first use, from the seed
        self.prefetched_rows = 0
        self.readahead = DiskReadahead(storage) if DiskReadahead.wanted(storage) else None

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    def set_lookahead(self, upcoming: Sequence[Tensor | SparseFeatures], prefetch: bool = False) -> None:
        """See `CachedEmbeddingBagCollection.set_lookahead`."""
        known = {id(features): rows for features, rows in self._upcoming_rows}
        self._upcoming_rows = [
            (features,
             known[id(features)] if id(features) in known else torch.unique(self.inputs.prepare(features).rows))
            for features in upcoming
        ]
        self.window = Window([rows for _, rows in self._upcoming_rows])
        self.prefetch_next = prefetch

    def set_lookahead_rows(self, upcoming: list[Tensor], prefetch: bool = False) -> None:
        """`set_lookahead` with each upcoming batch given as its sorted unique rows of this collection
        (a shard of a sharded table works out which of a global batch's ids are its own)."""
        self._upcoming_rows = []
        self.window = Window(upcoming)
        self.prefetch_next = prefetch

    def take_window(self) -> tuple[Window | None, bool]:
        """The window for the step about to run and whether to prefetch; a window describes the batches
        after that step only, so it is handed out once."""
        window, self.window = self.window, None
        prefetch, self.prefetch_next = self.prefetch_next, False
        return window, prefetch

    def read_ahead(self, window: Window | None) -> None:
        """Ask the disk for the rows of the window's farthest batch that the cache does not hold (storage in
        a mapped file only); call it while no prefetch runs (it reads the cache)."""
        if self.readahead is None or window is None or not len(window):
            return
        farthest = window.batches[-1]
        self.readahead.start(farthest[self.cache.lookup(farthest) < 0])

    def read_now(self, rows: Tensor) -> None:
        """Storage in a mapped file: ask the disk for all of `rows` at once before they are read one by one
        (evaluation's reads), so the disk serves them in parallel."""
        if self.readahead is not None:
            self.readahead.advise(rows)

    def new_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed + 1)

    def follow(self, device: torch.device) -> None:
        """After a move: the generator is made again, from the seed, on the new device."""
        if self.generator is not None and self.generator.device != device:
            self.generator = None
        self._side_stream = None

    def start(self, window: Window) -> None:
        """Run `_prefetch` for the window's first batch in the background; `join` waits for it.

        Rows every in-flight forward read from storage are left alone: their backward writes them there
        (with the shortcut of the values it read), so they must not be copied into the cache meanwhile.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipcache-prefetch")
        if self.generator is None:
            self.generator = self.new_generator()
        pin_since = self.planner.pin_since()
        args = (window, self.planner.storage_rows_in_flight(), pin_since, self.planner.step)
        if self.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))  # this step's work first

            def on_side_stream() -> tuple[Tensor, int]:
                with torch.cuda.stream(self._side_stream):
                    return self._prefetch(*args)

            self._prefetching = self._executor.submit(on_side_stream)
        else:
            self._prefetching = self._executor.submit(self._prefetch, *args)

    def _prefetch(
        self, window: Window, in_storage: Tensor | None, pin_since: int, step: int
    ) -> tuple[Tensor, int]:
        """Install the missing rows of the window's first batch (run while step `step` computes).

        Touches only what the running steps do not: slots of rows outside every in-flight batch (pinned
        from `pin_since`) and outside the next one, and rows none of them serves from storage. Counts go to
        a tensor of their own and the cache's version is bumped on join, so a backward running meanwhile
        keeps the shortcuts its plan recorded (still valid: none of its rows moved).
        """
        cache, counts = self.cache, torch.zeros_like(self.counters.counts)
        rows = window.batches[0]
        slots = cache.lookup(rows)
        hit = slots >= 0
        cache.last_used[slots[hit]] = step + 1  # the next step's rows stay; its lookup will say so too
        missing = rows[~hit]
        if in_storage is not None:
            missing = missing[~torch.isin(missing, in_storage)]
        assignment = cache.assign(missing, pin_since, window)
        if assignment.victim_slots.numel():
            writer = RowWriter(self.storage, self.counters, self.rounding, self.generator)
            tables = writer.write(assignment.victim_rows, cache.weights, counts, assignment.victim_slots)
            self.counters.count_tables("evictions", tables, counts)
        admitted = assignment.slots >= 0
        rows_in = missing[admitted]
        if rows_in.numel():
            cache.install(
                assignment.slots[admitted],
                rows_in,
                self.storage.read(rows_in, self.device),
                step + 1,
                torch.zeros_like(rows_in),  # LFU: the next step's lookup counts the uses
                quiet=True,  # published on join
            )
            self.counters.count_rows("rows_in", rows_in, counts)
        return counts, int(rows_in.numel())

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (`torch.save(model)`, `copy.deepcopy`) without its thread: a prefetch in flight is
        finished first, so the copy holds its rows; the copy starts its own thread when it prefetches."""
        self.join()
        return {**self.__dict__, "_executor": None, "_side_stream": None, "_prefetching": None}

    def join(self) -> None:
        """Wait for the prefetch in flight, if any, and take in its counts (its errors surface here)."""
        pending, self._prefetching = self._prefetching, None
        if pending is None:
            return
        counts, admitted = pending.result()
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.counters.add(counts)
        self.prefetched_rows += admitted
        self.cache.invalidate()


class _HasPrefetcher(Protocol):
    prefetcher: Prefetcher


_Self = TypeVar("_Self", bound=_HasPrefetcher)
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def after_prefetch(
    method: Callable[Concatenate[_Self, _Params], _Result],
) -> Callable[Concatenate[_Self, _Params], _Result]:
    """Mark a method that reads or changes the cache or storage: it first waits for the prefetch in flight.
    The one rule of the cache's concurrency, kept here instead of by each call site."""

    @functools.wraps(method)
    def settled(self: _Self, *args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        self.prefetcher.join()
        return method(self, *args, **kwargs)

    return settled
