"""No lost work: a checkpoint every few minutes of training, and one on Ctrl-C or SIGTERM before the run stops.

The sample interval (`--checkpoint-every`) alone can leave many minutes between checkpoints on a slow
machine; `CheckpointTimer` also asks for one when `--checkpoint-minutes` of wall time passed since the last.
On SIGINT or SIGTERM (in the main thread of one process; `--no-checkpoint-on-interrupt` turns it off) it asks
for a checkpoint at the next step boundary and, once that is written, stops the run with `RunInterrupted`,
whose message says how to continue. A second signal acts at once, as it would without the handler
(KeyboardInterrupt, or termination).

N processes under torchrun keep torchrun's own way (its SIGTERM stops every rank at once; they resume from
the last complete checkpoint): a stop taken at a step boundary must be the same step on every rank.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import typing
from typing import Any

from slipcache.callback import Callback
from slipcache.errors import RunInterrupted

if typing.TYPE_CHECKING:
    from slipcache.training.run import Run

logger = logging.getLogger(__name__)

# SIGHUP: the terminal closed (an ssh session dropped); the run keeps its work as on SIGTERM. Where it is
# ignored (`nohup`), it stays ignored.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))

class CheckpointTimer(Callback):
    """A checkpoint after every `minutes` of wall time (None: no time interval) and, with `on_signal`, one
    on SIGINT/SIGTERM followed by a clean stop."""

    def __init__(self, minutes: float | None, *, on_signal: bool) -> None:
        self.seconds = None if minutes is None else 60.0 * minutes
        self.on_signal = on_signal
        self.last = time.monotonic()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def on_start(self, run: Run) -> None:
        self.last = time.monotonic()
        if self.on_signal and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._received)

    def _received(self, signum: int, _frame: object) -> None:
        """First signal: checkpoint and stop at the next step boundary; the next one acts as usual."""
        self.signum = signum
        self._restore()
        name = signal.Signals(signum).name
        # After SIGHUP the terminal may be gone: a handler that cannot write reports through logging, never
        # raises, so the checkpoint is still written.
        logger.warning(f"\nslipcache train: {name}: writing a checkpoint at the end of this step, then stopping "
                       f"({name} again stops at once)")

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def checkpoint_due(self, run: Run) -> bool:
        if self.signum is not None:
            return True
        return self.seconds is not None and time.monotonic() - self.last >= self.seconds

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        if event.get("event") != "checkpoint":
            return
        self.last = time.monotonic()
        if self.signum is not None and not run.progress.finished and run.consumed < run.budget:
            name = signal.Signals(self.signum).name
            raise RunInterrupted(
                f"stopped by {name} at sample {run.progress.samples:,} of {run.budget:,}; the checkpoint "
                f"holds the work: continue with `slipcache train --resume {run.run_dir}`",
                self.signum,
            )

    def close(self, run: Run) -> None:
        self._restore()
