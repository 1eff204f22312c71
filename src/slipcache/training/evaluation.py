"""Evaluating a model on a split: the metrics of `slipcache eval` and of every run's validation and test."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from slipcache.errors import SlipcacheError
from slipcache.metrics import evaluate_predictions


@torch.no_grad()
def evaluate(
    model: nn.Module, split: Any, *, max_samples: int | None = None, batch_size: int = 8192,
    part: tuple[int, int] | None = None,
) -> dict[str, float]:
    """AUC, log loss, accuracy and normalized entropy on the first `max_samples` of a split (in order);
    `part`: the part of every batch this process reads (`RunBackend.batch_part`)."""
    from slipcache.data.batches import BatchIterator

    was_training = model.training
    model.eval()
    labels: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    seen = 0
    for batch in BatchIterator(split, batch_size, drop_last=False, stop=max_samples, part=part):
        logits = batch.logits(model)
        labels.append(batch.labels.numpy())
        probs.append(torch.sigmoid(logits).numpy())
        seen += len(batch)
    model.train(was_training)
    if not labels:
        raise SlipcacheError("cannot evaluate on an empty split")
    scores = np.concatenate(probs)
    if not np.isfinite(scores).all():  # an AUC over NaN scores means nothing
        bad = int((~np.isfinite(scores)).sum())
        raise SlipcacheError(
            f"{bad} of {scores.size} predictions are not finite: the split holds non-finite dense values "
            "(NaN or inf) or the model diverged"
        )
    result = evaluate_predictions(np.concatenate(labels), scores)
    result["samples"] = seen
    return result
