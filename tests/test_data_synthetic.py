"""Synthetic data: determinism, Criteo-like shape, power-law popularity, calibrated teacher."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from slipcache.data import synthetic
from slipcache.data.dataset import BatchIterator, CriteoDataset
from slipcache.data.synthetic import (
    KAGGLE_CARDINALITIES,
    auc,
    default_synthetic_path,
    expected_auc,
    generate_synthetic,
    synthetic_table_sizes,
)
from slipcache.errors import SlipcacheError


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("synth") / "ds"
    meta = generate_synthetic(path, num_samples=200_000, scale=0.01, seed=0, progress=False)
    return path, meta


def test_table_sizes() -> None:
    assert synthetic_table_sizes(1.0) == KAGGLE_CARDINALITIES
    small = synthetic_table_sizes(0.01)
    assert small[8] == 3 and small[19] == 4 and small[5] == 24  # tiny tables keep their size
    assert small[2] == 101312 and small[0] == 100  # big ones shrink, not below 100
    with pytest.raises(SlipcacheError):
        synthetic_table_sizes(0.0)


def test_format_and_meta(small: tuple[Path, dict]) -> None:
    path, meta = small
    ds = CriteoDataset(path)
    assert ds.splits == {"train": 160_000, "val": 20_000, "test": 20_000}
    assert ds.table_sizes == synthetic_table_sizes(0.01)
    assert meta["vocabulary"] == "synthetic"
    assert meta["generator"]["seed"] == 0 and meta["generator"]["num_samples"] == 200_000
    train = ds.split("train")
    assert (train.sparse >= 0).all() and (train.sparse < np.array(ds.table_sizes)).all()
    assert set(np.unique(train.labels[:1000])) <= {0.0, 1.0}
    assert (train.dense >= 0).all() and np.isfinite(train.dense).all()
    # Dense features look like log1p of skewed counts, with a share of zeros (missing or zero counts).
    assert 0.05 < (train.dense[:, 0] == 0).mean() < 0.9
    assert train.dense.max() > 5
    batch = next(BatchIterator(train, 256))
    assert batch.sparse.shape == (256, 26)


def test_positive_rate_and_teacher_auc(small: tuple[Path, dict]) -> None:
    path, meta = small
    assert abs(meta["positive_rate"] - 0.256) <= 0.02
    for rate in meta["split_positive_rate"].values():
        assert abs(rate - 0.256) <= 0.02
    assert 0.74 <= meta["teacher_auc"] <= 0.85
    labels = np.asarray(CriteoDataset(path).split("train").labels)
    assert abs(labels.mean() - meta["split_positive_rate"]["train"]) < 1e-9


def test_power_law_popularity(small: tuple[Path, dict]) -> None:
    path, _ = small
    ds = CriteoDataset(path)
    ids = np.asarray(ds.split("train").sparse[:, 2])
    size = ds.table_sizes[2]
    counts = np.bincount(ids, minlength=size)
    top = np.sort(counts)[::-1][: size // 100]
    assert top.sum() / counts.sum() > 0.4  # top 1% of rows take a large share of lookups
    hottest = np.argsort(counts)[::-1][: size // 100]
    assert (hottest < size // 10).mean() < 0.3  # hot rows are spread over the table, not the low ids


def test_deterministic_per_seed(tmp_path: Path) -> None:
    def arrays(path: Path) -> list[np.ndarray]:
        ds = CriteoDataset(path)
        return [np.asarray(a) for name in ds.splits for a in vars(ds.split(name)).values()]

    metas = [
        generate_synthetic(tmp_path / name, num_samples=5000, scale=0.001, seed=seed, progress=False)
        for name, seed in (("a", 3), ("b", 3), ("c", 4))
    ]
    a, b, c = (arrays(tmp_path / name) for name in "abc")
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[2], c[2])
    assert metas[0]["generator"] == metas[1]["generator"]


def test_default_synthetic_path_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = default_synthetic_path(None, 3000, 0.001, 1, progress=False)
    assert path.parent == tmp_path / "cache" / "synthetic"
    assert CriteoDataset(path).splits["train"] == 2400

    def fail(*args: object, **kwargs: object) -> dict:
        raise AssertionError("regenerated a cached dataset")

    monkeypatch.setattr(synthetic, "generate_synthetic", fail)
    assert default_synthetic_path(None, 3000, 0.001, 1) == path
    with pytest.raises(AssertionError):
        default_synthetic_path(None, 3000, 0.001, 2)


def test_auc_helpers() -> None:
    assert auc(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 0, 1, 1])) == 1.0
    assert auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(20_000) * 2
    labels = rng.random(20_000) < 1 / (1 + np.exp(-logits))
    assert abs(expected_auc(logits) - auc(logits, labels)) < 0.02


def run_cli(argv: list[str]) -> int:
    """Our subcommand through its own parser, so the test does not depend on other CLI modules."""
    parser = argparse.ArgumentParser()
    synthetic.add_synth_arguments(parser)
    return synthetic.run_synth(parser.parse_args(argv))


def test_cli_synth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--out", str(tmp_path / "d"), "--samples", "2000", "--scale", "0.001", "--quiet"]) == 0
    assert "teacher AUC" in capsys.readouterr().out
    assert CriteoDataset(tmp_path / "d").splits == {"train": 1600, "val": 200, "test": 200}
    with pytest.raises(SlipcacheError, match="at least 1"):
        run_cli(["--out", str(tmp_path / "e"), "--samples", "0", "--quiet"])
