"""`EmbeddingTables`: what the model and the training loop ask of any embedding collection.

DLRM takes one of three collections (the fp32 `nn.EmbeddingBag` baseline, slipcache's cached tables, their
shards over N processes); each derives from this class, so that the model, the loop and the features
depend on this interface, not on one implementation. What only some collections do (a learning rate of
their own, row files on disk) is asked with `isinstance` where it is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn


class EmbeddingTables(nn.Module):
    """Tables of `dim`-wide rows, one per categorical feature; forward(ids [b, T]) -> [b, T, dim]."""

    fused_update: bool  # True: the collection updates its own rows during backward (no dense optimizer)
    table_sizes: list[int]
    dim: int
    lr: float  # the tables' learning rate (the loop's schedule sets it)
    table_offsets: Tensor  # [T + 1]: the first global row of each table, then the total

    def read_rows(self, rows: Tensor) -> Tensor:
        """The current fp32 values of global `rows` [n] -> [n, dim]."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Cumulative traffic counters (lookups, hits, rows read and written, ...), as plain numbers."""
        raise NotImplementedError

    def memory_report(self) -> dict[str, Any]:
        """Bytes the tables hold, by part."""
        raise NotImplementedError

    def set_lookahead(self, upcoming: Sequence[Tensor], prefetch: bool = False) -> None:
        """The ids [b, T] of the batches after the next training step's, for that step: tables with a cache
        evict and prefetch by them; others have no use for them."""
