"""Where each epoch's snapshot window opens and how long it is, when set (`stale_window_start`), and the
skipper that follows it (`ScheduledSkipper`, the skipper of every `stale` and `random` run).

Slipstream's published code opens the window on the hot inputs, after the cold pass: 1,000 hot batches in,
for 3 % of the hot batches. `stale_window_count = "hot"` counts `stale_window_start` and `stale_window`
in the epoch's hot batches (hot inputs / batch size) from the end of the cold pass, which needs the
cold-first order (`slipcache.staleness.order`); `"epoch"` counts them in all of the epoch's batches from
its start (a study's "after 25 % of the run"). Without `stale_window_start` the warm-up rule decides
(`slipcache.staleness.skipping`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from slipcache.data.dataset import SplitArrays
from slipcache.model import DLRM
from slipcache.staleness.order import HotInputs, schedule_fields
from slipcache.staleness.skipping import THRESHOLD_SAMPLE_MIN, StaleSkipper


def window_plan(config: Any, batches_per_epoch: int, hot_inputs: HotInputs | None) -> tuple[int, int] | None:
    """(batch of the epoch where the window opens, its length in batches), or None without a start."""
    if config.skipping.stale_window_start is None:
        return None
    if config.skipping.stale_window_count == "epoch":
        return (round(config.skipping.stale_window_start * batches_per_epoch),
                max(1, round(config.skipping.stale_window * batches_per_epoch)))
    if hot_inputs is None:
        raise ValueError("a window counted in hot batches needs the cold-first order")
    batch = int(config.schedule.batch_size)
    hot_batches = hot_inputs.hot_count // batch
    start = round(config.skipping.stale_window_start * hot_batches)
    if config.skipping.stale_window_start_max is not None:
        start = min(start, int(config.skipping.stale_window_start_max))
    # the first batch holding no cold input: batches are cut from the cold inputs, then the hot ones
    return math.ceil(hot_inputs.cold_count / batch) + start, max(1, round(config.skipping.stale_window * hot_batches))


class ScheduledSkipper(StaleSkipper):
    """`StaleSkipper` whose window opens at a fixed batch of every epoch when `stale_window_start` is set,
    on the cold-first order's hot set when there is one, with the threshold sample drawn from its hot inputs.

    Without a start or an order it is the warm-up skipper; either way its summary says where the window was
    (`schedule_fields`).
    """

    def __init__(self, config: Any, model: DLRM, split: SplitArrays, batches_per_epoch: int,
                 hot_inputs: HotInputs | None) -> None:
        super().__init__(config, model, split, batches_per_epoch)
        self.hot_inputs = hot_inputs
        self.config = config
        self.batches_per_epoch = batches_per_epoch
        self.order = str(config.skipping.input_order)
        self.open_at: int | None = None
        if config.skipping.stale_window_start is not None:
            self.warmup = "schedule"

    def start_epoch(self, epoch: int, batch_in_epoch: int) -> None:
        plan = window_plan(self.config, self.batches_per_epoch, self.hot_inputs)  # also on resume: not saved
        if plan is not None:
            self.open_at, self.window = plan
            if not (batch_in_epoch > 0 and self.epoch == epoch and self.detector.epoch == epoch):
                self.warm = False  # every epoch waits for its own window
        super().start_epoch(epoch, batch_in_epoch)

    def _end_warmup(self, where: str) -> bool:
        if self.open_at is None:
            return super()._end_warmup(where)
        if self.batch < self.open_at:
            return False
        self.warm = True
        self.warm_at = {"epoch": self.epoch, "batch": self.batch, "samples": self.trained + self.detector.total.skipped,
                        "reason": f"batch {self.open_at} of the epoch", "checked_at": where}
        return True

    def _open_window(self) -> None:
        if self.hot_inputs is None:
            super()._open_window()
            return
        det = self.detector
        hot = self.hot_inputs.hot
        assert hot is not None  # the epoch's order was cut by it, before its first batch
        det.set_hot(hot)
        det.begin_window(self.coll)
        self.window_start = self.batch

    def _fit(self) -> None:
        """T on `threshold_sample_fraction` of the epoch's hot inputs (at least THRESHOLD_SAMPLE_MIN)."""
        if self.hot_inputs is None:
            super()._fit()
            return
        hot = self.hot_inputs.hot_positions()
        share = min(1.0, max(self.detector.config.threshold_sample_fraction, THRESHOLD_SAMPLE_MIN / max(hot.size, 1)))
        picks = hot[self.detector.sample_indices(hot.size, share, "threshold")]
        self._fit_on(np.asarray(self.split.sparse[picks]))

    def summary(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        total = self.detector.total
        if self.hot_inputs is not None:
            hot_share: float | None = self.hot_inputs.hot_share
        else:
            hot_share = total.hot_inputs / total.inputs if self.window_start is not None and total.inputs else None
        skipped = total.skipped / total.inputs if total.inputs else 0.0
        return {**super().summary(seconds_per_trained_sample),
                **schedule_fields(self.order, self.window_start, self.window, hot_share, self.detector.threshold,
                                  skipped)}
