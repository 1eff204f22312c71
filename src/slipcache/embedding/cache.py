"""The full-precision row cache: set-associative, with LRU, LFU or lookahead replacement.

A row may live only in the `ways` slots of its set (a hash of the global row id). Set-associativity keeps
the bookkeeping per slot (the resident row, a last-use step, a use count), never per row: a row->slot map
over all rows would cost 4 bytes for every row, as much as the quantized row itself at int4, dim 8.

`lookahead` evicts by future use: given the rows of the next k batches (`lookahead.Window`), the victim is
the evictable row whose next use is farthest, rows the window never uses going first (least recently used
first, or least frequently used first with `lookahead-lfu`); rows of the next batch are never evicted, and
a missing row whose next use is later than every victim's is not admitted (it is served from storage for
this step). Without a window they are LRU and LFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from slipcache import _native
from slipcache.embedding.hostmem import host_empty, host_zeros
from slipcache.embedding.lookahead import Window, eviction_key

POLICIES = ("lru", "lfu", "lookahead", "lookahead-lfu", "none")
LOOKAHEAD_POLICIES = ("lookahead", "lookahead-lfu")
_COUNTING_POLICIES = ("lfu", "lookahead-lfu")  # keep a use count per slot
EMPTY = -1
_HASH_MULTIPLIER = 0x2C1B3C6D  # odd: consecutive rows land in distinct sets


@dataclass
class Assignment:
    """Where the missing rows of one batch go."""

    slots: Tensor  # slot of each missing row, -1 where it did not fit (updated in storage precision)
    victim_slots: Tensor  # slots whose resident row must be written back first
    victim_rows: Tensor


class RowCache(nn.Module):
    """fp32 rows in `num_sets * ways` slots, with per-slot bookkeeping.

    Rows used by a batch in flight are pinned: their last-use step is at least `pin_since`, and they
    are never chosen as victims.

    `version` is the one record of residency: it changes whenever a row enters or leaves the cache
    (`install`, `evict`, a loaded state, a device move), so a step plan that located its rows at one
    version knows its slots still hold them while the version is the same.
    """

    # buffers (register_buffer), declared for the type checker
    weights: Tensor
    slot_rows: Tensor
    last_used: Tensor
    use_count: Tensor  # the counting policies only
    _way_index: Tensor
    _part_rows: Tensor
    _part_sets: Tensor
    _part_identity: Tensor

    def __init__(
        self,
        capacity: int | list[int],
        dim: int,
        policy: str,
        num_rows: int | list[int],
        ways: int = 16,
        lfu_halving_interval: int = 1000,
        device: torch.device | str = "cpu",
        huge_pages: str = "off",
    ) -> None:
        """One cache over `num_rows` rows, or, with lists, one part of `capacity[p]` slots per consecutive
        range of `num_rows[p]` rows (a per-table cache: a table's rows only compete among themselves).
        `huge_pages`: as `EmbeddingConfig.huge_pages`."""
        super().__init__()
        self.version = 0
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.partitioned = isinstance(capacity, list)
        capacities = list(capacity) if isinstance(capacity, list) else [capacity]
        part_rows = list(num_rows) if isinstance(num_rows, list) else [num_rows]
        if policy == "none":
            capacities = [0] * len(capacities)
        self.policy = policy
        self.ways = max(1, min(ways, max(capacities))) if any(capacities) else 1
        self.lfu_halving_interval = lfu_halving_interval
        # A cache (part) that can hold every row places row r in set r // ways: no two rows ever compete for
        # a set, so every row becomes resident (a hash would leave some sets over-full and some rows out).
        identity = [cap > 0 and cap >= rows for cap, rows in zip(capacities, part_rows, strict=True)]
        sets = [
            -(-(rows if full else cap) // self.ways) if cap else 0
            for cap, rows, full in zip(capacities, part_rows, identity, strict=True)
        ]
        self.num_sets = sum(sets)
        self.holds_every_row = all(identity)
        self.multiplier = 0 if self.holds_every_row else _HASH_MULTIPLIER
        slots = self.num_sets * self.ways
        self.total_rows = sum(part_rows)
        row_dtype = torch.int32 if sum(part_rows) < 2**31 - 1 else torch.int64
        device = torch.device(device)
        self.register_buffer("weights", host_zeros((slots, dim), torch.float32, device, huge_pages))
        self.register_buffer("slot_rows", host_empty((slots,), row_dtype, device, huge_pages).fill_(EMPTY))
        self.register_buffer("last_used", host_zeros((slots,), torch.int32, device, huge_pages))
        if policy in _COUNTING_POLICIES:
            self.register_buffer("use_count", host_zeros((slots,), torch.int32, device, huge_pages))
        self.register_buffer("_way_index", torch.arange(self.ways, device=device), persistent=False)
        if self.partitioned:
            cumulative = [0]
            for count in part_rows:
                cumulative.append(cumulative[-1] + count)
            set_start = [0]
            for count in sets:
                set_start.append(set_start[-1] + count)
            for name, values in (("_part_rows", cumulative), ("_part_sets", set_start), ("_part_identity", identity)):
                self.register_buffer(name, torch.tensor(values, device=device), persistent=False)
            self.part_slots = [count * self.ways for count in sets]  # slots of each part, for memory reports

    @property
    def capacity(self) -> int:
        return self.num_sets * self.ways

    def set_of(self, rows: Tensor) -> Tensor:
        """The set of each row; -1 for a row whose part of the cache has no slots."""
        if self.partitioned:
            return self._partitioned_set_of(rows)
        if self.holds_every_row:
            return rows // self.ways
        mixed = (rows ^ (rows >> 17)) * _HASH_MULTIPLIER
        return (mixed >> 5).remainder(self.num_sets)

    def _partitioned_set_of(self, rows: Tensor) -> Tensor:
        part = torch.searchsorted(self._part_rows, rows, right=True) - 1
        first, count = self._part_sets[part], self._part_sets[part + 1] - self._part_sets[part]
        mixed = (rows ^ (rows >> 17)) * _HASH_MULTIPLIER
        hashed = (mixed >> 5).remainder(count.clamp_min(1))
        direct = (rows - self._part_rows[part]) // self.ways
        sets = first + torch.where(self._part_identity[part], direct, hashed)
        return sets.masked_fill_(count == 0, EMPTY)

    def lookup(self, rows: Tensor) -> Tensor:
        """Slot of each row, -1 where the row is not cached."""
        if not self.capacity:
            return torch.full_like(rows, EMPTY)
        rows = rows.to(self.slot_rows.device)
        sets = self.set_of(rows)
        residents = self.slot_rows.view(self.num_sets, self.ways).index_select(0, sets.clamp_min(0))
        found, way = (residents == rows[:, None].to(self.slot_rows.dtype)).to(torch.uint8).max(dim=1)
        slots = sets * self.ways + way
        return slots.masked_fill_((found == 0) | (sets < 0), EMPTY)

    def lookup_and_touch(self, rows: Tensor, step: int) -> Tensor:
        """`lookup`, recording a use at `step` of every hit (repeats count once more each for LFU)."""
        if not self.capacity:
            return torch.full_like(rows, EMPTY)
        use_count = self.use_count if self.policy in _COUNTING_POLICIES else None
        if self._compiled(rows):
            slots = _native.lookup(
                self.slot_rows,
                self.num_sets,
                self.ways,
                self.multiplier,
                rows,
                self.last_used,
                use_count,
                step,
            )
        else:
            slots = self.lookup(rows)
            hits = slots[slots >= 0]
            self.last_used[hits] = step
            if use_count is not None:
                use_count.index_add_(0, hits, torch.ones_like(hits, dtype=torch.int32))
        self._age(step)
        return slots

    def gather_and_touch(
        self,
        rows: Tensor,
        tables: int,
        out: Tensor,
        counters: Tensor,
        columns: tuple[int, int, int],
        step: int,
        slots: Tensor | None = None,
    ) -> tuple[Tensor, int] | None:
        """`lookup_and_touch` of single-hot lookups [B * T] in one compiled pass that also copies each hit's
        row into `out` and adds per-table lookups, hits and misses to `counters` at `columns`; returns
        (slots, hits) (the slots written into `slots` when given), or None when the compiled loop cannot serve
        this cache (then nothing was done)."""
        if not self.capacity or not self._compiled(self.weights, rows, out, counters):
            return None
        use_count = self.use_count if self.policy in _COUNTING_POLICIES else None
        found = _native.lookup_gather(
            self.slot_rows,
            self.num_sets,
            self.ways,
            self.multiplier,
            rows,
            tables,
            self.last_used,
            use_count,
            step,
            self.weights,
            out,
            counters,
            columns,
            slots=slots,
        )
        self._age(step)
        return found

    def _compiled(self, *tensors: Tensor) -> bool:
        """Whether the compiled loops serve this cache with these tensors: the one choice of its lookups,
        fused gather and slot assignment (the torch code is the reference). They know one hash, not the
        partitioned sets, and take contiguous CPU tensors."""
        return not self.partitioned and _native.usable(self.slot_rows, *tensors)

    def _age(self, step: int) -> None:
        if self.policy in _COUNTING_POLICIES and self.lfu_halving_interval and step % self.lfu_halving_interval == 0:
            self.use_count >>= 1  # aging: old popularity fades

    def assign(self, rows: Tensor, pin_since: int, window: Window | None = None) -> Assignment:
        """Choose slots for unique missing `rows`: empty slots first, then the policy's victims.

        Missing rows of one set are ranked and take that set's evictable ways in victim order; those
        beyond the evictable count get -1. With the lookahead policy and a window, the rows used soonest
        rank first and a row is admitted only in place of a victim it will be used before.
        """
        empty = rows.new_empty(0)
        if not self.capacity or not rows.numel():
            return Assignment(torch.full_like(rows, EMPTY), empty, empty)
        lookahead = self.policy in LOOKAHEAD_POLICIES and window is not None and len(window)
        if not lookahead and self._compiled(rows):
            use_count = self.use_count if self.policy in _COUNTING_POLICIES else None
            slots, victim_slots, victim_rows = _native.assign_slots(
                self.slot_rows, self.num_sets, self.ways, self.multiplier, self.last_used, use_count, pin_since, rows
            )
            return Assignment(slots, victim_slots, victim_rows)
        sets = self.set_of(rows)
        cacheable = sets >= 0
        if not bool(cacheable.all()):  # rows of a part without slots stay out
            inner = self.assign(rows[cacheable], pin_since)
            slots = torch.full_like(rows, EMPTY)
            slots[cacheable] = inner.slots
            return Assignment(slots, inner.victim_slots, inner.victim_rows)
        touched, set_of_row = torch.unique(sets, return_inverse=True)
        way_slots = touched[:, None] * self.ways + self._way_index  # [k, ways]
        occupant = self.slot_rows[way_slots]
        pinned = (self.last_used[way_slots] >= pin_since) & (occupant != EMPTY)
        incoming_key = None
        key = self.use_count[way_slots] if self.policy in _COUNTING_POLICIES else self.last_used[way_slots]
        key = key.long()
        if self.policy in LOOKAHEAD_POLICIES and window is not None and len(window):
            distance = window.next_use(occupant)
            pinned |= distance == 1  # the next batch's rows stay
            key = eviction_key(distance, key, len(window))
            # A missing row outside the window ranks above every evictable row outside it, as a row just
            # used does in LRU and a new row does in LFU (which always admits).
            beyond = pin_since if self.policy == "lookahead" else torch.iinfo(torch.int32).max
            incoming_key = eviction_key(window.next_use(rows), torch.full_like(rows, beyond), len(window))
        key = torch.where(occupant == EMPTY, torch.full_like(key, -1), key)
        key = torch.where(pinned, torch.full_like(key, torch.iinfo(torch.int64).max), key)
        victim_key, victim_order = torch.sort(key, dim=1, stable=True)
        evictable = (~pinned).sum(dim=1)

        # Rank of each missing row among the missing rows of its set (most worth a slot first).
        order = torch.arange(rows.numel(), device=rows.device)
        if incoming_key is not None:
            order = torch.argsort(incoming_key, descending=True, stable=True)
        order = order[torch.argsort(set_of_row[order], stable=True)]
        per_set = torch.bincount(set_of_row, minlength=touched.numel())
        group_start = torch.cumsum(per_set, 0) - per_set
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device) - group_start[set_of_row[order]]

        fits = rank < evictable[set_of_row]
        if incoming_key is not None:
            # Keys rise along the victims and fall along the ranked rows: the first refusal ends the set.
            capped = rank.clamp(max=self.ways - 1)
            fits &= victim_key[set_of_row, capped] < incoming_key
        slots = torch.full_like(rows, EMPTY)
        set_idx, rank_fit = set_of_row[fits], rank[fits]
        chosen = way_slots[set_idx, victim_order[set_idx, rank_fit]]
        slots[fits] = chosen
        resident = self.slot_rows[chosen].long()
        evicting = resident != EMPTY
        return Assignment(slots, chosen[evicting], resident[evicting])

    def invalidate(self) -> None:
        """Declare every slot moved: plans made before locate their rows again."""
        self.version += 1

    def _apply(self, fn: Any, recurse: bool = True) -> RowCache:
        self.invalidate()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.invalidate()
        super()._load_from_state_dict(*args, **kwargs)
        self._check_residents()

    def _check_residents(self) -> None:
        """A loaded state (a crafted checkpoint's, say) must place each resident row once, inside the
        table and in its own set: lookups and write-backs index storage with these rows."""
        slots = torch.nonzero(self.slot_rows != EMPTY).squeeze(1)
        rows = self.slot_rows[slots].long()
        if not rows.numel():
            return
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= self.total_rows:
            raise ValueError(f"cache state holds row {low if low < 0 else high} outside [0, {self.total_rows})")
        if rows.unique().numel() != rows.numel():
            raise ValueError("cache state holds a row in two slots")
        if not torch.equal(self.set_of(rows), slots // self.ways):
            raise ValueError("cache state holds a row outside its set")

    def install(
        self, slots: Tensor, rows: Tensor, values: Tensor | None, step: int, uses: Tensor, quiet: bool = False
    ) -> None:
        """Put `rows` with `values` into `slots` (replacing their residents); `values` None: the caller wrote
        them into `weights[slots]` already (decoded straight from storage).

        `quiet` leaves `version` as it is: for a caller that moves no row any plan located (the prefetch
        keeps to unpinned slots and to rows no plan serves from storage) and calls `invalidate` once done.
        """
        if not quiet:
            self.version += 1
        if values is not None:
            self.weights[slots] = values
        self.slot_rows[slots] = rows.to(self.slot_rows.dtype)
        self.last_used[slots] = step
        if self.policy in _COUNTING_POLICIES:
            self.use_count[slots] = uses.to(torch.int32)

    def cached(self) -> tuple[Tensor, Tensor]:
        """(slots, rows) of every resident row."""
        slots = torch.nonzero(self.slot_rows != EMPTY).squeeze(1)
        return slots, self.slot_rows[slots].long()

    def evict(self, slots: Tensor) -> None:
        self.version += 1
        self.slot_rows[slots] = EMPTY
        self.last_used[slots] = 0
        if self.policy in _COUNTING_POLICIES:
            self.use_count[slots] = 0
