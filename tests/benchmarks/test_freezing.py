"""Freezing hot rows, the Slipstream studies' research arm (benchmarks/freezing.py): it holds exactly the rows
it chose, the stalest are those that moved least, it joins a run only through `extra_callbacks`, and a run
that froze rows resumes only with the arm passed again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.freezing import FreezeRows, freezing_arm
from slipcache.errors import SlipcacheError
from slipcache.training import trainer as train
from slipcache.training.config import TrainConfig, config_from_saved
from slipcache.training.datasets import open_dataset
from tests.helpers import make_dataset, record_batches, tiny_config

STUDY = dict(stale_hot_share=0.65, batch_size=64, lr=0.3, epochs=1)  # enough hot inputs in the tiny data
WINDOW = dict(stale_preset="paper", stale_window_count="epoch", stale_window_start=0.25, stale_window=0.1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), n=4000, skewed=True)


@pytest.mark.parametrize("mode", ["stalest", "random"])
@pytest.mark.parametrize("embeddings", ["torch", "cached"])
def test_freezing_holds_exactly_the_chosen_rows(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, embeddings: str
) -> None:
    chosen: dict[str, object] = {}
    real_freeze = FreezeRows._freeze

    def freeze(self):  # noqa: ANN001, ANN202
        real_freeze(self)
        chosen["frozen"] = self.frozen.copy()
        chosen["all"] = self.coll.read_rows(torch.arange(int(self.offsets[-1]))).clone()
        chosen["hot"] = self.detector.hot.rows.copy()
        chosen["coll"] = self.coll

    seen = record_batches(monkeypatch, when=lambda: "frozen" in chosen)  # the batches after the freeze
    monkeypatch.setattr(FreezeRows, "_freeze", freeze)
    config = tiny_config(data_dir, tmp_path / "run", embeddings=embeddings, precision="fp32", **WINDOW, **STUDY)
    block = train.train(config, extra_callbacks=[freezing_arm(mode)])["staleness"]
    frozen, before, hot = chosen["frozen"], chosen["all"], chosen["hot"]
    assert block["frozen_rows"] == len(frozen) == round(0.5 * len(hot)) and set(frozen) <= set(hot)
    after = chosen["coll"].read_rows(torch.arange(before.shape[0]))
    unchanged = set(np.flatnonzero((after == before).all(dim=1).numpy()).tolist())
    offsets = np.concatenate([[0], np.cumsum(open_dataset(data_dir).table_sizes)])[:-1]
    looked_up = set(np.unique(torch.cat(seen).numpy() + offsets).tolist())
    assert set(frozen) <= unchanged  # frozen rows kept their values
    assert (unchanged & looked_up) == set(frozen) & looked_up  # every other row that was trained moved
    assert len(set(frozen) & looked_up) > 10  # and the frozen ones were looked up: the hold was tested


def test_freezing_the_stalest_picks_the_rows_that_moved_least(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    picked: dict[str, np.ndarray] = {}
    real_freeze = FreezeRows._freeze

    def freeze(self):  # noqa: ANN001, ANN202
        real_freeze(self)
        change = self.detector.row_score()
        frozen = np.isin(self.detector.hot.rows, self.frozen)
        picked["max_frozen"], picked["min_free"] = change[frozen].max(), change[~frozen].min()

    monkeypatch.setattr(FreezeRows, "_freeze", freeze)
    train.train(tiny_config(data_dir, tmp_path / "run", **WINDOW, **STUDY), extra_callbacks=[freezing_arm("stalest")])
    assert picked["max_frozen"] <= picked["min_free"]


def test_freezing_and_skipping_are_separate_arms(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="separate arms"):
        train.train(tiny_config(data_dir, tmp_path / "a", skip_rule="stale", **WINDOW, **STUDY),
                    extra_callbacks=[freezing_arm("random")])
    with pytest.raises(SlipcacheError, match="needs stale_window_start"):
        train.train(tiny_config(data_dir, tmp_path / "b", **STUDY), extra_callbacks=[freezing_arm("random")])
    with pytest.raises(SlipcacheError, match=r"freeze_share must be in \(0, 1\]"):
        freezing_arm("stalest", 0.0)
    with pytest.raises(SlipcacheError, match="freeze_rows must be one of stalest, random"):
        freezing_arm("warmest")


def test_a_run_that_froze_rows_resumes_only_with_the_arm(data_dir: Path, tmp_path: Path) -> None:
    """Without the arm passed again a resume would train on unfrozen: refused in one line, nothing written."""
    config = tiny_config(data_dir, tmp_path / "run", **WINDOW, **STUDY, samples=1920)
    train.train(config, extra_callbacks=[freezing_arm("stalest")])
    resume = TrainConfig.from_flat({"resume": str(tmp_path / "run"), "samples": 3200, "allow_changes": True,
                                    "progress": False})
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(SlipcacheError, match="holds the state of freezing, which this run lacks"):
        train.train(resume)
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before
    summary = train.train(resume, extra_callbacks=[freezing_arm("stalest")])
    assert summary["staleness"]["frozen_rows"] > 0
    # A run saved while a study's arm was a setting of `slipcache train` is refused rather than trained without
    # it; the arm's "off" value still reads.
    for key, value in (("freeze_rows", "stalest"), ("stale_reweight", True), ("stale_weight_max", 2.0)):
        with pytest.raises(SlipcacheError, match=rf"used {key} {value}, .*\(python -m benchmarks.studies NAME"):
            config_from_saved({**config.flat(), key: value}, "run/config.json")
    assert config_from_saved({**config.flat(), "stale_reweight": False, "stale_weight_max": None}, "x") == config
