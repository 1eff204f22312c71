"""One training order: the trainer, `bench cache` and `bench train` read batches from `training_batches`."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from slipcache.bench.cache import dataset_trace
from slipcache.data.batches import BatchIterator
from slipcache.training import trainer as train
from slipcache.training.datasets import open_dataset, training_batches
from tests.helpers import make_dataset, record_batches
from tests.helpers import tiny_config as tiny


@pytest.fixture(scope="module")
def time_ordered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_dataset(tmp_path_factory.mktemp("ordered"), n=64 * 64 * 3)  # three windows of 64 batches
    meta = json.loads((root / "meta.json").read_text())
    (root / "meta.json").write_text(json.dumps({**meta, "time_ordered": True}))
    return root


def test_time_ordered_data_keeps_its_windows_in_order(time_ordered: Path) -> None:
    dataset = open_dataset(time_ordered)
    ordered = [b.sparse for b in training_batches(dataset, 64, seed=0, epoch=0)]
    within = [b.sparse for b in BatchIterator(dataset.split("train"), 64, shuffle=True, in_order=True, seed=0)]
    across = [b.sparse for b in BatchIterator(dataset.split("train"), 64, shuffle=True, seed=0)]
    assert all(torch.equal(a, b) for a, b in zip(ordered, within, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ordered, across, strict=True))  # a global shuffle differs


def test_bench_cache_replays_the_training_order(time_ordered: Path) -> None:
    trace = dataset_trace(str(time_ordered), 64, batches=10, warmup=2, seed=3)
    expected = [b.sparse for b in islice(training_batches(open_dataset(time_ordered), 64, seed=3, epoch=0), 10)]
    assert torch.equal(trace.batches, torch.stack(expected))


def test_the_trainer_trains_in_that_order(time_ordered: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = record_batches(monkeypatch)
    train.train(tiny(time_ordered, tmp_path / "run", epochs=1, samples=64 * 20))
    expected = [b.sparse for b in islice(training_batches(open_dataset(time_ordered), 64, seed=0, epoch=0), 20)]
    assert len(seen) == 20 and all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))
