"""The lookahead policies and `--prefetch` in the training loop: before each step, the embeddings are shown
the ids of the batches that follow (after the sample filter: the ones that will be trained)."""

from __future__ import annotations

import typing

from slipcache.callback import Callback
from slipcache.embedding.cache import LOOKAHEAD_POLICIES

if typing.TYPE_CHECKING:
    from slipcache.data.batches import BatchIterator
    from slipcache.training.config import TrainConfig
    from slipcache.training.run import Run


def upcoming_batches(config: TrainConfig) -> int:
    """Batches the embeddings are shown ahead: the lookahead policy's window or, with the rows on disk, the
    read-ahead's (`--lookahead` both); else 1 for the prefetch alone."""
    if config.embeddings.embeddings != "cached":
        return 0
    ahead = config.embeddings.policy in LOOKAHEAD_POLICIES or config.embeddings.storage_path is not None
    return config.embeddings.lookahead if ahead else int(config.embeddings.prefetch)


class ShowUpcomingBatches(Callback):
    """Shows the embeddings the next `count` batches before every step; with `prefetch` the first one's
    missing rows are read into the cache in the background while the step computes."""

    reads_batch_ids = True  # a rank of N shows its shards the ids of the whole global batches

    def __init__(self, count: int, prefetch: bool) -> None:
        self.count = count
        self.prefetch = prefetch

    def before_step(self, run: Run, batches: BatchIterator) -> None:
        run.model.embeddings.set_lookahead([b.sparse for b in batches.peek(self.count)], self.prefetch)
