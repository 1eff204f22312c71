"""Which callbacks a run has: the one place a feature joins the training loop (see `callbacks.py`)."""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence

from slipcache.callback import Callback
from slipcache.training.callbacks import Callbacks, MetricsLog
from slipcache.training.upcoming import ShowUpcomingBatches, upcoming_batches

if typing.TYPE_CHECKING:
    from slipcache.staleness.order import HotInputs
    from slipcache.training.run import Run

# A feature outside the product (a study's research arm): built from the run and the epoch's hot inputs
# (None without the cold-first order).
CallbackFactory = Callable[["Run", "HotInputs | None"], Callback]


def run_callbacks(run: Run, extra: Sequence[CallbackFactory] = ()) -> Callbacks:
    """The run's callbacks in the order they are called: features that change training first (the product's,
    then `extra`), then the writers of the run directory (only in the process that writes it)."""
    config = run.config
    callbacks: list[Callback] = []
    if config.schedule.lr_schedule == "mlperf":  # --lr-schedule: every learning rate, before each step
        from slipcache.training.schedule import LRSchedule

        callbacks.append(LRSchedule(run))
    hot_inputs = None
    if config.skipping.input_order == "cold_first":  # FAE's order: cold inputs first, then hot ones
        from slipcache.staleness.order import ColdFirstOrder

        # reports: the summary's `staleness` block is the order's unless skipping (or a research arm) writes it
        order = ColdFirstOrder(run, reports=config.skipping.skip_rule is None and not extra)
        callbacks.append(order)  # first: skipping and freezing use the hot set it profiles each epoch
        hot_inputs = order.hot_inputs
    if config.skipping.skip_rule is not None:  # --skip-rule stale|random|loss
        from slipcache.training.skip_inputs import SkipStaleInputs

        callbacks.append(SkipStaleInputs(run, hot_inputs))
    callbacks.extend(make(run, hot_inputs) for make in extra)
    ahead = upcoming_batches(config)  # the lookahead policies' window, or the prefetch's one batch
    if ahead:
        callbacks.append(ShowUpcomingBatches(ahead, config.embeddings.prefetch))
    if run.backend.writes_files:
        callbacks.append(MetricsLog())
        if config.schedule.tensorboard is not None:
            from slipcache.training.tensorboard import TensorBoardLog, open_writer

            writer = open_writer(config.schedule.tensorboard, run.run_dir)
            assert writer is not None
            callbacks.append(TensorBoardLog(writer))
    minutes = config.schedule.checkpoint_minutes or None  # 0: no time interval
    if run.backend.stops_alone and (minutes or config.schedule.checkpoint_on_interrupt):
        from slipcache.training.stopping import CheckpointTimer  # last: it stops the run after the others

        callbacks.append(CheckpointTimer(minutes, on_signal=config.schedule.checkpoint_on_interrupt))
    return Callbacks(callbacks)
