"""Accounting of `CachedEmbeddingBagCollection`: per-table traffic counters, `stats()`, the memory report by
component, and the phase clock `slipcache bench embedding` profiles the step with.

`Accounting` is a part of the collection (it reads its counters, cache, storage and buffers).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from slipcache.embedding.quant import Fitted, RowStorage

if TYPE_CHECKING:
    from slipcache.embedding.inputs import _Lookup

COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "evictions",
    "rows_in",
    "rows_out",
    "overflow_rows",
    "saturated_values",  # values written beyond the storage's range, clamped (see quant.fit_to_range)
    "nonfinite_values",  # inf or NaN values written, replaced
)


class PhaseClock:
    """Wall time per phase of the training step, off unless `enable`d (`slipcache bench embedding` profile).

    `mark()` starts a lap, `lap(name)` adds the time since the last mark to `name` and starts the next; when
    off both return at once, so the hot path keeps only a few no-op calls. On GPU the laps time the launch,
    not the kernels.
    """

    PHASES = ("lookup", "evict", "fill", "forward", "backward", "other")

    def __init__(self) -> None:
        self.seconds: dict[str, float] | None = None
        self._last = 0.0

    def enable(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    def disable(self) -> None:
        self.seconds = None

    def mark(self) -> None:
        if self.seconds is not None:
            self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.seconds is not None:
            now = time.perf_counter()
            self.seconds[phase] += now - self._last
            self._last = now


class Accounting:
    """Counters, statistics and memory accounting of `CachedEmbeddingBagCollection`."""

    def _count(self, name: str, mask: Tensor | None, lookup: _Lookup) -> None:
        """Add per-table counts of lookups (all, or those where `mask`)."""
        column = COUNTERS.index(name)
        num_tables = len(self.table_sizes)
        if lookup.bag_of_value is None:
            if mask is None:
                self.counters[:, column] += lookup.batch_size
            else:
                self.counters[:, column] += mask.view(-1, num_tables).sum(dim=0)
        else:
            tables = lookup.bag_of_value // max(lookup.batch_size, 1)
            if mask is not None:
                tables = tables[mask]
            self.counters[:, column] += torch.bincount(tables, minlength=num_tables)

    def _tables_of(self, rows: Tensor) -> Tensor:
        return torch.searchsorted(self.table_offsets, rows.to(self.device), right=True) - 1

    def _count_tables(self, name: str, tables: Tensor, counters: Tensor | None = None) -> None:
        counters = self.counters if counters is None else counters
        counters[:, COUNTERS.index(name)] += torch.bincount(tables, minlength=len(self.table_sizes))

    def _count_rows(self, name: str, rows: Tensor, counters: Tensor | None = None) -> None:
        self._count_tables(name, self._tables_of(rows), counters)

    def _count_fitted(self, tables: Tensor, fitted: Fitted, counters: Tensor | None = None) -> None:
        counters = self.counters if counters is None else counters
        for name, per_row in (("saturated_values", fitted.saturated), ("nonfinite_values", fitted.nonfinite)):
            if per_row is not None:
                counts = torch.bincount(tables, weights=per_row.to(tables.device), minlength=len(self.table_sizes))
                counters[:, COUNTERS.index(name)] += counts.long()

    def reset_stats(self) -> None:
        self._join_prefetch()
        self.counters.zero_()
        self.prefetched_rows = 0

    def stats(self) -> dict[str, Any]:
        """Cumulative lookups, hits, misses, evictions and traffic, in total and per table."""
        self._join_prefetch()
        per_table_counts = self.counters.cpu().tolist()

        def summarize(counts: list[int]) -> dict[str, Any]:
            entry = dict(zip(COUNTERS, counts, strict=True))
            entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else None
            return entry

        per_table = []
        for name, counts, row_bytes in zip(self.table_names, per_table_counts, self._row_bytes(), strict=True):
            entry = {"table": name, **summarize(counts)}
            entry["bytes_in"] = entry["rows_in"] * sum(row_bytes)
            entry["bytes_out"] = entry["rows_out"] * sum(row_bytes)
            per_table.append(entry)
        totals = summarize([sum(column) for column in zip(*per_table_counts, strict=True)])
        totals["bytes_in"] = sum(t["bytes_in"] for t in per_table)
        totals["bytes_out"] = sum(t["bytes_out"] for t in per_table)
        totals["per_table"] = per_table
        totals["cache_rows"] = self.cache.capacity
        totals["skipped_updates"] = self.skipped_updates  # backward passes dropped for inf/NaN gradients
        totals["prefetched_rows"] = self.prefetched_rows  # rows the prefetch brought in (also in rows_in)
        return totals

    def memory_report(self) -> dict[str, Any]:
        """Bytes of every tensor this module holds, by component, against plain fp32 tables."""
        components = dict.fromkeys(
            (
                "storage_payload",
                "quantization_params",
                "cache_rows",
                "cache_bookkeeping",
                "optimizer_state",
                "other",
            ),
            0,
        )
        for name, buffer in self.named_buffers():
            components[_component_of(name)] += buffer.numel() * buffer.element_size()
        if self._generator is not None or self.device.type == "meta":  # (estimate_memory: as if built)
            components["other"] += torch.Generator().get_state().numel()
        if self._prefetch_generator is not None:
            components["other"] += self._prefetch_generator.get_state().numel()
        total = sum(components.values())
        fp32 = self.config.num_rows * self.dim * 4 + components["optimizer_state"]
        per_table = self._memory_per_table()
        return {
            "components": components,
            "total_bytes": total,
            "fp32_bytes": fp32,
            "memory_ratio": fp32 / total,
            "per_table": per_table,
            "shared_bytes": total - sum(t["total_bytes"] for t in per_table),
        }

    def _row_bytes(self) -> list[tuple[int, int]]:
        """(payload, quantization parameters) bytes of one row of each table."""
        if isinstance(self.storage, RowStorage):
            return [self.storage.row_bytes()] * len(self.table_sizes)
        return [self.storage.row_bytes_of(p) for p in self.config.precisions]

    def _memory_per_table(self) -> list[dict[str, Any]]:
        """Each table's bytes by component; the cache's only when each table has its own part (None when the
        tables share it). What no table owns (counters, a shared cache, index tables) is the difference to
        the totals: `shared_bytes`."""
        state = getattr(self, "optimizer_state", None)
        state_row = 0 if state is None else state[0].numel() * state.element_size()
        cache = self.cache
        per_slot_cache = self.dim * cache.weights.element_size()
        per_slot_bookkeeping = sum(
            getattr(cache, name).element_size() for name in ("slot_rows", "last_used", "use_count") if hasattr(cache, name)
        )
        tables = []
        for t, (size, (payload, params)) in enumerate(zip(self.table_sizes, self._row_bytes(), strict=True)):
            slots = cache.part_slots[t] if cache.partitioned else None
            entry = {
                "table": self.table_names[t],
                "precision": self.config.precisions[t],
                "storage_payload": size * payload,
                "quantization_params": size * params,
                "cache_rows": None if slots is None else slots * per_slot_cache,
                "cache_bookkeeping": None if slots is None else slots * per_slot_bookkeeping,
                "optimizer_state": size * state_row,
            }
            entry["total_bytes"] = sum(v for k, v in entry.items() if isinstance(v, int))
            entry["fp32_bytes"] = size * self.dim * 4 + entry["optimizer_state"]
            tables.append(entry)
        return tables



def _component_of(buffer_name: str) -> str:
    if buffer_name.startswith("storage."):
        leaf = buffer_name.rsplit(".", 1)[1]
        if leaf == "payload":
            return "storage_payload"
        if leaf in ("bias", "scale_code"):
            return "quantization_params"
        return "other"  # the table -> part index of mixed precisions
    if buffer_name == "cache.weights":
        return "cache_rows"
    if buffer_name.startswith("cache."):
        return "cache_bookkeeping"
    if buffer_name == "optimizer_state":
        return "optimizer_state"
    return "other"
