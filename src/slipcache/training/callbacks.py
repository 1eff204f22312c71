"""What a feature adds to the training loop, at fixed hooks; the loop itself knows no feature.

A `Callback` overrides the hooks it needs; the trainer calls every callback of the run, in list order, at
these points (see `trainer.train`):

    on_start(run)                         the run is built and restored, before the first batch
    start_epoch(run)                      before the epoch's batches are read
    input_groups(run) -> array | None     the epoch visits group 0's inputs first, then group 1's (one order)
    sample_filter(run) -> filter | None   drops samples while batches are assembled (batches stay full)
    loss_weights(run, n) -> Tensor | None per-sample loss weights of the next trained batch
    after_step(run, batch, logits, loss)  after every optimizer step (logits detached)
    checkpoint_due(run) -> bool           whether to write a checkpoint at this step boundary as well
    event_fields(run) -> dict             keys merged into each metrics.jsonl event
    after_eval(run, scores)               after every periodic validation
    on_event(run, event)                  the finished event (write it somewhere)
    summary_fields(run) -> dict           keys merged into summary.json
    on_finish(run, summary)               the finished summary (write it, close files)
    close(run)                            the run ends, finished or not (put back what on_start changed)

A callback with state that must survive a resume names its checkpoint key (`state_key`) and implements
`state_dict` / `load_state_dict`. Which callbacks a run has is decided in one place, `features.py`.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from slipcache.safe_files import open_append
from slipcache.training.rundir import write_events, write_json

if typing.TYPE_CHECKING:
    from slipcache.data.dataset import Batch, SampleFilter
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

    def loss_weights(self, run: Run, n: int) -> torch.Tensor | None:
        return None

    def after_step(self, run: Run, batch: Batch, logits: torch.Tensor, loss: float) -> None:
        pass

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


class Callbacks:
    """The run's callbacks, each hook called on all of them in order."""

    def __init__(self, callbacks: list[Callback] | None = None) -> None:
        self.items: list[Callback] = list(callbacks or [])

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.items)

    @property
    def reads_batch_ids(self) -> bool:
        return any(callback.reads_batch_ids for callback in self.items)

    def on_start(self, run: Run) -> None:
        for callback in self.items:
            callback.on_start(run)

    def start_epoch(self, run: Run) -> None:
        for callback in self.items:
            callback.start_epoch(run)

    def input_groups(self, run: Run) -> np.ndarray | None:
        """The one callback's groups that order the epoch's inputs; two orders would contradict each other."""
        groups = [g for g in (c.input_groups(run) for c in self.items) if g is not None]
        if len(groups) > 1:
            raise RuntimeError("two callbacks order the epoch's inputs")
        return groups[0] if groups else None

    def sample_filter(self, run: Run) -> SampleFilter | None:
        """One filter that keeps what every callback's filter keeps (each sees only what the earlier kept)."""
        filters = [f for f in (c.sample_filter(run) for c in self.items) if f is not None]
        if len(filters) <= 1:
            return filters[0] if filters else None

        def keep_all(sparse: np.ndarray) -> np.ndarray:
            keep = np.ones(sparse.shape[0], dtype=bool)
            for f in filters:
                idx = np.flatnonzero(keep)
                keep[idx] = np.asarray(f(sparse[idx]), dtype=bool)
            return keep

        return keep_all

    def loss_weights(self, run: Run, n: int) -> torch.Tensor | None:
        """The product of the callbacks' weights; None (plain mean) when none weighs."""
        weights = None
        for callback in self.items:
            w = callback.loss_weights(run, n)
            if w is not None:
                weights = w if weights is None else weights * w
        return weights

    def after_step(self, run: Run, batch: Batch, logits: torch.Tensor, loss: float) -> None:
        for callback in self.items:
            callback.after_step(run, batch, logits, loss)

    def checkpoint_due(self, run: Run) -> bool:
        return any(callback.checkpoint_due(run) for callback in self.items)

    def event_fields(self, run: Run) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for callback in self.items:
            fields.update(callback.event_fields(run))
        return fields

    def after_eval(self, run: Run, scores: dict[str, Any]) -> None:
        for callback in self.items:
            callback.after_eval(run, scores)

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        for callback in self.items:
            callback.on_event(run, event)

    def summary_fields(self, run: Run) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for callback in self.items:
            fields.update(callback.summary_fields(run))
        return fields

    def on_finish(self, run: Run, summary: dict[str, Any]) -> None:
        for callback in self.items:
            callback.on_finish(run, summary)

    def close(self, run: Run) -> None:
        for callback in self.items:
            callback.close(run)

    def state_dict(self) -> dict[str, Any]:
        """Each stateful callback's state under its key (the top level of a checkpoint)."""
        return {c.state_key: c.state_dict() for c in self.items if c.state_key is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for callback in self.items:
            if callback.state_key is not None:
                callback.load_state_dict(state[callback.state_key])


class MetricsLog(Callback):
    """The run directory's files: config.json, metrics.jsonl (one line per event), summary.json, report.md.

    Only the process that writes the run directory has one (`backend.writes_files`).
    """

    def on_start(self, run: Run) -> None:
        write_json(run.run_dir / "config.json", run.config_dict)
        write_events(run.run_dir / "metrics.jsonl", run.progress.events)  # a resumed run drops later events
        print(f"run: {run.run_dir}", flush=True)  # where the files are, before the long part
        if run.progress.samples and not run.more_epochs():
            print(f"the run was already complete ({run.progress.samples:,} samples trained): nothing to train; "
                  "its test metrics again", flush=True)

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        with open_append(run.run_dir / "metrics.jsonl") as f:  # a link there is refused, never followed
            f.write(json.dumps(event) + "\n")

    def on_finish(self, run: Run, summary: dict[str, Any]) -> None:
        from slipcache.training.report import write_report  # matplotlib: imported when drawing

        write_json(run.run_dir / "summary.json", summary)
        write_report(run.run_dir, run.progress.events, summary)
