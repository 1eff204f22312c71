"""What a feature adds to the training loop, at fixed hooks; the loop itself knows no feature. The interface
lives here, below the loop (`slipcache.training`) and the features (`slipcache.staleness`, ...), so that a
feature never imports the loop.

A `Callback` overrides the hooks it needs; the trainer calls every callback of the run, in list order, at
these points (see `trainer.train`). `run` is what the run is made of, with its progress to read; the loop
alone writes the progress (a callback reports what it counts through a hook, `skipped_inputs`):

    on_start(run)                         the run is built and restored, before the first batch
    start_epoch(run)                      before the epoch's batches are read
    input_groups(run) -> array | None     the epoch visits group 0's inputs first, then group 1's (one order)
    sample_filter(run) -> filter | None   drops samples while batches are assembled (batches stay full)
    before_step(run, batches)             before every step (`batches`: the epoch's iterator, to peek ahead)
    loss_weights(run, n) -> Tensor | None per-sample loss weights of the next trained batch
    after_step(run, batch, logits, loss)  after every optimizer step (logits detached)
    skipped_inputs() -> int | None        inputs its sample filter dropped so far (they count in the budget)
    checkpoint_due(run) -> bool           whether to write a checkpoint at this step boundary as well
    event_fields(run) -> dict             keys merged into each metrics.jsonl event
    after_eval(run, scores)               after every periodic validation
    on_event(run, event)                  the finished event (write it somewhere)
    summary_fields(run) -> dict           keys merged into summary.json
    on_finish(run, summary)               the finished summary (write it, close files)
    close(run)                            the run ends, finished or not (put back what on_start changed)

A callback with state that must survive a resume names its checkpoint key (`state_key`) and implements
`state_dict` / `load_state_dict`. Which callbacks a run has is decided in one place, `training/features.py`.
"""

from __future__ import annotations

import typing
from typing import Any

if typing.TYPE_CHECKING:
    import numpy as np
    import torch

    from slipcache.data.batches import Batch, BatchIterator, SampleFilter
    from slipcache.training.run import Run


class Callback:
    """A feature of the training loop; every hook does nothing unless overridden."""

    state_key: str | None = None  # the checkpoint key of `state_dict()`; None: nothing to save
    # True when `after_step` reads the ids of every sample of the global batch: a rank of N then reads
    # whole batches instead of only its slice (`BatchIterator(part=...)`)
    reads_batch_ids: bool = False

    def on_start(self, run: Run) -> None:
        pass

    def start_epoch(self, run: Run) -> None:
        pass

    def input_groups(self, run: Run) -> np.ndarray | None:
        return None

    def sample_filter(self, run: Run) -> SampleFilter | None:
        return None

    def before_step(self, run: Run, batches: BatchIterator) -> None:
        pass

    def loss_weights(self, run: Run, n: int) -> torch.Tensor | None:
        return None

    def after_step(self, run: Run, batch: Batch, logits: torch.Tensor, loss: float) -> None:
        pass

    def skipped_inputs(self) -> int | None:
        return None  # drops none

    def checkpoint_due(self, run: Run) -> bool:
        return False

    def event_fields(self, run: Run) -> dict[str, Any]:
        return {}

    def after_eval(self, run: Run, scores: dict[str, Any]) -> None:
        pass

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        pass

    def summary_fields(self, run: Run) -> dict[str, Any]:
        return {}

    def on_finish(self, run: Run, summary: dict[str, Any]) -> None:
        pass

    def close(self, run: Run) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
