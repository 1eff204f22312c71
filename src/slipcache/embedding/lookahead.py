"""Eviction by future use: the rows of the next k batches, and the offline optimum to compare with.

Training data is known ahead of time: the batch iterator can `peek(k)` the batches after the one in
flight. `Window` holds their rows so the cache can evict, among a set's evictable rows, the one whose
next use is farthest (Belady's rule inside the window; LRU or LFU order among rows the window never
mentions). `belady_hits` replays a whole trace with the same rule and the same constraints as the
cache (rows of the batch in flight stay; a missing row takes a slot only from a row used strictly later),
fully associative and with the whole future known: the optimum the policy is measured against. Belady's
rule minimizes the rows fetched (misses counted once per row and batch); per lookup, a row looked up many
times in one batch weighs more, which the rule ignores, so a policy can beat it on that count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

NOT_IN_WINDOW = 0


class Window:
    """Sorted unique global rows of each of the next k batches (index 0 = the next batch)."""

    def __init__(self, batches: list[Tensor]) -> None:
        self.batches = batches
        self._merged: tuple[Tensor, Tensor] | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def _rows_and_distance(self) -> tuple[Tensor, Tensor]:
        """Every row of the window once, sorted, with the distance of its first use (built on first query)."""
        if self._merged is None:
            rows = torch.cat(self.batches)
            distance = torch.cat(
                [torch.full((b.numel(),), j + 1, dtype=torch.int64, device=rows.device)
                 for j, b in enumerate(self.batches)]
            )
            rows, order = torch.sort(rows, stable=True)  # within a row, the nearest batch comes first
            first = torch.ones_like(rows, dtype=torch.bool)
            first[1:] = rows[1:] != rows[:-1]
            self._merged = rows[first], distance[order][first]
        return self._merged

    def next_use(self, rows: Tensor) -> Tensor:
        """int64 distance (1 = next batch) of each row's first use in the window, 0 when it has none."""
        known, distance = self._rows_and_distance()
        if not known.numel():
            return torch.full(rows.shape, NOT_IN_WINDOW, dtype=torch.int64, device=rows.device)
        rows = rows.long()
        position = torch.searchsorted(known, rows).clamp_(max=known.numel() - 1)
        return torch.where(known[position] == rows, distance[position], NOT_IN_WINDOW)


def eviction_key(distance: Tensor, beyond: Tensor, window: int) -> Tensor:
    """Victims first by ascending key: rows the window never uses by `beyond` (last use for LRU, use count
    for LFU), then the window's rows from the farthest next use to the nearest. Every in-window key
    exceeds any int32 `beyond`."""
    in_window = (1 << 32) + (window + 1 - distance)
    return torch.where(distance == NOT_IN_WINDOW, beyond.long(), in_window)


def belady_hits(
    trace: Sequence[Tensor] | Tensor, capacity: int, num_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Hits per batch of `trace` (global rows, one tensor per batch) on a fully associative cache of
    `capacity` rows run by Belady's rule with the whole future known: int64 [batches] twice, lookups and
    distinct rows (each once per batch). The cache's constraints hold: the rows of the batch in flight are
    never evicted, and a missing row is admitted only in place of a row whose next use is strictly later
    (else it is served from storage, as an overflow row is).

    Why not simply keep the `capacity` rows with the nearest next use after each batch: a row of the batch
    in flight cannot give its slot to a missing row of the same batch, so that bound is not reachable.
    """
    never = np.iinfo(np.int64).max
    per_batch = [torch.unique(batch, return_counts=True) for batch in trace]
    rows = np.concatenate([r.numpy() for r, _ in per_batch]).astype(np.int64)
    counts = np.concatenate([c.numpy() for _, c in per_batch])
    sizes = [r.numel() for r, _ in per_batch]
    when = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    # Next use (batch index) of every (batch, row) pair: group the pairs by row, in batch order.
    order = np.lexsort((when, rows))
    following = np.full(rows.size, never, dtype=np.int64)
    same_row = rows[order][1:] == rows[order][:-1]
    following[order[:-1][same_row]] = when[order][1:][same_row]
    starts = np.concatenate([[0], np.cumsum(sizes)])

    num_rows = int(rows.max()) + 1 if num_rows is None else num_rows
    next_of = np.full(num_rows, -1, dtype=np.int64)  # next use of each resident row, -1 when absent
    resident = np.empty(0, dtype=np.int64)
    hits = np.zeros(len(sizes), dtype=np.int64)
    row_hits = np.zeros(len(sizes), dtype=np.int64)
    for b in range(len(sizes)):
        batch, upcoming = rows[starts[b] : starts[b + 1]], following[starts[b] : starts[b + 1]]
        hit = next_of[batch] >= 0
        hits[b] = counts[starts[b] : starts[b + 1]][hit].sum()
        row_hits[b] = hit.sum()
        next_of[batch[hit]] = upcoming[hit]
        missing = np.argsort(upcoming[~hit], kind="stable")  # nearest next use first
        missing_rows, missing_next = batch[~hit][missing], upcoming[~hit][missing]
        free = min(capacity - resident.size, missing_rows.size)
        # The rest pair with evictable rows, farthest next use first, while the victim's is strictly later.
        evictable = resident[~np.isin(resident, batch[hit], assume_unique=True)]
        want = min(missing_rows.size - free, evictable.size)
        if want > 0:
            victims = evictable[np.argsort(-next_of[evictable], kind="stable")[:want]]
            worth = next_of[victims] > missing_next[free : free + want]
            taken = want if bool(worth.all()) else int(np.argmin(worth))
            victims = victims[:taken]
            next_of[victims] = -1
            resident = resident[next_of[resident] >= 0]
            admitted = free + taken
        else:
            admitted = free
        next_of[missing_rows[:admitted]] = missing_next[:admitted]
        resident = np.concatenate([resident, missing_rows[:admitted]])
    return hits, row_hits
