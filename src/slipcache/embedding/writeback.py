"""Rows written back into storage: rounded with one random stream and counted.

Every write of fp32 rows into storage after start-up (evictions, flushes, released rows, updates of rows
served from storage) goes through a `RowWriter`: the rounding draws come from its generator only, so a
seed's sequence of writes gives the same stored bytes every run, and the traffic and saturation counts
cannot be forgotten. The main thread's writer and the prefetch thread's writer have generators of their own
(draws never interleave by timing).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slipcache.embedding.accounting import TrafficCounters
from slipcache.embedding.quant import RowStorage, TableRowStorage


class RowWriter:
    """Rounds fp32 rows into `storage` with `generator` (None: the meta device, nothing is written)."""

    def __init__(
        self,
        storage: RowStorage | TableRowStorage,
        counters: TrafficCounters,
        rounding: str,
        generator: torch.Generator | None,
    ) -> None:
        self.storage, self.counters, self.rounding, self.generator = storage, counters, rounding, generator

    def write(
        self,
        rows: Tensor,
        values: Tensor,
        into: Tensor | None = None,
        source: Tensor | None = None,
        tables: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Round `values` of unique `rows` (with `source`: `values[source]`, e.g. the cache's rows at the
        evicted slots) into storage, count rows out and saturated values (into the collection's counters, or
        `into`); returns the table of each row. `tables`: (the table of each row, rows per table), where the
        caller has them already (the rows' forward counted them)."""
        fitted = self.storage.write(rows, values, self.rounding, self.generator, source)
        if tables is None:
            of_row = self.counters.tables_of(rows)
            self.counters.count_tables("rows_out", of_row, into)
        else:
            of_row = tables[0]
            self.counters.add_per_table(("rows_out",), tables[1], into)
        self.counters.count_fitted(of_row, fitted, into)
        return of_row

    def follow(self, device: torch.device) -> None:
        """After a move to `device`: generator states do not carry across device types, so the stream
        continues from a seed drawn from the old one."""
        generator = self.generator
        if generator is None or generator.device == device:
            return
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        self.generator = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
