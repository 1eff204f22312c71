"""Accounting of `CachedEmbeddingBagCollection`: the per-table traffic counters (`TrafficCounters`, their
only owner), the memory report by component, and the phase clock `slipcache bench embedding` profiles the
step with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from slipcache.embedding.quant import Fitted, RowStorage, TableRowStorage

if TYPE_CHECKING:
    from slipcache.embedding.cache import RowCache
    from slipcache.embedding.config import EmbeddingConfig
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
    """Time per phase of the training step (wall time unless `enable` is given another timer), off unless
    `enable`d (`slipcache bench embedding` profile).

    `mark()` starts a lap, `lap(name)` adds the time since the last mark to `name` and starts the next; when
    off both return at once, so the hot path keeps only a few no-op calls. On GPU the laps time the launch,
    not the kernels.
    """

    PHASES = ("lookup", "evict", "fill", "forward", "backward", "other")

    def __init__(self) -> None:
        self.seconds: dict[str, float] | None = None
        self._last = 0.0
        self._timer: Callable[[], float] = time.perf_counter

    def enable(self, timer: Callable[[], float] = time.perf_counter) -> None:
        """Start counting, by `timer` (the wall clock; `time.process_time` for CPU time)."""
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._timer = timer

    def disable(self) -> None:
        self.seconds = None

    def mark(self) -> None:
        if self.seconds is not None:
            self._last = self._timer()

    def lap(self, phase: str) -> None:
        if self.seconds is not None:
            now = self._timer()
            self.seconds[phase] += now - self._last
            self._last = now


class TrafficCounters:
    """Per-table traffic counts (`COUNTERS` columns): the one place the collection's counts are kept.

    The tensor is the collection's `counters` buffer (so checkpoints keep their key); the collection hands
    it, and the table offsets, over again with `bind` after they moved. Counts of work done off the main
    thread go to a tensor of their own (`into`) and are added with `add`.
    """

    def __init__(self, table_offsets: Tensor, counts: Tensor) -> None:
        self.bind(table_offsets, counts)

    def bind(self, table_offsets: Tensor, counts: Tensor) -> None:
        self.table_offsets, self.counts = table_offsets, counts
        self.num_tables = counts.shape[0]

    @staticmethod
    def new(num_tables: int, device: torch.device) -> Tensor:
        return torch.zeros(num_tables, len(COUNTERS), dtype=torch.int64, device=device)

    def count_lookups(self, name: str, mask: Tensor | None, lookup: _Lookup) -> None:
        """Add per-table counts of lookups (all, or those where `mask`)."""
        column = COUNTERS.index(name)
        if lookup.bag_of_value is None:
            if mask is None:
                self.counts[:, column] += lookup.batch_size
            else:
                self.counts[:, column] += mask.view(-1, self.num_tables).sum(dim=0)
        else:
            tables = lookup.bag_of_value // max(lookup.batch_size, 1)
            if mask is not None:
                tables = tables[mask]
            self.counts[:, column] += torch.bincount(tables, minlength=self.num_tables)

    def tables_of(self, rows: Tensor) -> Tensor:
        return torch.searchsorted(self.table_offsets, rows.to(self.table_offsets.device), right=True) - 1

    def count_tables(self, name: str, tables: Tensor, into: Tensor | None = None) -> None:
        counts = self.counts if into is None else into
        counts[:, COUNTERS.index(name)] += torch.bincount(tables, minlength=self.num_tables)

    def per_table(self, tables: Tensor) -> Tensor:
        """How many of `tables` name each table: what `count_tables` adds, for `add_per_table`."""
        return torch.bincount(tables, minlength=self.num_tables)

    def add_per_table(self, names: tuple[str, ...], per_table: Tensor, into: Tensor | None = None) -> None:
        """Add per-table counts (`per_table`) to each of the columns `names`: one count for several columns."""
        counts = self.counts if into is None else into
        for name in names:
            counts[:, COUNTERS.index(name)] += per_table

    def count_rows(self, name: str, rows: Tensor, into: Tensor | None = None) -> None:
        self.count_tables(name, self.tables_of(rows), into)

    def count_fitted(self, tables: Tensor, fitted: Fitted, into: Tensor | None = None) -> None:
        counts = self.counts if into is None else into
        for name, per_row in (("saturated_values", fitted.saturated), ("nonfinite_values", fitted.nonfinite)):
            if per_row is not None:
                added = torch.bincount(tables, weights=per_row.to(tables.device), minlength=self.num_tables)
                counts[:, COUNTERS.index(name)] += added.long()

    def add(self, counts: Tensor) -> None:
        self.counts += counts

    def reset(self) -> None:
        self.counts.zero_()

    def summary(self, table_names: list[str], row_bytes: list[tuple[int, int]]) -> dict[str, Any]:
        """Cumulative counts and bytes moved, in total and per table (`stats()` adds the rest)."""
        per_table_counts = self.counts.cpu().tolist()

        def summarize(counts: list[int]) -> dict[str, Any]:
            entry: dict[str, Any] = dict(zip(COUNTERS, counts, strict=True))
            entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else None
            return entry

        per_table = []
        for name, counts, sizes in zip(table_names, per_table_counts, row_bytes, strict=True):
            entry = {"table": name, **summarize(counts)}
            entry["bytes_in"] = entry["rows_in"] * sum(sizes)
            entry["bytes_out"] = entry["rows_out"] * sum(sizes)
            per_table.append(entry)
        totals = summarize([sum(column) for column in zip(*per_table_counts, strict=True)])
        totals["bytes_in"] = sum(t["bytes_in"] for t in per_table)
        totals["bytes_out"] = sum(t["bytes_out"] for t in per_table)
        totals["per_table"] = per_table
        return totals


def row_bytes(storage: RowStorage | TableRowStorage, precisions: list[str]) -> list[tuple[int, int]]:
    """(payload, quantization parameters) bytes of one row of each table."""
    if isinstance(storage, RowStorage):
        return [storage.row_bytes()] * len(precisions)
    return [storage.row_bytes_of(p) for p in precisions]


def memory_report(
    module: nn.Module,
    config: EmbeddingConfig,
    cache: RowCache,
    storage: RowStorage | TableRowStorage,
    optimizer_state: Tensor | None,
    generators: int,
) -> dict[str, Any]:
    """Bytes of every tensor `module` holds, by component, against plain fp32 tables; `generators`: how many
    random generators it keeps (each counts its state)."""
    components = dict.fromkeys(
        ("storage_payload", "quantization_params", "cache_rows", "cache_bookkeeping", "optimizer_state", "other"),
        0,
    )
    for name, buffer in module.named_buffers():
        components[_component_of(name)] += buffer.numel() * buffer.element_size()
    components["other"] += generators * torch.Generator().get_state().numel()
    total = sum(components.values())
    fp32 = config.num_rows * config.dim * 4 + components["optimizer_state"]
    per_table = _memory_per_table(config, cache, storage, optimizer_state)
    return {
        "components": components,
        "total_bytes": total,
        "fp32_bytes": fp32,
        "memory_ratio": fp32 / total,
        "per_table": per_table,
        "shared_bytes": total - sum(t["total_bytes"] for t in per_table),
    }


def _memory_per_table(
    config: EmbeddingConfig, cache: RowCache, storage: RowStorage | TableRowStorage, state: Tensor | None
) -> list[dict[str, Any]]:
    """Each table's bytes by component; the cache's only when each table has its own part (None when the
    tables share it). What no table owns (counters, a shared cache, index tables) is the difference to
    the totals: `shared_bytes`."""
    state_row = 0 if state is None else state[0].numel() * state.element_size()
    per_slot_cache = config.dim * cache.weights.element_size()
    per_slot_bookkeeping = sum(
        getattr(cache, name).element_size() for name in ("slot_rows", "last_used", "use_count") if hasattr(cache, name)
    )
    names = config.table_names or [f"table {t}" for t in range(len(config.table_sizes))]
    tables = []
    sizes = zip(config.table_sizes, row_bytes(storage, config.precisions), strict=True)
    for t, (size, (payload, params)) in enumerate(sizes):
        slots = cache.part_slots[t] if cache.partitioned else None
        entry: dict[str, Any] = {
            "table": names[t],
            "precision": config.precisions[t],
            "storage_payload": size * payload,
            "quantization_params": size * params,
            "cache_rows": None if slots is None else slots * per_slot_cache,
            "cache_bookkeeping": None if slots is None else slots * per_slot_bookkeeping,
            "optimizer_state": size * state_row,
        }
        entry["total_bytes"] = sum(v for k, v in entry.items() if isinstance(v, int))
        entry["fp32_bytes"] = size * config.dim * 4 + entry["optimizer_state"]
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
