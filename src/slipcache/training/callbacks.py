"""The run's callbacks, each hook called on all of them in order (`Callbacks`), and `MetricsLog`, the run
directory's files. The hooks a feature implements: `slipcache.callback.Callback`."""

from __future__ import annotations

import json
import logging
import typing
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from slipcache.callback import Callback
from slipcache.errors import SlipcacheError
from slipcache.safe_files import open_append
from slipcache.training.rundir import write_events, write_json

if typing.TYPE_CHECKING:
    from slipcache.data.batches import Batch, BatchIterator, SampleFilter
    from slipcache.training.run import Run

CALLBACK_KEYS = "callback_states"  # the checkpoint's list of the stateful callbacks' keys

logger = logging.getLogger(__name__)


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

        def keep_all(sparse: np.ndarray, positions: np.ndarray) -> np.ndarray:
            keep = np.ones(sparse.shape[0], dtype=bool)
            for f in filters:
                idx = np.flatnonzero(keep)
                wants = getattr(f, "wants_positions", False)
                keep[idx] = np.asarray(f(sparse[idx], positions[idx]) if wants else f(sparse[idx]), dtype=bool)
            return keep

        keep_all.wants_positions = True  # type: ignore[attr-defined]
        return keep_all

    def before_step(self, run: Run, batches: BatchIterator) -> None:
        for callback in self.items:
            callback.before_step(run, batches)

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

    def skipped_inputs(self) -> int | None:
        """The inputs the callbacks' filters dropped so far; None when none of them drops any."""
        counts = [n for n in (callback.skipped_inputs() for callback in self.items) if n is not None]
        return sum(counts) if counts else None

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
        """Each stateful callback's state under its key (the top level of a checkpoint), and the list of
        those keys: a resume without one of them (a research arm not passed again) is refused."""
        states = {c.state_key: c.state_dict() for c in self.items if c.state_key is not None}
        return {**states, CALLBACK_KEYS: sorted(states)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {c.state_key for c in self.items if c.state_key is not None}
        missing = sorted(set(state.get(CALLBACK_KEYS, ())) - mine)  # checkpoints before the list: not checked
        if missing:
            raise SlipcacheError(
                f"the checkpoint holds the state of {', '.join(missing)}, which this run lacks: a research arm's "
                "run resumes only with that arm passed again (train(config, extra_callbacks=...), as its study does)"
            )
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
        logger.info(f"run: {run.run_dir}")  # where the files are, before the long part
        if run.progress.samples and not run.more_epochs():
            logger.info(f"the run was already complete ({run.progress.samples:,} samples trained): nothing to train; "
                        "its test metrics again")

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        with open_append(run.run_dir / "metrics.jsonl") as f:  # a link there is refused, never followed
            f.write(json.dumps(event) + "\n")

    def on_finish(self, run: Run, summary: dict[str, Any]) -> None:
        from slipcache.training.report import write_report  # matplotlib: imported when drawing

        write_json(run.run_dir / "summary.json", summary)
        write_report(run.run_dir, run.progress.events, summary)
