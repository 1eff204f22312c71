"""The step plan of `CachedEmbeddingBagCollection`: a training forward looks its rows up in the cache, evicts
and fills what it misses (or reads storage when nothing fits), and records where every lookup lived
(`_StepPlan`) for its backward; `_FusedLookup` is the autograd node that gathers, pools and hands the
gradient to the fused optimizer.

`StepPlanner` is a part of the collection (it reads its cache, storage, counters and versions).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from slipcache import _native
from slipcache.embedding.accounting import COUNTERS
from slipcache.errors import SlipcacheError

if TYPE_CHECKING:
    from slipcache.embedding.collection import CachedEmbeddingBagCollection
    from slipcache.embedding.inputs import _Lookup

# Counter columns the fused forward adds to in its compiled pass.
_FUSED_COLUMNS = (COUNTERS.index("lookups"), COUNTERS.index("hits"), COUNTERS.index("misses"))


# A forward's cache rows stay pinned until its backward, until its graph is freed, or until this many
# later training forwards have run (then its rows may be evicted; its update still lands correctly).
PIN_STEPS = 8


@dataclass
class _StepPlan:
    """Where each lookup of a training forward lived, kept until its gradient arrives.

    The slots and the storage copy are only a shortcut: when the cache's residency or the storage changed
    since the forward (another forward, `release_rows`, `flush`), the backward locates the rows again, so an
    update always lands on the row's current value wherever the row now lives.
    """

    step: int
    rows: Tensor  # [L] global rows
    slots: Tensor  # [L] cache slot per lookup, -1 when served from storage
    storage_rows: Tensor  # [m] unique rows served from storage
    storage_index: Tensor  # index into storage_rows of each lookup with slot -1, in lookup order
    storage_values: Tensor  # [m, D] fp32 copy of those rows as read in the forward
    residency_version: int  # the collection's versions when the plan was made
    storage_version: int
    gathered: Tensor | None = None  # [L, D] values the fused forward already gathered (taken by the forward)


class _FusedLookup(torch.autograd.Function):
    """Pooled embeddings forward; the optimizer update at the end of the backward pass (no dense gradient).

    Every forward's gradient is collected as its backward node runs; the update is applied once, after the
    whole backward pass, on the gradient summed per row: a table read by several features (or called
    several times) within one step takes one optimizer step, as `nn.EmbeddingBag` + a torch optimizer does.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, coll: CachedEmbeddingBagCollection, lookup: _Lookup, plan: _StepPlan
    ) -> Tensor:
        ctx.coll, ctx.lookup, ctx.plan = coll, lookup, plan
        coll.clock.mark()
        values, plan.gathered = (plan.gathered if plan.gathered is not None else coll._gather(plan)), None
        pooled = coll._pool(values, lookup)
        coll.clock.lap("forward")
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        coll, lookup, plan = ctx.coll, ctx.lookup, ctx.plan
        if plan is None:
            raise SlipcacheError(
                "a second backward through the same embedding lookup (retain_graph=True): its update was "
                "applied by the first; run the forward again for another update"
            )
        ctx.coll = ctx.lookup = ctx.plan = None
        coll.clock.mark()
        grad = coll._unpool(grad_out, lookup)
        coll.clock.lap("backward")
        coll._receive_gradient(plan, grad)
        return None, None, None, None


class StepPlanner:
    """Cache lookup, eviction and fill of `CachedEmbeddingBagCollection`'s training forward."""

    def _pin_since(self) -> int:
        """Oldest step whose cache rows are still pinned: in-flight forwards within `PIN_STEPS`."""
        oldest = self.step
        for step, ref in list(self._in_flight.items()):
            if ref() is None or step <= self.step - PIN_STEPS:
                del self._in_flight[step]
            else:
                oldest = min(oldest, step)
        return oldest

    def _plan_step(self, lookup: _Lookup) -> _StepPlan:
        """Bring the batch's rows into the cache where they fit; read the rest from storage."""
        self._join_prefetch()
        window, self._window = self._window, None  # a window describes the batches after this one only
        prefetch, self._prefetch_next = self._prefetch_next, False
        self.step += 1
        step, rows, cache, clock = self.step, lookup.rows, self.cache, self.clock
        clock.mark()
        if not cache.capacity:
            return self._plan_uncached(lookup, step)
        # The fused path: one compiled pass probes, touches, counts and copies every hit's row into the
        # forward's output; only the missed positions are filled below. Multi-hot bags pool in torch.
        gathered = fused = None
        if lookup.bag_of_value is None and not cache.partitioned:
            gathered = self._scratch("gathered", (rows.numel(), self.dim), torch.float32)
            slots = self._scratch("slots", (rows.numel(),), torch.int64)
            fused = cache.gather_and_touch(
                rows, len(self.table_sizes), gathered, self.counters, _FUSED_COLUMNS, step, slots
            )
        if fused is not None:
            slots, hits = fused
            any_miss = hits < rows.numel()
            miss = slots < 0 if any_miss else None
        else:
            gathered = None
            slots = cache.lookup_and_touch(rows, step)
            hit = slots >= 0
            self._count("lookups", None, lookup)
            self._count("hits", hit, lookup)
            miss = ~hit
            any_miss = bool(miss.any())
        clock.lap("lookup")
        storage_rows = storage_index = rows.new_empty(0)
        if any_miss:
            positions = torch.nonzero(miss).squeeze(1)  # found once, used for every write below
            missing, miss_inverse, uses = torch.unique(
                rows.index_select(0, positions), return_inverse=True, return_counts=True
            )
            clock.lap("lookup")
            assignment = cache.assign(missing, self._pin_since(), window)
            if assignment.victim_slots.numel():
                victim_tables = self._write_storage(assignment.victim_rows, cache.weights[assignment.victim_slots])
                self._count_tables("evictions", victim_tables)
            clock.lap("evict")
            admitted = assignment.slots >= 0
            if bool(admitted.any()):
                admitted_rows = missing[admitted]
                cache.install(
                    assignment.slots[admitted],
                    admitted_rows,
                    self.storage.read(admitted_rows, self.device),
                    step,
                    uses[admitted],
                )
                self._residency_version += 1
            clock.lap("fill")
            slots.index_copy_(0, positions, assignment.slots[miss_inverse])
            if fused is None:
                self._count("misses", miss, lookup)
            missing_tables = self._tables_of(missing)
            self._count_tables("rows_in", missing_tables)
            if not bool(admitted.all()):
                left_out = ~admitted
                storage_rows = missing[left_out]
                if storage_rows.numel() == missing.numel():
                    storage_index = miss_inverse  # nothing was admitted
                else:
                    position = torch.cumsum(left_out, 0) - 1
                    storage_index = position[miss_inverse][assignment.slots[miss_inverse] < 0]
                self._count_tables("overflow_rows", missing_tables[left_out])
        clock.lap("other")
        storage_values = (
            self.storage.read(storage_rows, self.device)
            if storage_rows.numel()
            else rows.new_empty(0, self.dim, dtype=torch.float32)
        )
        plan = _StepPlan(
            step,
            rows,
            slots,
            storage_rows,
            storage_index,
            storage_values,
            self._residency_version,
            self._storage_version,
        )
        if gathered is not None and miss is not None:
            self._fill_positions(gathered, plan, positions)
        plan.gathered = gathered
        clock.lap("fill")
        self._in_flight[step] = weakref.ref(plan)
        if prefetch and window is not None and len(window):
            self._start_prefetch(window)
        clock.lap("other")
        return plan

    def _plan_uncached(self, lookup: _Lookup, step: int) -> _StepPlan:
        """Without a cache every lookup reads storage, each distinct row once (the general plan's outcome,
        without its cache bookkeeping). When writing rows back does not depend on their order (fp32 storage
        or nearest rounding: no random draws), they are found by hashing instead of sorting."""
        rows, clock = lookup.rows, self.clock
        self._pin_since()  # drops forwards whose graph is gone, as every training forward does
        self._count("lookups", None, lookup)
        self._count("misses", None, lookup)
        order_free = self.config.rounding == "nearest" or all(p == "fp32" for p in self.config.precisions)
        if order_free and _native.usable(rows):
            storage_rows, storage_index = _native.unique_rows(rows)
        else:
            storage_rows, storage_index = torch.unique(rows, return_inverse=True)
        clock.lap("lookup")
        tables = self._tables_of(storage_rows)
        self._count_tables("rows_in", tables)
        self._count_tables("overflow_rows", tables)
        clock.lap("other")
        plan = _StepPlan(
            step,
            rows,
            torch.full_like(rows, -1),
            storage_rows,
            storage_index,
            self.storage.read(storage_rows, self.device),
            self._residency_version,
            self._storage_version,
        )
        clock.lap("fill")
        self._in_flight[step] = weakref.ref(plan)
        return plan

    def _fill_positions(self, values: Tensor, plan: _StepPlan, positions: Tensor) -> None:
        """Write the rows of the lookups at `positions` (those the fused gather missed, or all) into `values`:
        from their cache slot, or from the storage copy when they have none."""
        slots = plan.slots[positions]
        if not plan.storage_rows.numel():
            values[positions] = self.cache.weights[slots]
            return
        cached = slots >= 0
        values[positions[cached]] = self.cache.weights[slots[cached]]
        values[positions[~cached]] = plan.storage_values[plan.storage_index]

    def _gather(self, plan: _StepPlan) -> Tensor:
        if not plan.storage_rows.numel():
            return self.cache.weights.index_select(0, plan.slots)
        if plan.storage_index.numel() == plan.slots.numel():
            return plan.storage_values.index_select(0, plan.storage_index)
        values = torch.empty(plan.slots.numel(), self.dim, device=self.device)
        self._fill_positions(values, plan, torch.arange(plan.slots.numel(), device=self.device))
        return values

