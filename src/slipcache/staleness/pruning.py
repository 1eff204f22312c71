"""Loss-based unbiased pruning (`--skip-rule loss`): skip inputs the model already fits, without bias.

Each input's loss from its last forward is kept as one byte; from the second epoch on, a share r
(`--prune-share`, default 0.5) of the inputs whose last loss is below the mean is pruned at random before
batches are cut (no forward, no backward), and the kept below-mean inputs weigh 1/(1 - r) in the loss, so
each below-mean input's expected weight stays 1: the expected gradient is the one without pruning. The
last `prune_final` (12.5 %) of the run trains on all data, which recovers what the reweighting's variance
costs (the annealing of InfoBatch, Qin et al. 2024).

State, bounded at terabyte scale: two memory-mapped files of one byte per training input (4.2 B inputs:
2 x 4.2 GB on disk, paged by the OS, read in the epoch's order, which is local within chunks). Epoch e
reads the bytes written in epoch e - 1 and writes its own into the other file (a pruned input carries its
old byte forward), so a resumed run reads exactly what the uninterrupted one read. The pruning draw is a
stateless hash of the input's position in the run (`slipcache.staleness.filtering.uniform`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from slipcache.data.batches import Batch
from slipcache.errors import SlipcacheError
from slipcache.safe_files import ensure_dir, open_fd
from slipcache.staleness.filtering import uniform

_STATE_VERSION = 1
LOSS_CAP = 16.0  # losses above this are stored as this (a BCE of 16 is p = 1e-7 on the true class)
_SALT = 0x5EED_105  # the pruning draw's stream, apart from the control draws of stale skipping


def _copy_into(source: Path, target: Path) -> None:
    """`source`'s bytes into a new file `target`, written in place (`open_fd`: no link followed)."""
    with open(source, "rb") as reader, open(open_fd(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as writer:
        shutil.copyfileobj(reader, writer, 1 << 24)


def quantize(loss: np.ndarray) -> np.ndarray:
    """uint8: 1 + 254 sqrt(loss / cap) (0 = never measured); square-root steps are fine near 0."""
    scaled = np.sqrt(np.clip(loss, 0.0, LOSS_CAP) / LOSS_CAP)
    return (1 + np.rint(scaled * 254)).astype(np.uint8)


def dequantize(q: np.ndarray) -> np.ndarray:
    return ((q.astype(np.float64) - 1.0) / 254.0) ** 2 * LOSS_CAP


class LossPruner:
    """The trainer's hooks for loss-based pruning (the same hooks as `StaleSkipper`)."""

    def __init__(self, config: Any, num_inputs: int, state_dir: Path | None, seed_from: Path | None = None) -> None:
        """`state_dir`: where the two files live (None: unnamed files); `seed_from`: rank 0's state directory,
        whose files (when it has them) replace this rank's copy at the start: a copy left from an earlier leg of
        the run on more ranks, or none at all, would decide otherwise than rank 0."""

        self.share = float(config.skipping.prune_share)
        self.final = float(config.skipping.prune_final)
        self.seed = int(config.model.seed) ^ _SALT
        self.total_samples = int(config.schedule.samples or 0)
        self.num_inputs = int(num_inputs)
        if state_dir is None:  # no run directory: unnamed files, gone with the process whatever happens
            scratch = Path(tempfile.mkdtemp(prefix="slipcache-prune-"))
            try:
                self.files = [self._open(scratch / f"prune_losses_{i}.u8") for i in range(2)]
            finally:
                shutil.rmtree(scratch, ignore_errors=True)  # open maps keep the unlinked files alive
        else:
            ensure_dir(state_dir, inside=state_dir.parent)  # in the run directory: no link followed
            names = [f"prune_losses_{i}.u8" for i in range(2)]
            if seed_from is not None and all((seed_from / n).is_file() for n in names):
                for name in names:  # rank 0 writes none before the first step, which waits for this rank
                    _copy_into(seed_from / name, state_dir / name)
            self.files = [self._open(state_dir / name) for name in names]
        self.epoch = -1
        self.position = 0  # inputs filtered in the run (trained or pruned): the draws' position
        self.trained = 0
        self.inputs = self.pruned = 0
        self.epoch_inputs = self.epoch_pruned = 0
        self.below = 0  # inputs below the mean among those judged
        self.mean: float | None = None  # mean last loss of the previous epoch: the pruning line
        self.sums = [0.0, 0]  # this epoch's losses written (trained and carried), and how many
        self.decisions: list[np.ndarray] = []
        self._replay = np.zeros(0, dtype=bool)
        self._replay_pos = 0
        self.pending_positions = np.zeros(0, dtype=np.int64)  # kept, not yet trained, in order
        self.pending_weights = np.zeros(0, dtype=np.float32)
        self.overhead = {"filter": 0.0, "record": 0.0}

    def _open(self, path: Path) -> np.memmap:
        """The file mapped (kept when it has the right size, else zeroed); a link there is refused."""
        size = max(self.num_inputs, 1)
        with open(open_fd(path, os.O_RDWR | os.O_CREAT), "r+b") as f:
            if os.fstat(f.fileno()).st_size != self.num_inputs:
                f.truncate(0)
                f.truncate(size)
            return np.memmap(f, dtype=np.uint8, mode="r+", shape=(size,))

    @property
    def skipped_inputs(self) -> int:
        return self.pruned

    @property
    def overhead_s(self) -> float:
        return sum(self.overhead.values())

    @property
    def state_bytes(self) -> int:
        return 2 * self.num_inputs

    def _active(self) -> bool:
        """Pruning needs last losses (a previous epoch) and stops for the run's final share."""
        end = self.total_samples * (1.0 - self.final)
        return self.mean is not None and (not self.total_samples or self.position < end)

    def start_epoch(self, epoch: int, batch_in_epoch: int) -> None:
        if batch_in_epoch > 0 and self.epoch == epoch:
            return
        if self.epoch >= 0 and self.sums[1]:
            self.mean = self.sums[0] / self.sums[1]
        self.epoch = epoch
        self.sums = [0.0, 0]
        self.epoch_inputs = self.epoch_pruned = 0
        self.decisions, self._replay, self._replay_pos = [], np.zeros(0, dtype=bool), 0
        self.pending_positions = np.zeros(0, dtype=np.int64)
        self.pending_weights = np.zeros(0, dtype=np.float32)

    def sample_filter(self, sparse: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Keep mask of a piece of inputs at these split positions; replays recorded decisions after a resume."""
        t0 = time.perf_counter()
        n = sparse.shape[0]
        if positions is None:
            raise SlipcacheError("loss pruning needs the inputs' positions from the batch iterator")
        if self._replay_pos < self._replay.size:
            keep = self._replay[self._replay_pos : self._replay_pos + n]
            self._replay_pos += n
        else:
            keep = np.ones(n, dtype=bool)
            weights = np.ones(n, dtype=np.float32)
            if self._active():
                last = np.asarray(self.files[(self.epoch - 1) % 2][positions])
                below = (last > 0) & (dequantize(last) < self.mean)
                prune = below & (uniform(self.seed, self.position + np.arange(n)) < self.share)
                keep = ~prune
                weights[below & keep] = 1.0 / (1.0 - self.share)
                if prune.any():  # a pruned input carries its last loss into this epoch's file
                    carried = last[prune]
                    self.files[self.epoch % 2][positions[prune]] = carried
                    self.sums[0] += float(dequantize(carried).sum())
                    self.sums[1] += int(carried.size)
                self.below += int(below.sum())
            pruned = int(n - keep.sum())
            self.inputs += n
            self.pruned += pruned
            self.epoch_inputs += n
            self.epoch_pruned += pruned
            self.position += n
            self.pending_positions = np.concatenate([self.pending_positions, positions[keep]])
            self.pending_weights = np.concatenate([self.pending_weights, weights[keep]])
        self.decisions.append(keep)
        self.overhead["filter"] += time.perf_counter() - t0
        return keep

    sample_filter.wants_positions = True  # type: ignore[attr-defined]

    def loss_weights(self, n: int) -> torch.Tensor | None:
        """1/(1 - r) on the next batch's kept below-mean inputs; None when all weigh 1 (plain mean)."""
        weights = self.pending_weights[:n]
        return torch.from_numpy(weights.copy()) if (weights != 1.0).any() else None

    def after_batch(self, batch: Batch, logits: torch.Tensor, loss: float | None = None) -> None:
        """Store each trained input's loss from this forward (before the update) in this epoch's file."""
        t0 = time.perf_counter()
        n = int(batch.labels.shape[0])
        positions, self.pending_positions = self.pending_positions[:n], self.pending_positions[n:]
        self.pending_weights = self.pending_weights[n:]
        losses = F.binary_cross_entropy_with_logits(logits.detach(), batch.labels, reduction="none").numpy()
        q = quantize(losses)
        self.files[self.epoch % 2][positions] = q
        self.sums[0] += float(dequantize(q).sum())
        self.sums[1] += n
        self.trained += n
        self.overhead["record"] += time.perf_counter() - t0

    def after_eval(self, scores: dict[str, Any]) -> None:
        """Pruning does not watch validation."""

    def event_fields(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        return {
            "skipped_fraction": self.pruned / self.inputs if self.inputs else 0.0,
            "epoch_skipped_fraction": self.epoch_pruned / self.epoch_inputs if self.epoch_inputs else 0.0,
            "inputs_skipped": self.pruned,
            "skipping": self._active(),
            "prune_mean_loss": self.mean,
            "skip_overhead_s": self.overhead_s,
            "time_saved_s": self.pruned * seconds_per_trained_sample - self.overhead_s,
        }

    def summary(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        skipped = self.pruned / self.inputs if self.inputs else 0.0
        return {
            **self.event_fields(seconds_per_trained_sample),
            "rule": "loss",
            "prune_share": self.share,
            "prune_final": self.final,
            "below_mean_inputs": self.below,
            "inputs_seen": self.inputs,
            "state_bytes": self.state_bytes,
            "skip_overhead_parts_s": dict(self.overhead),
            "speedup_bound": 1.0 / max(1.0 - skipped, 1e-9),
        }

    def state_dict(self) -> dict[str, Any]:
        for f in self.files:
            f.flush()
        decisions = np.concatenate(self.decisions) if self.decisions else np.zeros(0, dtype=bool)
        return {
            "version": _STATE_VERSION,
            "counters": [self.epoch, self.position, self.trained, self.inputs, self.pruned, self.epoch_inputs,
                         self.epoch_pruned, self.below],
            "mean": self.mean,
            "sums": list(self.sums),
            "decisions": torch.from_numpy(np.packbits(decisions)),
            "num_decisions": int(decisions.size),
            "pending_positions": torch.from_numpy(self.pending_positions.copy()),
            "pending_weights": torch.from_numpy(self.pending_weights.copy()),
            "overhead": dict(self.overhead),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise SlipcacheError(f"unsupported pruning state version {state.get('version')}")
        (self.epoch, self.position, self.trained, self.inputs, self.pruned, self.epoch_inputs, self.epoch_pruned,
         self.below) = (int(v) for v in state["counters"])
        self.mean = state["mean"]
        self.sums = [float(state["sums"][0]), int(state["sums"][1])]
        bits = np.unpackbits(state["decisions"].numpy(), count=int(state["num_decisions"]))
        self._replay, self._replay_pos, self.decisions = bits.astype(bool), 0, []
        self.pending_positions = state["pending_positions"].numpy().copy()
        self.pending_weights = state["pending_weights"].numpy().copy()
        self.overhead = {k: float(v) for k, v in state["overhead"].items()}
