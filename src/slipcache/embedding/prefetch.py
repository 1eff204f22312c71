"""Prefetch of `CachedEmbeddingBagCollection`: the next batches' rows (`set_lookahead`) feed the lookahead
eviction policies, and the next batch's missing rows are brought into the cache in the background.

`Prefetcher` is a part of the collection (it reads its cache, storage, counters and in-flight plans).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from slipcache.embedding.lookahead import Window

if TYPE_CHECKING:
    from slipcache.embedding.inputs import SparseFeatures


class Prefetcher:
    """Lookahead windows and the background prefetch of `CachedEmbeddingBagCollection`."""

    def set_lookahead(self, upcoming: list[Tensor | SparseFeatures], prefetch: bool = False) -> None:
        """The ids of the batches after the next training step's (e.g. `BatchIterator.peek(k)`), for that
        step only: the lookahead policies evict by their use, and with `prefetch` the first one's missing
        rows are brought into the cache in the background while that step computes (a thread on CPU, a
        side stream on GPU), never in place of a row of a batch in flight or of the next one.

        Why per step: a window left over from an earlier step would be off by one batch.
        """
        known = {id(features): rows for features, rows in self._upcoming_rows}
        self._upcoming_rows = [
            (features, known[id(features)] if id(features) in known else torch.unique(self._prepare(features).rows))
            for features in upcoming
        ]
        self._window = Window([rows for _, rows in self._upcoming_rows])
        self._prefetch_next = prefetch

    def _start_prefetch(self, window: Window) -> None:
        """Run `_prefetch` for the window's first batch in the background; `_join_prefetch` waits for it.

        Rows every in-flight forward read from storage are left alone: their backward writes them there
        (with the shortcut of the values it read), so they must not be copied into the cache meanwhile.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipcache-prefetch")
        if self._prefetch_generator is None:
            self._prefetch_generator = self._new_prefetch_generator()
        pin_since = self._pin_since()
        live = [ref() for ref in self._in_flight.values()]
        in_storage = [plan.storage_rows for plan in live if plan is not None and plan.storage_rows.numel()]
        args = (window, torch.cat(in_storage) if in_storage else None, pin_since, self.step)
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
        a tensor of their own and the residency and storage versions are bumped on join, so a backward
        running meanwhile keeps the shortcuts its plan recorded (still valid: none of its rows moved).
        """
        cache, counts = self.cache, torch.zeros_like(self.counters)
        rows = window.batches[0]
        slots = cache.lookup(rows)
        hit = slots >= 0
        cache.last_used[slots[hit]] = step + 1  # the next step's rows stay; its lookup will say so too
        missing = rows[~hit]
        if in_storage is not None:
            missing = missing[~torch.isin(missing, in_storage)]
        assignment = cache.assign(missing, pin_since, window)
        if assignment.victim_slots.numel():
            victims = assignment.victim_rows
            fitted = self.storage.write(
                victims, cache.weights[assignment.victim_slots], self.config.rounding, self._prefetch_generator
            )
            tables = self._tables_of(victims)
            self._count_tables("evictions", tables, counts)
            self._count_tables("rows_out", tables, counts)
            self._count_fitted(tables, fitted, counts)
        admitted = assignment.slots >= 0
        rows_in = missing[admitted]
        if rows_in.numel():
            cache.install(
                assignment.slots[admitted],
                rows_in,
                self.storage.read(rows_in, self.device),
                step + 1,
                torch.zeros_like(rows_in),  # LFU: the next step's lookup counts the uses
            )
            self._count_rows("rows_in", rows_in, counts)
        return counts, int(rows_in.numel())

    def _join_prefetch(self) -> None:
        """Wait for the prefetch in flight, if any, and take in its counts (its errors surface here)."""
        pending, self._prefetching = self._prefetching, None
        if pending is None:
            return
        counts, admitted = pending.result()
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.counters += counts
        self.prefetched_rows += admitted
        self._residency_version += 1
        self._storage_version += 1

    def _new_prefetch_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.config.seed + 1)

