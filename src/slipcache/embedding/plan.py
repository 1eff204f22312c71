"""The step plan of a training forward: the rows are looked up in the cache, what is missed is evicted
for and filled (or read from storage when nothing fits), and where every lookup lived is recorded
(`_StepPlan`) for its backward. `StepPlanner` owns the step count and the pins (forwards whose gradient has
not arrived); `_FusedLookup` is the autograd node that gathers, pools and hands the gradient on.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from slipcache.embedding import kernels
from slipcache.embedding.accounting import COUNTERS, PhaseClock, TrafficCounters
from slipcache.embedding.cache import RowCache
from slipcache.embedding.quant import RowStorage, TableRowStorage
from slipcache.embedding.scratch import Scratch
from slipcache.embedding.writeback import RowWriter
from slipcache.errors import SlipcacheError

if TYPE_CHECKING:
    from slipcache.embedding.inputs import LookupInputs, _Lookup
    from slipcache.embedding.lookahead import Window

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
    residency_version: int  # the cache's and the storage's versions when the plan was made
    storage_version: int
    gathered: Tensor | None = None  # [L, D] values the fused forward already gathered (taken by the forward)
    # (table of each of storage_rows, storage rows per table), where the forward counted them (no cache)
    storage_tables: tuple[Tensor, Tensor] | None = None


class GradientReceiver(Protocol):
    """What a forward's backward hands its gradient to (`update.FusedOptimizer`), with the forward's plan."""

    def receive(self, plan: _StepPlan, grad: Tensor) -> None: ...


class _FusedLookup(torch.autograd.Function):
    """Pooled embeddings forward; the optimizer update at the end of the backward pass (no dense gradient).

    Every forward's gradient is collected as its backward node runs; the update is applied once, after the
    whole backward pass, on the gradient summed per row: a table read by several features (or called
    several times) within one step takes one optimizer step, as `nn.EmbeddingBag` + a torch optimizer does.
    """

    @staticmethod
    def forward(
        ctx: Any,
        anchor: Tensor,
        parts: tuple[LookupInputs, StepPlanner, GradientReceiver],
        lookup: _Lookup,
        plan: _StepPlan,
    ) -> Tensor:
        inputs, planner, _ = parts
        ctx.parts, ctx.lookup, ctx.plan = parts, lookup, plan
        planner.clock.mark()
        values, plan.gathered = (plan.gathered if plan.gathered is not None else planner.gather(plan)), None
        pooled = inputs.pool(values, lookup)
        planner.clock.lap("forward")
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        parts, lookup, plan = ctx.parts, ctx.lookup, ctx.plan
        if plan is None:
            raise SlipcacheError(
                "a second backward through the same embedding lookup (retain_graph=True): its update was "
                "applied by the first; run the forward again for another update"
            )
        ctx.parts = ctx.lookup = ctx.plan = None
        inputs, planner, optimizer = parts
        planner.clock.mark()
        grad = inputs.unpool(grad_out, lookup)
        planner.clock.lap("backward")
        planner.landed(plan)
        optimizer.receive(plan, grad)
        return None, None, None, None


class StepPlanner:
    """Cache lookup, eviction and fill of a training forward, over the given cache, storage and counters.

    Owns the step count and the pins: a forward's plan is in flight from its forward until its gradient
    arrives (`landed`), its graph is freed, or `PIN_STEPS` later forwards have run; the cache rows of
    plans in flight are never chosen as victims.
    """

    def __init__(
        self,
        cache: RowCache,
        storage: RowStorage | TableRowStorage,
        writer: RowWriter,
        counters: TrafficCounters,
        clock: PhaseClock,
        scratch: Scratch,
        dim: int,
        order_free: bool,
    ) -> None:
        """`order_free`: writing rows back does not depend on their order (no random draws)."""
        self.cache, self.storage, self.writer, self.counters = cache, storage, writer, counters
        self.clock, self.scratch, self.dim, self.order_free = clock, scratch, dim, order_free
        self.step = 0
        # Forwards whose gradient has not arrived yet (weak: a graph that is freed unpins its rows).
        self._in_flight: dict[int, weakref.ref[_StepPlan]] = {}

    @property
    def device(self) -> torch.device:
        return self.scratch.device

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (`torch.save(model)`, `copy.deepcopy`) without the forwards in flight: their autograd
        graphs are not pickled either, and weak references cannot be."""
        return {**self.__dict__, "_in_flight": {}}

    def pin_since(self) -> int:
        """Oldest step whose cache rows are still pinned: in-flight forwards within `PIN_STEPS`."""
        oldest = self.step
        for step, ref in list(self._in_flight.items()):
            if ref() is None or step <= self.step - PIN_STEPS:
                del self._in_flight[step]
            else:
                oldest = min(oldest, step)
        return oldest

    def landed(self, plan: _StepPlan) -> None:
        """The plan's gradient arrived: its rows are no longer pinned."""
        self._in_flight.pop(plan.step, None)

    def forget(self) -> None:
        """Drop every plan in flight (their tensors moved away, or the state was replaced)."""
        self._in_flight.clear()

    def storage_rows_in_flight(self) -> Tensor | None:
        """Rows the plans in flight serve from storage (their backward writes them there), or None."""
        live = [ref() for ref in self._in_flight.values()]
        rows = [plan.storage_rows for plan in live if plan is not None and plan.storage_rows.numel()]
        return torch.cat(rows) if rows else None

    def plan(self, lookup: _Lookup, window: Window | None, admit: bool = True) -> _StepPlan:
        """Bring the batch's rows into the cache where they fit (evicting for the policy, with the
        lookahead `window` of the batches after this one); read the rest from storage. `admit` False (a step
        at lr 0): the cache admits and evicts nothing, missed rows are served from storage, so no row is
        rounded back into storage by the step."""
        self.step += 1
        step, rows, cache, clock = self.step, lookup.rows, self.cache, self.clock
        clock.mark()
        if not cache.capacity:
            return self._plan_uncached(lookup, step)
        # The fused path: one compiled pass probes, touches, counts and copies every hit's row into the
        # forward's output; only the missed positions are filled below. Multi-hot bags pool in torch.
        gathered = fused = None
        if lookup.bag_of_value is None and not cache.partitioned:
            gathered = self.scratch.get("gathered", (rows.numel(), self.dim), torch.float32)
            slots = self.scratch.get("slots", (rows.numel(),), torch.int64)
            counts = self.counters.counts
            fused = cache.gather_and_touch(rows, counts.shape[0], gathered, counts, _FUSED_COLUMNS, step, slots)
        if fused is not None:
            slots, hits = fused
            any_miss = hits < rows.numel()
            miss = None  # counted in the compiled pass; `missing_rows` finds the positions
        else:
            gathered = None
            slots = cache.lookup_and_touch(rows, step)
            hit = slots >= 0
            self.counters.count_lookups("lookups", None, lookup)
            self.counters.count_lookups("hits", hit, lookup)
            miss = ~hit
            any_miss = bool(miss.any())
        clock.lap("lookup")
        storage_rows = storage_index = rows.new_empty(0)
        if any_miss:
            # The missed positions and their distinct rows, found once (one compiled pass) and used by the
            # eviction, the fill, the backward's storage rows and the forward's gather below.
            positions, missing, miss_inverse, uses = kernels.missing_rows(rows, slots)
            clock.lap("lookup")
            if admit:
                assignment = cache.assign(missing, self.pin_since(), window)
                assigned = assignment.slots
                if assignment.victim_slots.numel():
                    victim_tables = self.writer.write(
                        assignment.victim_rows, cache.weights, source=assignment.victim_slots
                    )
                    self.counters.count_tables("evictions", victim_tables)
            else:
                self.pin_since()  # drops forwards whose graph is gone, as every training forward does
                assigned = torch.full_like(missing, -1)
            clock.lap("evict")
            admitted = assigned >= 0
            if bool(admitted.any()):
                admitted_rows, admitted_slots = missing[admitted], assigned[admitted]
                # Decoded straight into their slots where the compiled pass can; else read, then copied.
                placed = isinstance(self.storage, RowStorage) and self.storage.read_into(
                    admitted_rows, cache.weights, admitted_slots
                )
                values = None if placed else self.storage.read(admitted_rows, self.device)
                cache.install(admitted_slots, admitted_rows, values, step, uses[admitted])
            clock.lap("fill")
            # The misses' slots, and (fused forward) their rows from the cache into the output, in one pass.
            copied = kernels.fill_misses(positions, miss_inverse, assigned, slots, cache.weights, gathered)
            if miss is not None:
                self.counters.count_lookups("misses", miss, lookup)
            missing_tables = self.counters.tables_of(missing)
            self.counters.count_tables("rows_in", missing_tables)
            if not bool(admitted.all()):
                left_out = ~admitted
                storage_rows = missing[left_out]
                if storage_rows.numel() == missing.numel():
                    storage_index = miss_inverse  # nothing was admitted
                else:
                    position = torch.cumsum(left_out, 0) - 1
                    storage_index = position[miss_inverse][assigned[miss_inverse] < 0]
                self.counters.count_tables("overflow_rows", missing_tables[left_out])
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
            cache.version,
            self.storage.version,
        )
        if gathered is not None and any_miss:
            if not copied:
                self._fill_positions(gathered, plan, positions)
            elif storage_rows.numel():  # the rows that found no slot, from the storage copy
                on_storage = positions[slots.index_select(0, positions) < 0]
                gathered.index_copy_(0, on_storage, storage_values.index_select(0, storage_index))
        plan.gathered = gathered
        clock.lap("fill")
        self._in_flight[step] = weakref.ref(plan)
        return plan

    def _plan_uncached(self, lookup: _Lookup, step: int) -> _StepPlan:
        """Without a cache every lookup reads storage, each distinct row once (the general plan's outcome,
        without its cache bookkeeping). When writing rows back does not depend on their order (fp32 storage
        or nearest rounding: no random draws), they are found by hashing instead of sorting."""
        rows, clock, counters = lookup.rows, self.clock, self.counters
        self.pin_since()  # drops forwards whose graph is gone, as every training forward does
        counters.count_lookups("lookups", None, lookup)
        counters.count_lookups("misses", None, lookup)
        storage_rows, storage_index = kernels.distinct_rows(rows, any_order=self.order_free)
        clock.lap("lookup")
        tables = counters.tables_of(storage_rows)
        per_table = counters.per_table(tables)  # counted once: rows in, overflow rows, and rows out after
        counters.add_per_table(("rows_in", "overflow_rows"), per_table)
        clock.lap("other")
        plan = _StepPlan(
            step,
            rows,
            torch.full_like(rows, -1),
            storage_rows,
            storage_index,
            self.storage.read(storage_rows, self.device),
            self.cache.version,
            self.storage.version,
            storage_tables=(tables, per_table),
        )
        clock.lap("fill")
        self._in_flight[step] = weakref.ref(plan)
        return plan

    def _fill_positions(self, values: Tensor, plan: _StepPlan, positions: Tensor) -> None:
        """Write the rows of the lookups at `positions` (those the fused gather missed, or all) into `values`:
        from their cache slot, or from the storage copy when they have none."""
        slots = plan.slots.index_select(0, positions)
        if not plan.storage_rows.numel():
            values.index_copy_(0, positions, self.cache.weights.index_select(0, slots))
            return
        # Every position from the cache first (slot 0 standing in for the rows it lacks), then the rows served
        # from storage over them, in lookup order: two dense copies instead of masked assignments.
        values.index_copy_(0, positions, self.cache.weights.index_select(0, slots.clamp(min=0)))
        values.index_copy_(0, positions[slots < 0], plan.storage_values.index_select(0, plan.storage_index))

    def gather(self, plan: _StepPlan) -> Tensor:
        """The row of every lookup of `plan`, [L, D]."""
        if not plan.storage_rows.numel():
            return self.cache.weights.index_select(0, plan.slots)
        if plan.storage_index.numel() == plan.slots.numel():
            return plan.storage_values.index_select(0, plan.storage_index)
        values = torch.empty(plan.slots.numel(), self.dim, device=self.device)
        self._fill_positions(values, plan, torch.arange(plan.slots.numel(), device=self.device))
        return values

