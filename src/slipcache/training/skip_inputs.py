"""`--skip-rule` in the training loop: the skipper's hooks as a training callback
(`StaleSkipper` for the stale and random rules, `LossPruner` for loss pruning)."""

from __future__ import annotations

import typing
from typing import Any

import torch

from slipcache.callback import Callback
from slipcache.staleness.calibration import skipped_kind_calibration
from slipcache.staleness.factory import make_skipper
from slipcache.staleness.skipping import StaleSkipper

if typing.TYPE_CHECKING:
    from slipcache.data.batches import Batch, SampleFilter
    from slipcache.staleness.order import HotInputs
    from slipcache.training.run import Run


class SkipStaleInputs(Callback):
    """Drops the skip rule's inputs from the epoch's batches; the loop reads their count into the progress.

    Skipped inputs count against the sample budget (`progress.skipped`), so a skipping run covers the same
    data as one without. The checkpoint key stays "skipping".
    """

    state_key = "skipping"
    reads_batch_ids = True  # the hot-set detector counts the updates of every id of the global batch

    def __init__(self, run: Run, hot_inputs: HotInputs | None = None) -> None:
        self.skipper = make_skipper(run.config, run.model, run.dataset.split("train"), run.batches_per_epoch,
                                    run.run_dir, hot_inputs, rank=run.backend.rank)  # each rank's own state files

    def on_start(self, run: Run) -> None:
        skipper = self.skipper
        if "stale_target" in run.changed and isinstance(skipper, StaleSkipper):  # resumed with another D: the
            # guard's backed-off target restarts from it
            skipper.guard.base_target = skipper.guard.target = run.config.skipping.stale_target
            skipper.detector.retarget(run.config.skipping.stale_target, skipper.detector.active)  # refits T for it

    def start_epoch(self, run: Run) -> None:
        self.skipper.start_epoch(run.progress.epoch, run.progress.batch_in_epoch)  # profile, open the window

    def sample_filter(self, run: Run) -> SampleFilter | None:
        return self.skipper.sample_filter

    def loss_weights(self, run: Run, n: int) -> torch.Tensor | None:
        return self.skipper.loss_weights(n)

    def after_step(self, run: Run, batch: Batch, logits: torch.Tensor, loss: float) -> None:
        self.skipper.after_batch(batch, logits, loss)  # warm-up, counting, snapshots, fits, guard

    def skipped_inputs(self) -> int | None:
        return self.skipper.skipped_inputs

    def event_fields(self, run: Run) -> dict[str, Any]:
        return self.skipper.event_fields(_seconds_per_trained_sample(run))

    def after_eval(self, run: Run, scores: dict[str, Any]) -> None:
        self.skipper.after_eval(scores)  # warm-up ends on a flat validation loss; the guard watches AUC

    def summary_fields(self, run: Run) -> dict[str, Any]:
        skipped = run.progress.skipped
        staleness = self.skipper.summary(_seconds_per_trained_sample(run))
        detector = getattr(self.skipper, "detector", None)  # the stale and random rules (loss pruning has none)
        if detector is not None and run.backend.batch_part() is None:  # one process: the whole test split
            staleness["calibration"] = skipped_kind_calibration(detector, run.model, run.dataset.split("test"))
        return {"skipped_fraction": skipped / (run.progress.samples + skipped), "staleness": staleness}

    def state_dict(self) -> dict[str, Any]:
        return self.skipper.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipper.load_state_dict(state)


def _seconds_per_trained_sample(run: Run) -> float:
    return run.progress.compute_s / run.progress.samples
