"""The loop's position and counts: `Progress`, the part of a run that changes as it trains, and what a
checkpoint saves of the loop (`state_dict`). A leaf: the checkpoint checks read its fields without the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from slipcache.errors import SlipcacheError


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
