"""Shared test helpers: a tiny dataset in the binary format of docs/design.md."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipcache.training.config import TrainConfig, make_config

SIZES = [20, 7, 50] + [5] * 23


def make_dataset(
    root: Path, n: int = 2000, sizes: list[int] = SIZES, nan_row: int | None = None, skewed: bool = False
) -> Path:
    """Labels depend on three tables and one dense feature, so a few hundred steps learn something.

    `skewed` draws Zipf ids (so some rows are hot, for stale skipping); `nan_row` poisons the dense
    features of the train split from that row on.
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weights = [rng.normal(0, 1.5, s) for s in sizes]
    splits = {"train": n, "val": n // 4, "test": n // 4}
    for name, m in splits.items():
        if skewed:
            sparse = np.stack([np.minimum(rng.zipf(1.5, m) - 1, s - 1) for s in sizes], 1).astype(np.int32)
        else:
            sparse = np.stack([rng.integers(0, s, m) for s in sizes], 1).astype(np.int32)
        dense = np.log1p(rng.exponential(2.0, (m, 13))).astype(np.float32)
        logit = sum(weights[t][sparse[:, t]] for t in range(3)) + 3.0 * (dense[:, 0] - 1.0)
        labels = (rng.random(m) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        if nan_row is not None and name == "train":
            dense[nan_row:] = np.nan
        np.save(root / f"{name}.labels.npy", labels)
        np.save(root / f"{name}.dense.npy", dense)
        np.save(root / f"{name}.sparse.npy", sparse)
    meta = {
        "format": "slipcache-dataset",
        "version": 1,
        "num_dense": 13,
        "num_tables": len(sizes),
        "table_sizes": sizes,
        "splits": splits,
        "positive_rate": 0.5,
        "source": {},
        "vocabulary": "synthetic",
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def tiny_config(data: Path, out: Path, **overrides: object) -> TrainConfig:
    """A run of a few seconds on `make_dataset` data: small MLPs, two epochs, frequent events."""
    values = dict(
        data=str(data), out=str(out), embeddings="torch", embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
        lr=0.3, batch_size=64, epochs=2, log_every=320, eval_every=640, checkpoint_every=640, progress=False,
    )
    values.update(overrides)
    return make_config({}, values)


def record_batches(monkeypatch: Any, when: Callable[[], bool] = lambda: True) -> list[torch.Tensor]:
    """The ids of every batch the trainer trains (while `when()` holds), in order: `train_step` recorded."""
    from slipcache.training import trainer

    seen: list[torch.Tensor] = []
    real_step = trainer.train_step

    def record(run, batch, batches=None):  # noqa: ANN001, ANN202
        if when():
            seen.append(batch.sparse.clone())
        return real_step(run, batch, batches)

    monkeypatch.setattr(trainer, "train_step", record)
    return seen


class FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises: a backward pass that fails midway."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")
