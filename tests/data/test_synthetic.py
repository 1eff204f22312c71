"""Synthetic data: determinism, Criteo-like shape, power-law popularity, calibrated teacher."""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data import synthetic
from slipcache.data.batches import BatchIterator
from slipcache.data.dataset import CriteoDataset, SplitArrays
from slipcache.data.stats import compute_stats_arrays
from slipcache.data.synthetic import (
    KAGGLE_CARDINALITIES,
    default_synthetic_path,
    expected_auc,
    generate,
    generate_synthetic,
    synthetic_table_sizes,
    synthetic_window,
)
from slipcache.data.synthetic import cli as synth_cli
from slipcache.errors import SlipcacheError
from slipcache.metrics import auc
from slipcache.training.config import make_config
from tests.helpers import SHARED_CRITEO, SHARED_CRITEO_REASON

SHARED = SHARED_CRITEO
needs_shared = pytest.mark.skipif(
    not (SHARED / "kaggle_train_tiny.csv").is_file(), reason=SHARED_CRITEO_REASON
)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_deterministic_per_seed(tmp_path: Path) -> None:
    def arrays(path: Path) -> list[np.ndarray]:
        ds = CriteoDataset(path)
        return [np.asarray(a) for name in ds.splits
                for a in (ds.split(name).labels, ds.split(name).dense, ds.split(name).sparse)]

    metas = [
        generate_synthetic(tmp_path / name, num_samples=5000, scale=0.001, seed=seed, progress=False)
        for name, seed in (("a", 3), ("b", 3), ("c", 4))
    ]
    a, b, c = (arrays(tmp_path / name) for name in "abc")
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[2], c[2])
    assert metas[0]["generator"] == metas[1]["generator"]


@pytest.mark.slow
def test_default_synthetic_path_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = default_synthetic_path(None, 3000, 0.001, 1, progress=False)
    assert path.parent == tmp_path / "cache" / "synthetic"
    assert CriteoDataset(path).splits["train"] == 2400

    def fail(*args: object, **kwargs: object) -> dict:
        raise AssertionError("regenerated a cached dataset")

    monkeypatch.setattr(generate, "generate_synthetic", fail)
    assert default_synthetic_path(None, 3000, 0.001, 1) == path
    with pytest.raises(AssertionError):
        default_synthetic_path(None, 3000, 0.001, 2)


def test_expected_auc_matches_sampled_labels() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(20_000) * 2
    labels = rng.random(20_000) < 1 / (1 + np.exp(-logits))
    assert abs(expected_auc(logits) - auc(labels, logits)) < 0.02


def run_cli(argv: list[str]) -> int:
    """Our subcommand through its own parser, so the test does not depend on other CLI modules."""
    parser = argparse.ArgumentParser()
    synth_cli.add_synth_arguments(parser)
    return synth_cli.run_synth(parser.parse_args(argv))


@pytest.mark.slow
def test_cli_synth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--out", str(tmp_path / "d"), "--samples", "2000", "--scale", "0.001", "--quiet"]) == 0
    assert "teacher AUC" in capsys.readouterr().out
    assert CriteoDataset(tmp_path / "d").splits == {"train": 1600, "val": 200, "test": 200}
    with pytest.raises(SlipcacheError, match="at least 1"):
        run_cli(["--out", str(tmp_path / "e"), "--samples", "0", "--quiet"])


# ---------------------------------------------------------------------------------------------- v3


def _splits_digest(ds: CriteoDataset) -> hashlib._Hash:
    """sha256 over every split's labels, dense and sparse arrays: a dataset's bytes, in one figure."""
    digest = hashlib.sha256()
    for name in ("train", "val", "test"):
        split = ds.split(name)
        for array in (split.labels, split.dense, split.sparse):
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest


@pytest.mark.slow
def test_v3_big_tables_co_recur_far_above_independent() -> None:
    """C3, C4, C12, C16, C21 are views of one entity: they recur together far more often than the product
    of their recurrence shares (what independent tables give)."""
    ids = synthetic_window(0, 2000, scale=1.0, seed=1)
    co = compute_stats_arrays(ids, missing_value=synthetic.MISSING_ROW)["co_recurrence"]
    assert co["all_recur"] > 0.3 and co["all_recur"] > 5 * co["independent"]


def _unseen_share(first: np.ndarray, later: np.ndarray) -> float:
    """Share of `later`'s lookups whose value never occurs in `first`."""
    return float(1.0 - np.isin(later, first).mean())


@pytest.mark.slow
def test_v3_new_ids_appear_over_time() -> None:
    """Later days bring values unseen on the first day, more so with new entities and drift than without."""
    log = dict(num_samples=700_000, scale=0.01, seed=2)
    unseen = {}
    for rates in ((0.0, 0.0), (0.2, 0.2)):
        kwargs = dict(log, new_entity_rate=rates[0], drift_rate=rates[1])
        first_day = synthetic_window(0, 20_000, **kwargs)[:, 2]  # C3, the user entity
        last_day = synthetic_window(680_000, 20_000, **kwargs)[:, 2]
        next_window = synthetic_window(20_000, 20_000, **kwargs)[:, 2]
        unseen[rates] = (_unseen_share(first_day, next_window), _unseen_share(first_day, last_day))
    stationary, drifting = unseen[(0.0, 0.0)], unseen[(0.2, 0.2)]
    assert abs(stationary[1] - stationary[0]) < 0.03  # without churn a later day looks like the next window
    assert drifting[1] > stationary[1] + 0.1  # with churn, many more of day 7's values are new


@pytest.mark.slow
def test_v3_splits_follow_time(tmp_path: Path) -> None:
    """Train holds the earliest rows of the log, test the latest: the split respects time order."""
    meta = generate_synthetic(tmp_path, num_samples=10_000, scale=0.001, seed=3, progress=False)
    assert meta["time_ordered"] and meta["generator"]["version"] == 5 and meta["missing_row"] == 0
    ds = CriteoDataset(tmp_path)
    n_train, n_val = ds.splits["train"], ds.splits["val"]
    window = dict(num_samples=10_000, scale=0.001, seed=3)
    assert np.array_equal(ds.split("train").sparse[:500], synthetic_window(0, 500, **window))
    assert np.array_equal(
        ds.split("test").sparse, synthetic_window(n_train + n_val, ds.splits["test"], **window)
    )


def test_in_order_shuffle_keeps_windows_in_time_order() -> None:
    """Time-ordered data is shuffled within windows only: window k's samples all come before window k+1's."""
    n = 4096
    dense = np.zeros((n, 13), np.float32)
    dense[:, 0] = np.arange(n)  # each row's position, carried by a dense feature (labels must be 0 or 1)
    split = SplitArrays(np.zeros(n, np.float32), dense, np.zeros((n, 26), np.int32))
    order = np.concatenate(
        [b.dense[:, 0].numpy() for b in BatchIterator(split, 64, shuffle=True, in_order=True, chunk_batches=4)]
    )
    windows = order.reshape(-1, 256)  # chunk = 4 batches of 64
    assert np.array_equal(
        np.sort(windows, axis=1), np.arange(n).reshape(-1, 256)
    )  # each window is its own rows
    assert not np.array_equal(order, np.arange(n))  # shuffled within
    everywhere = np.concatenate(
        [b.dense[:, 0].numpy() for b in BatchIterator(split, 64, shuffle=True, chunk_batches=4)]
    )
    assert not np.array_equal(np.sort(everywhere.reshape(-1, 256), axis=1), np.arange(n).reshape(-1, 256))


def test_generator_choice_errors() -> None:
    with pytest.raises(SlipcacheError, match="generator must be one of"):
        synthetic.make_generator("v9", 0.01, 0, num_samples=100)
    with pytest.raises(SlipcacheError, match="days"):
        synthetic.make_generator("v3", 0.01, 0, num_samples=100, days=0)
    with pytest.raises(SlipcacheError, match="rates"):
        synthetic.make_generator("v3", 0.01, 0, num_samples=100, new_entity_rate=1.5)


@pytest.mark.slow
def test_default_path_keys_on_generator(tmp_path: Path) -> None:
    v5 = default_synthetic_path(tmp_path, 2000, 0.001, 0, progress=False)
    v4 = default_synthetic_path(tmp_path, 2000, 0.001, 0, generator="v4", progress=False)
    v3 = default_synthetic_path(tmp_path, 2000, 0.001, 0, generator="v3", progress=False)
    assert (
        len({v5, v4, v3}) == 3
        and v5.name.startswith("n2000-scale0.001-seed0-v5-")
        and v3.name.startswith("n2000-scale0.001-seed0-v3-")
        and v4.name.startswith("n2000-scale0.001-seed0-v4-")
    )
    assert [CriteoDataset(p).meta["generator"]["version"] for p in (v5, v4, v3)] == [5, 4, 3]


@needs_shared
@pytest.mark.slow
def test_cli_compare(capsys: pytest.CaptureFixture[str]) -> None:
    """`synth --compare` on the shared real rows: v4 and v3 recur together as the real rows do; the signal
    figures (target AUC, dense shapes, ad/site heads, links) tell v4 apart from v3."""
    assert run_cli(["--compare", str(SHARED / "kaggle_train_tiny.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    co = next(line.split() for line in out if line.startswith("big-table co-recurrence"))
    assert co[-3:] == ["ok", "ok", "ok"]  # columns: ... v5, v4, v3 pass
    passed = {g: int(p.split()[1].split("/")[0]) for g, p in
              zip(("v5", "v4", "v3"), out[-1].removeprefix("within tolerance: ").split(", "), strict=True)}
    total = int(out[-1].split("/")[1].split(",")[0])
    assert passed["v5"] >= passed["v4"] >= total - 6
    assert passed["v3"] < passed["v4"] - 20
    for line in out:
        if line.startswith(("link C11->C13", "I2 negative share", "C15 lookups to values seen 2-9")):
            assert line.split()[-3:] == ["ok", "ok", "FAIL"], line  # v5 and v4 ok, v3 not
    big = [line.split() for line in out
           if line.startswith(("C3 ", "C4 ", "C12 ", "C16 ", "C21 ")) and "target AUC" in line]
    assert len(big) == 5 and all(row[-3] == "ok" for row in big)  # v5 within tolerance on every big table


def test_train_picks_the_generator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slipcache train --generator v3` asks for v3 data (v5 by default); an unknown name, or the research
    code's v2, is refused."""
    from slipcache.training.datasets import prepare_data

    asked = []
    monkeypatch.setattr(
        synthetic, "default_synthetic_path", lambda *a, generator, **k: asked.append(generator) or tmp_path
    )
    for flags in ({}, {"synthetic_generator": "v3"}):
        prepare_data(make_config({}, flags), tmp_path)
    assert asked == ["v5", "v3"]
    for name in ("v9", "v2"):
        with pytest.raises(SlipcacheError, match=r"--generator \(synthetic_generator\) must be one of"):
            make_config({}, {"synthetic_generator": name})


@pytest.mark.slow
def test_v3_reproduces_earlier_output(tmp_path: Path) -> None:
    """`--generator v3` writes exactly what v3 wrote before v4 became the default."""
    generate_synthetic(tmp_path, num_samples=70000, scale=0.01, seed=3, generator="v3", progress=False)
    ds = CriteoDataset(tmp_path)
    digest = _splits_digest(ds)
    assert digest.hexdigest()[:16] == "856ab8a386553c3a"


def test_v4_reproduces_earlier_output(tmp_path: Path) -> None:
    """`--generator v4` writes exactly what v4 wrote before v5 became the default."""
    generate_synthetic(tmp_path, num_samples=70000, scale=0.01, seed=3, generator="v4", progress=False)
    assert _splits_digest(CriteoDataset(tmp_path)).hexdigest()[:16] == "a07c0c1b30440670"


@pytest.mark.slow
def test_v5_is_the_default_and_its_big_tables_carry_more_signal_than_v4s() -> None:
    """On 1,999-row windows (the real sample's size) of 4 seeds, v5's big tables' target AUC lies above
    v4's, near the real rows' 0.58-0.62; the teacher's own AUC target is unchanged."""
    from slipcache.data.stats.signal import target_auc
    from slipcache.data.synthetic import DEFAULT_GENERATOR, synthetic_rows

    assert DEFAULT_GENERATOR == "v5"
    big = {}
    for gen in ("v5", "v4"):
        aucs = []
        for seed in range(4):
            _, ids, labels = synthetic_rows(0, 1999, generator=gen, seed=seed, num_samples=45_840_617)
            aucs += [target_auc(ids[:, t], labels) for t in (2, 3, 11, 15, 20)]
        big[gen] = float(np.mean(aucs))
    assert big["v5"] > big["v4"] + 0.015 and 0.57 < big["v5"] < 0.62, big


@pytest.mark.slow
def test_v4_puts_signal_shapes_and_links_where_real_rows_have_them() -> None:
    """On 60 k rows: big tables' per-value mean label predicts later rows (v3's barely), dense features
    have zeros and I2 negatives, C11 determines C13, the C19 missing group follows the user (C3)."""
    from slipcache.data.stats import compute_stats_arrays
    from slipcache.data.synthetic import MISSING_ROW, synthetic_rows

    figures = {}
    for gen in ("v4", "v3"):
        dense, ids, labels = synthetic_rows(0, 60_000, generator=gen, scale=0.05, seed=1)
        figures[gen] = compute_stats_arrays(ids, dense, labels, missing_value=MISSING_ROW, chunk_rows=20_000)
    big = [t["target_auc"] for t in figures["v4"]["tables"] if t["name"] in ("C3", "C4", "C12", "C16", "C21")]
    big_v3 = [t["target_auc"] for t in figures["v3"]["tables"] if t["name"] in ("C3", "C4", "C12", "C16", "C21")]
    assert min(big) > 0.55 and np.mean(big) > np.mean(big_v3) + 0.03
    dense = {d["name"]: d for d in figures["v4"]["dense"]}
    assert 0.4 < dense["I1"]["zero_share"] < 0.55 and 0.07 < dense["I2"]["negative_share"] < 0.15
    links = {(lk["from"], lk["to"]): lk for lk in figures["v4"]["links"]}
    assert links["C11", "C13"]["purity"] > 0.95 and links["C3", "C19"]["purity"] > 0.9
    assert links["C3", "C15"]["purity"] > links["C3", "C15"]["chance"] + 0.1


@pytest.mark.usefixtures("private_cache_dir")
def test_synth_force_into_another_format_replaces_the_dataset_whole(tmp_path: Path) -> None:
    from slipcache.data.formats import open_any

    out = tmp_path / "data"
    common = ["--samples", "4000", "--scale", "0.001", "--no-progress"]
    assert main(["synth", "--out", str(out), *common]) == 0
    assert (out / "train.labels.npy").exists()
    (out / "NOTES.md").write_text("mine\n")
    assert main(["synth", "--out", str(out), "--format", "torchrec", "--force", *common, "--seed", "1"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert not [n for n in names if n.startswith(("train.", "val.", "test.")) or n == "meta.json"], names
    assert "NOTES.md" in names and "synthetic.json" in names  # a user's file is never ours to remove
    assert type(open_any(out)).__name__ == "ExternalDataset"  # what trains is the new dataset
    (out / "NOTES.md").unlink()  # (a TorchRec-layout directory with other files is not taken as a dataset)
    assert main(["synth", "--out", str(out), "--force", *common]) == 0  # and back
    assert not [n for n in os.listdir(out) if n.startswith("day_") or n == "synthetic.json"]

