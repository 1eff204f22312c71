"""A training run: `Run`, what it is made of (fixed once built: the callbacks are built from it and see
nothing else, its `Progress` the only part that changes), and `TrainingClock`, the time, CPU and disk bytes
of the training itself.
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipcache.errors import SlipcacheError
from slipcache.iostats import DiskIO, disk_io
from slipcache.memory import process_age_s
from slipcache.training.loop_state import Progress

if typing.TYPE_CHECKING:
    import torch

    from slipcache.data.formats import Dataset
    from slipcache.model import DLRM
    from slipcache.training.backend import RunBackend
    from slipcache.training.config import TrainConfig


@dataclass(frozen=True)
class Run:
    """What a run is made of, built whole before its callbacks, which read it at every hook. Only `progress`
    changes as the run goes (the loop writes it). What differs between one process and N lives in `backend`.
    """

    config: TrainConfig  # resolved: sample budget and intervals filled in
    schedule: Schedule  # those counts, read once from `config`
    config_dict: dict[str, Any]  # what config.json and every checkpoint record
    run_dir: Path
    dataset: Dataset
    model: DLRM
    dense_opt: torch.optim.Optimizer
    emb_opt: torch.optim.Optimizer | None
    backend: RunBackend
    budget: int  # samples to consume (trained + skipped), a whole number of batches
    max_epochs: int
    batches_per_epoch: int
    data_quality: dict[str, Any] | None  # malformed lines skipped while preprocessing raw input
    changed: frozenset[str] = frozenset()  # settings this resume changed (--allow-changes)
    progress: Progress = field(default_factory=Progress)

    @property
    def consumed(self) -> int:
        """Samples trained or skipped: the position in the data that the budget and eval schedule count."""
        return self.progress.samples + self.progress.skipped

    def more_epochs(self) -> bool:
        progress = self.progress
        return not progress.finished and self.consumed < self.budget and progress.epoch < self.max_epochs


class TrainingClock:
    """Wall time, CPU time and disk bytes of the training itself: counted in spans that the loop starts and
    ends around evaluation and checkpoints, added to `Progress`'s totals and open window."""

    def __init__(self) -> None:
        self.tick = 0.0
        self.tick_cpu = 0.0
        self.tick_io: DiskIO | None = None
        self.startup_s: float | None = None  # process start to the first training step (memory.process_age_s)
        self.startup_disk_read_bytes: int | None = None  # disk bytes read from process start to the first step

    @property
    def disk_counted(self) -> bool:
        """Whether the kernel counts this process's disk bytes (else the disk fields are None)."""
        return self.tick_io is not None

    def mark_started(self) -> None:
        """At the first step: how long the start-up took, and what it read from the disk."""
        if self.startup_s is not None:
            return
        self.startup_s = process_age_s()
        started = disk_io()
        self.startup_disk_read_bytes = None if started is None else started.read_bytes

    def restart(self) -> None:
        """Start a span of training time: wall clock, CPU time and the disk's bytes count from here."""
        self.tick = time.perf_counter()
        self.tick_cpu = time.process_time()
        self.tick_io = disk_io()

    def count(self, progress: Progress) -> float:
        """Add the span since `restart` to the loop's totals (wall, CPU, disk bytes); returns its wall time."""
        elapsed = time.perf_counter() - self.tick
        progress.train_wall_s += elapsed
        progress.train_cpu_s += time.process_time() - self.tick_cpu
        now = disk_io()
        if now is not None and self.tick_io is not None:
            read, written = now - self.tick_io
            progress.train_disk_read_bytes += read
            progress.train_disk_write_bytes += written
            progress.window_disk_read_bytes += read
            progress.window_disk_write_bytes += written
        return elapsed


@dataclass(frozen=True)
class Schedule:
    """The counts `resolve_schedule` fills in: the sample budget and the intervals, in samples."""

    samples: int
    log_every: int
    eval_every: int
    checkpoint_every: int


def schedule_of(config: TrainConfig) -> Schedule:
    """The resolved counts of `config` (one that `resolve_schedule` returned)."""
    schedule = config.schedule
    samples, log, evaluation, checkpoint = (schedule.samples, schedule.log_every, schedule.eval_every,
                                            schedule.checkpoint_every)
    if samples is None or log is None or evaluation is None or checkpoint is None:
        raise SlipcacheError("the run's schedule is not resolved yet (resolve_schedule fills it in)")
    return Schedule(samples, log, evaluation, checkpoint)
