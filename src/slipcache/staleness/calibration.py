"""Is what a skip rule drops a neutral sample? The label rate of the skipped against the trained inputs, and
whether the model ends miscalibrated on inputs of the skipped kind: the test split's mean prediction against
its label rate, for them and for the rest."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from slipcache.data.batches import BatchIterator
from slipcache.data.dataset import SplitArrays
from slipcache.model import DLRM
from slipcache.staleness.detector import StaleInputDetector


class LabelCounts:
    """Inputs and positive labels among the skipped and among the trained inputs of a run."""

    def __init__(self) -> None:
        self.counts = {"skipped": [0, 0], "kept": [0, 0]}

    def add(self, keep: np.ndarray, positive: np.ndarray) -> None:
        for group, mask in (("kept", keep), ("skipped", ~keep)):
            self.counts[group][0] += int(mask.sum())
            self.counts[group][1] += int(positive[mask].sum())

    def rates(self) -> dict[str, float | None]:
        """Positive rate of the skipped and of the trained inputs (None where there are none)."""
        return {f"{group}_label_rate": (pos / n if n else None) for group, (n, pos) in self.counts.items()}

    def state_dict(self) -> dict[str, list[int]]:
        return {group: list(pair) for group, pair in self.counts.items()}

    def load_state_dict(self, state: dict[str, list[int]] | None) -> None:
        """None: a checkpoint written before the counts were kept; they start from there."""
        self.counts = {group: list(pair) for group, pair in (state or self.state_dict()).items()}


@torch.no_grad()
def skipped_kind_calibration(
    detector: StaleInputDetector, model: DLRM, split: SplitArrays, batch_size: int = 8192
) -> dict[str, dict[str, Any]] | None:
    """Mean prediction and label rate on `split` of the inputs the detector calls stale under its final threshold
    (for the random rule, every hot input: its candidates) and of the rest. None before a threshold exists."""
    if detector.threshold is None:
        return None
    sums = {"skipped_kind": [0, 0.0, 0.0], "rest": [0, 0.0, 0.0]}  # inputs, predictions, labels
    was_training = model.training
    model.eval()
    for batch in BatchIterator(split, batch_size, drop_last=False):
        predictions = torch.sigmoid(batch.logits(model)).numpy().astype(np.float64)
        labels = batch.labels.numpy().astype(np.float64)
        kind = detector.stale_mask(batch.sparse.numpy())
        for group, mask in (("skipped_kind", kind), ("rest", ~kind)):
            sums[group][0] += int(mask.sum())
            sums[group][1] += float(predictions[mask].sum())
            sums[group][2] += float(labels[mask].sum())
    model.train(was_training)
    return {
        group: {"inputs": n, "mean_pred": (p / n if n else None), "label_rate": (y / n if n else None)}
        for group, (n, p, y) in sums.items()
    }
