"""Freezing hot rows: the test of saturation that skipping inputs cannot give. A research arm of the
Slipstream studies (`freeze-stalest`, `freeze-random`), not a feature of `slipcache train`: a study passes
`freezing_arm(...)` to `train(config, extra_callbacks=...)`.

Skipping an input removes its gradient from every row and from the MLP, so a skipping run that loses
accuracy does not say whether its rows had stopped learning. Freezing asks only that: at the end of the
epoch's window (`slipcache.staleness.schedule.window_plan`) a share `share` of the hot rows stops
being updated for the rest of the epoch, while every input is still trained. `stalest`: the rows whose
L-inf change over the window was smallest (Slipstream's measure); `random`: a random share of the hot
rows, the control. If freezing the stalest half costs nothing while a random half costs accuracy, the
stale rows had saturated.

How: after every step, the frozen rows the batch looked up get their values from the window's end back
(`write_rows`). Under SGD a step changes only the rows its batch looked up, so the frozen rows keep
exactly those values; an optimizer's per-row state (Adagrad's sums) still advances.
"""

from __future__ import annotations

import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slipcache.callback import Callback
from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.errors import SlipcacheError
from slipcache.model import TorchEmbeddingBagCollection
from slipcache.staleness.detector import StaleInputDetector
from slipcache.staleness.order import HotInputs, schedule_fields
from slipcache.staleness.schedule import window_plan

if typing.TYPE_CHECKING:
    from slipcache.data.batches import Batch
    from slipcache.training.run import Run

MODES = ("stalest", "random")  # which hot rows stop being updated
# The study settings of this arm (a study's Arm overrides): not `slipcache train` settings.
SETTINGS = ("freeze_rows", "freeze_share")


@dataclass(frozen=True)
class FreezeSettings:
    rows: str  # stalest: the rows that changed least over the window; random: the control
    share: float = 0.5  # of the hot rows, frozen

    def __post_init__(self) -> None:
        if self.rows not in MODES:
            raise SlipcacheError(f"freeze_rows must be one of {', '.join(MODES)}, got {self.rows!r}")
        if not 0 < self.share <= 1:
            raise SlipcacheError(f"freeze_share must be in (0, 1], got {self.share}")


def freezing_arm(freeze_rows: str, freeze_share: float = 0.5) -> Callable[[Run, HotInputs | None], Callback]:
    """The callback factory `train(config, extra_callbacks=[...])` takes, for a study arm's settings."""
    settings = FreezeSettings(freeze_rows, freeze_share)
    return lambda run, hot_inputs: FreezeRows(run, hot_inputs, settings)


class FreezeRows(Callback):
    """Measures the hot rows over the window, then holds `share` of them fixed until the epoch ends."""

    state_key = "freezing"

    def __init__(self, run: Run, hot_inputs: HotInputs | None, settings: FreezeSettings) -> None:
        config = run.config
        if config.skipping.skip_rule is not None:
            raise SlipcacheError("freezing rows and skip_rule are separate arms: set one of them")
        if config.skipping.stale_window_start is None:
            raise SlipcacheError("freezing rows needs stale_window_start: where the window that picks the rows opens")
        tables = run.model.embeddings
        if not isinstance(tables, (TorchEmbeddingBagCollection, CachedEmbeddingBagCollection)):
            raise SlipcacheError("freezing rows needs embeddings that can be written row by row: train in one process")
        self.coll = tables
        self.config, self.hot_inputs = config, hot_inputs
        self.split, self.batches_per_epoch = run.dataset.split("train"), run.batches_per_epoch
        self.mode, self.share = settings.rows, settings.share
        self.detector = StaleInputDetector.from_collection(self.coll, config.staleness_config(rule="paper"))
        self.offsets = self.detector.table_offsets
        self.epoch = -1
        self.batch = 0  # batches trained in this epoch
        self.open_at, self.window = 0, 1
        self.window_start: int | None = None
        self.frozen = np.zeros(0, dtype=np.int64)  # sorted global rows held fixed
        self.values = torch.zeros(0, self.detector.dim)  # their values at the window's end

    def start_epoch(self, run: Run) -> None:
        plan = window_plan(self.config, self.batches_per_epoch, self.hot_inputs)
        if plan is None:
            raise SlipcacheError("freezing rows needs stale_window_start: where the window opens")
        self.open_at, self.window = plan
        epoch = run.progress.epoch
        if run.progress.batch_in_epoch > 0 and self.epoch == epoch:
            return  # resumed mid-epoch: the checkpoint holds where this epoch stands
        self.epoch, self.batch, self.window_start = epoch, 0, None
        self.frozen, self.values = np.zeros(0, dtype=np.int64), torch.zeros(0, self.detector.dim)
        self.detector.start_epoch(epoch)
        if self.open_at == 0:
            self._open()

    def after_step(self, run: Run, batch: Batch, logits: torch.Tensor, loss: float) -> None:
        self.batch += 1
        if self.window_start is None:
            if self.batch >= self.open_at:
                self._open()
        elif self.batch == self.window_start + self.window:
            self._freeze()
        elif self.frozen.size:
            self._restore(batch.sparse.numpy())

    def _open(self) -> None:
        det = self.detector
        if self.hot_inputs is not None:
            hot = self.hot_inputs.hot
            assert hot is not None  # the epoch's order was cut by it, before its first batch
            det.set_hot(hot)
        else:
            n = len(self.split)
            det.profile(self.split.sparse[det.sample_indices(n, det.config.profile_fraction, "profile")])
        det.begin_window(self.coll)
        self.window_start = self.batch

    def _freeze(self) -> None:
        """Choose the rows at the window's end and keep their values."""
        det = self.detector
        change = det.end_window(self.coll)
        hot = det.hot
        assert hot is not None
        k = round(self.share * len(hot))
        if self.mode == "stalest":  # smallest change first; ties to the lower row (hot.rows is sorted)
            picks = np.argsort(change, kind="stable")[:k]
        else:
            rng = np.random.default_rng([self.config.model.seed, self.epoch, zlib.crc32(b"freeze")])
            picks = rng.choice(len(hot), size=k, replace=False)
        self.frozen = np.sort(hot.rows[picks]).astype(np.int64)
        self.values = self.coll.read_rows(torch.from_numpy(self.frozen)).detach().to("cpu", torch.float32).clone()

    def _restore(self, sparse: np.ndarray) -> None:
        """Give the frozen rows this batch updated their values back."""
        rows = np.unique(sparse.astype(np.int64) + self.offsets[:-1])
        pos = np.minimum(np.searchsorted(self.frozen, rows), self.frozen.size - 1)
        hit = self.frozen[pos] == rows
        if hit.any():
            self.coll.write_rows(torch.from_numpy(rows[hit]), self.values[torch.from_numpy(pos[hit])])

    def summary_fields(self, run: Run) -> dict[str, Any]:
        hot_share = self.hot_inputs.hot_share if self.hot_inputs is not None else None
        block = schedule_fields(str(self.config.skipping.input_order), self.window_start, self.window,
                                hot_share, None, 0.0)
        hot = self.detector.hot
        block.update({"freeze": self.mode, "freeze_share": self.share, "frozen_rows": int(self.frozen.size),
                      "hot_rows": 0 if hot is None else len(hot)})
        return {"staleness": block}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "window_start": self.window_start,
                "detector": self.detector.state_dict(), "frozen": torch.from_numpy(self.frozen),
                "values": self.values}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch, self.window_start = int(state["epoch"]), int(state["batch"]), state["window_start"]
        self.detector.load_state_dict(state["detector"])
        self.frozen = state["frozen"].numpy().astype(np.int64)
        self.values = state["values"].to(torch.float32)
