"""A training run: `Run`, what it is made of (fixed once built: the callbacks are built from it and see
nothing else), `Progress`, the loop's position and counts (what a checkpoint saves of the loop), and
`TrainingClock`, the time, CPU and disk bytes of the training itself.
"""

from __future__ import annotations

import time
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from slipcache.errors import SlipcacheError
from slipcache.iostats import DiskIO, disk_io
from slipcache.memory import process_age_s

if typing.TYPE_CHECKING:
    import torch

    from slipcache.model import DLRM
    from slipcache.training.backend import RunBackend
    from slipcache.training.config import TrainConfig


@dataclass
class Progress:
    """Position in the schedule and the running sums of the current logging window."""

    step: int = 0
    samples: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_wall_s: float = (
        0.0  # wall time of the loop: data, skip filter and guard, steps (no eval, no checkpoints)
    )
    compute_s: float = 0.0  # forward, backward and optimizer steps only
    train_cpu_s: float = 0.0  # process CPU time of the same span as train_wall_s: robust to a shared machine
    skipped: int = 0  # inputs dropped as stale; they count against the sample budget like trained ones
    window_loss: float = 0.0  # sum of per-batch mean loss * batch size since the last log event
    window_samples: int = 0
    window_wall_s: float = 0.0
    window_lookups: int = 0
    window_hits: int = 0
    window_steps: int = 0
    window_disk_read_bytes: int = 0
    window_disk_write_bytes: int = 0
    train_disk_read_bytes: int = 0  # /proc/self/io over the same span as train_wall_s
    train_disk_write_bytes: int = 0
    train_lookups: int = 0
    train_hits: int = 0
    # Set by the run's last batch. Not saved: a resume with a longer schedule (--allow-changes) goes on.
    finished: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)  # a copy: the events go on growing
        del state["finished"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's progress (checked by `state_check`); a field it lacks keeps its default."""
        known = {f.name for f in fields(self)}
        for name, value in state.items():
            if name not in known:
                raise SlipcacheError(f"checkpoint does not fit the run: progress has an unknown field {name!r:.60}")
            setattr(self, name, value)

    def close_window(self, disk_counted: bool = True) -> dict[str, Any]:
        """One `metrics.jsonl` event for the batches since the previous one; resets the window.

        `disk_counted`: whether the kernel counts this process's disk bytes (else the disk fields are None)."""
        lookups, hits = self.window_lookups, self.window_hits
        steps = max(self.window_steps, 1)
        self.train_lookups += lookups
        self.train_hits += hits
        event: dict[str, Any] = {
            "event": "train",
            "samples": self.samples,
            "epoch": self.epoch,
            "train_loss": self.window_loss / max(self.window_samples, 1),
            "hit_rate": hits / lookups if lookups else None,
            "samples_per_s": self.window_samples / self.window_wall_s if self.window_wall_s else None,
            "train_wall_s": self.train_wall_s,
            # time-to-accuracy axis: cumulative training wall time, evaluation and checkpoints excluded
            "train_seconds": self.train_wall_s,
            "train_cpu_s": self.train_cpu_s,  # the same span in process CPU time (one torch thread: robust)
            # what the disk read, and was given to write, per step of the window (rows, data, all of it)
            "disk_read_bytes_per_step": self.window_disk_read_bytes / steps if disk_counted else None,
            "disk_write_bytes_per_step": self.window_disk_write_bytes / steps if disk_counted else None,
            "train_disk_read_bytes": self.train_disk_read_bytes if disk_counted else None,
        }
        self.window_loss = 0.0
        self.window_samples = 0
        self.window_wall_s = 0.0
        self.window_lookups = self.window_hits = 0
        self.window_steps = self.window_disk_read_bytes = self.window_disk_write_bytes = 0
        return event


@dataclass(frozen=True)
class Run:
    """What a run is made of, built whole before its callbacks, which read it at every hook. Only `progress`
    changes as the run goes (the loop writes it). What differs between one process and N lives in `backend`.
    """

    config: TrainConfig  # resolved: sample budget and intervals filled in
    config_dict: dict[str, Any]  # what config.json and every checkpoint record
    run_dir: Path
    dataset: Any
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
