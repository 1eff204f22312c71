"""Slipstream on its authors' schedule: the cold-first order, the window at a fixed batch, the summary's
schedule fields, and the paper preset's precedence."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from slipcache.data.batches import BatchIterator
from slipcache.staleness.order import HotInputs
from slipcache.training import trainer as train
from slipcache.training.config import make_config
from slipcache.training.datasets import open_dataset
from tests.helpers import make_dataset, record_batches, tiny_config

SCHEDULE_KEYS = {"order", "window_start_batch", "window_batches", "hot_input_share", "threshold", "skipped_fraction"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), n=4000, skewed=True)


def _positions(batches: BatchIterator) -> list[np.ndarray]:
    """The split positions of each batch, read back from a split whose dense column 0 is the position."""
    return [b.dense[:, 0].numpy().astype(np.int64) for b in batches]


class _Split:
    def __init__(self, n: int) -> None:
        self.labels = np.zeros(n, np.float32)
        self.dense = np.repeat(np.arange(n, dtype=np.float32)[:, None], 13, axis=1)
        self.sparse = np.zeros((n, 26), np.int32)

    def __len__(self) -> int:
        return len(self.labels)


@pytest.mark.parametrize("in_order", [False, True])
def test_groups_visit_every_row_of_group_0_before_any_of_group_1(in_order: bool) -> None:
    n, batch = 1000, 16
    split = _Split(n)
    groups = (np.random.default_rng(1).random(n) < 0.3).astype(np.uint8)
    plain = np.concatenate(_positions(BatchIterator(split, batch, shuffle=True, in_order=in_order, seed=4,
                                                    chunk_batches=4)))
    ordered = np.concatenate(_positions(BatchIterator(split, batch, shuffle=True, in_order=in_order, seed=4,
                                                      chunk_batches=4, groups=groups, drop_last=False)))
    assert sorted(ordered.tolist()) == list(range(n))  # every row once
    cold = int(np.count_nonzero(groups == 0))
    assert (groups[ordered[:cold]] == 0).all() and (groups[ordered[cold:]] == 1).all()
    # each group keeps the epoch's own order
    for g in (0, 1):
        assert ordered[groups[ordered] == g].tolist() == plain[groups[plain] == g].tolist()


@pytest.mark.parametrize("with_filter", [False, True])
def test_groups_resume_mid_epoch_with_the_same_batches(with_filter: bool) -> None:
    n, batch = 1000, 16
    split = _Split(n)
    groups = (np.arange(n) % 3 == 0).astype(np.uint8)

    def keep_all(sparse: np.ndarray) -> np.ndarray:
        return np.ones(sparse.shape[0], bool)

    kwargs = dict(shuffle=True, seed=2, chunk_batches=4, groups=groups, drop_last=True,
                  sample_filter=keep_all if with_filter else None)
    whole = _positions(BatchIterator(split, batch, **kwargs))
    resumed = _positions(BatchIterator(split, batch, start_batch=23, **kwargs))
    assert len(resumed) == len(whole) - 23
    assert all((a == b).all() for a, b in zip(whole[23:], resumed, strict=True))


def test_groups_must_cover_the_split() -> None:
    with pytest.raises(Exception, match="one value per row"):
        BatchIterator(_Split(10), 4, groups=np.zeros(9, np.uint8))


def _hot_inputs(config, data_dir: Path) -> HotInputs:  # noqa: ANN001
    """The hot inputs of epoch 0, computed apart from the run."""
    dataset = open_dataset(data_dir)
    hot = HotInputs(config, dataset.split("train"), list(dataset.table_sizes), config.model.embedding_dim)
    hot.start_epoch(0)
    return hot


STUDY = dict(stale_hot_share=0.65, batch_size=64, lr=0.3, epochs=1)  # enough hot inputs in the tiny data


def test_cold_first_trains_every_cold_input_before_any_hot_one(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = record_batches(monkeypatch)
    config = tiny_config(data_dir, tmp_path / "run", input_order="cold_first", **STUDY)
    summary = train.train(config)
    hot = _hot_inputs(config, data_dir)
    assert 0.2 < hot.hot_share < 0.8  # both parts are there to be ordered
    flags = hot.detector.hot_input_mask(torch.cat(seen).numpy().astype(np.int32))
    first_hot = int(np.argmax(flags))
    assert not flags[:first_hot].any() and flags[first_hot:].all()  # cold, then hot: no cold input after
    assert first_hot == hot.cold_count  # every cold input was trained first (full batches only drop the tail)
    block = summary["staleness"]
    assert set(block) >= SCHEDULE_KEYS and block["order"] == "cold_first"
    assert block["hot_input_share"] == pytest.approx(hot.hot_share)
    assert all(block[k] is None for k in SCHEDULE_KEYS - {"order", "hot_input_share"})  # no window opened


@pytest.mark.parametrize("rule", ["stale", "random"])
def test_the_window_opens_where_the_paper_rule_says(data_dir: Path, tmp_path: Path, rule: str) -> None:
    config = tiny_config(data_dir, tmp_path / "run", stale_preset="paper", skip_rule=rule, stale_target=0.5,
                         stale_window_start=0.25, stale_window=0.2, **STUDY)
    assert config.skipping.stale_window_count == "hot" and config.skipping.input_order == "cold_first"
    summary = train.train(config)
    hot = _hot_inputs(config, data_dir)
    hot_batches = hot.hot_count // 64
    block = summary["staleness"]
    assert block["window_start_batch"] == math.ceil(hot.cold_count / 64) + round(0.25 * hot_batches)
    assert block["window_batches"] == max(1, round(0.2 * hot_batches))
    assert block["warm_at"]["batch"] == block["window_start_batch"]
    assert block["order"] == "cold_first" and block["hot_input_share"] == pytest.approx(hot.hot_share)
    assert block["skipped_fraction"] == pytest.approx(block["inputs_skipped"] / block["inputs_seen"])
    if rule == "random":
        assert block["inputs_skipped"] > 0


def test_the_window_start_is_capped_in_batches(data_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(data_dir, tmp_path / "run", stale_preset="paper", skip_rule="stale",
                         stale_window_start=0.5, stale_window_start_max=3, **STUDY)
    summary = train.train(config)
    hot = _hot_inputs(config, data_dir)
    assert summary["staleness"]["window_start_batch"] == math.ceil(hot.cold_count / 64) + 3


def test_a_window_counted_in_the_epoch_opens_at_its_share_of_the_batches(data_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(data_dir, tmp_path / "run", input_order="cold_first", skip_rule="random",
                         stale_window_count="epoch", stale_window_start=0.25, stale_window=0.1, **STUDY)
    block = train.train(config)["staleness"]
    assert block["window_start_batch"] == round(0.25 * 62) and block["window_batches"] == round(0.1 * 62)


def test_schedule_fields_are_null_when_no_window_opened(data_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(data_dir, tmp_path / "run", stale_preset="paper", skip_rule="stale",
                         stale_window_count="epoch", stale_window_start=0.5, samples=64 * 10, **STUDY)
    block = train.train(config)["staleness"]
    assert set(block) >= SCHEDULE_KEYS and block["order"] == "cold_first"
    assert all(block[k] is None for k in ("window_start_batch", "window_batches", "threshold", "skipped_fraction"))


def test_the_paper_preset_overrides_quick_and_flags_override_the_preset() -> None:
    config = make_config({}, {"quick": True, "stale_preset": "paper"})
    schedule = config.schedule
    assert (schedule.batch_size, config.embeddings.lr, schedule.epochs, schedule.samples) == (1024, 0.01, 1, None)
    assert config.skipping.input_order == "cold_first" and config.skipping.stale_window_count == "hot"
    assert config.data.synthetic_samples == 800_000  # what the preset does not set stays --quick's
    config = make_config({"lr": 0.05}, {"quick": True, "stale_preset": "paper", "batch_size": 512})
    assert (config.schedule.batch_size, config.embeddings.lr) == (512, 0.05)  # a file's and a flag's values win


def test_a_window_counted_in_hot_batches_needs_the_cold_first_order(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="cold_first"):
        tiny_config(data_dir, tmp_path / "run", skip_rule="stale", stale_window_count="hot", stale_window_start=0.1)
