"""Synthetic data at any scale: named and explicit table sizes, bounded memory, TorchRec's day files."""

import hashlib
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from slipcache.data.dataset import CriteoDataset
from slipcache.data.formats import open_any
from slipcache.data.presets import MLPERF_SIZES, parse_table_sizes
from slipcache.data.streaming import NpyAppender, StreamingDatasetWriter
from slipcache.data.synthetic import generate as generate_module
from slipcache.data.synthetic.generate import generate_synthetic
from slipcache.data.synthetic.teacher import KAGGLE_CARDINALITIES
from slipcache.data.synthetic.v3 import GeneratorV3, roles_by_size
from slipcache.errors import SlipcacheError


def _digest(path: Path) -> str:
    ds, digest = CriteoDataset(path), hashlib.sha256()
    for name in ("train", "val", "test"):
        split = ds.split(name)
        for array in (split.labels, split.dense, split.sparse):
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def test_v3_output_at_todays_sizes_stays_bit_for_bit(tmp_path: Path) -> None:
    """The streaming writer and explicit sizes change nothing for the scaled Kaggle sizes (digest of the
    data the memory-mapped writer wrote before)."""
    meta = generate_synthetic(tmp_path, num_samples=70000, scale=0.002, seed=5, generator="v3", progress=False)
    assert _digest(tmp_path) == "dd433ffc17855025"
    assert meta["teacher_auc"] == pytest.approx(0.8082765020972208)


def test_kaggle_sizes_given_explicitly_take_their_own_roles() -> None:
    assert list(roles_by_size(list(KAGGLE_CARDINALITIES))) == list(range(26))
    columns = roles_by_size(MLPERF_SIZES)
    assert MLPERF_SIZES[columns[2]] == 40_000_000  # the user entity's root (Kaggle's C3) is a 40 M table
    with pytest.raises(SlipcacheError, match="at least 2 rows"):
        roles_by_size([1] * 26)


def test_mlperf_preset_ids_stay_inside_their_tables() -> None:
    assert parse_table_sizes("mlperf") == MLPERF_SIZES and sum(MLPERF_SIZES) == 204_184_588
    assert parse_table_sizes("3,4") == [3, 4]
    gen = GeneratorV3(1.0, 0, num_samples=100_000, table_sizes=MLPERF_SIZES)
    _, ids, _ = gen.sample(np.random.default_rng(0), 0, 20_000)
    assert (ids >= 0).all() and (ids < np.array(MLPERF_SIZES)).all()
    big = [t for t, n in enumerate(MLPERF_SIZES) if n == 40_000_000]
    assert min(len(np.unique(ids[:, t])) for t in big) > 1000  # the big tables are used, not a few rows
    # the structure holds: the 40 M tables that view the user entity recur together
    assert gen.describe()["table_sizes"] == MLPERF_SIZES


@pytest.mark.slow
def test_generation_memory_does_not_grow_with_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak Python/numpy allocations writing 4x the rows stay those of one chunk (tracemalloc counts
    numpy's buffers); rows are appended to files, never mapped."""
    monkeypatch.setattr(generate_module, "CHUNK_ROWS", 2048)
    monkeypatch.setattr(generate_module, "TEACHER_AUC_ROWS", 1000)
    opened: list[object] = []
    real_open = StreamingDatasetWriter._open_array
    monkeypatch.setattr(
        StreamingDatasetWriter, "_open_array", lambda self, *a: opened.append(real_open(self, *a)) or opened[-1]
    )
    peaks = []
    for rows in (20_000, 80_000):
        tracemalloc.start()
        meta = generate_synthetic(tmp_path / str(rows), num_samples=rows, scale=0.001, progress=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert meta["teacher_auc_rows"] == 1000 and meta["splits"]["train"] == rows * 8 // 10
    assert all(isinstance(a, NpyAppender) for a in opened)
    # the dataset grew by 60,000 rows x 160 bytes = 9.6 MB; the peak by far less
    assert peaks[1] - peaks[0] < 2_000_000, peaks


def test_torchrec_layout_holds_the_same_rows(tmp_path: Path) -> None:
    ours = generate_synthetic(tmp_path / "ours", num_samples=30_000, scale=0.002, seed=3, progress=False)
    theirs = generate_synthetic(
        tmp_path / "trec", num_samples=30_000, scale=0.002, seed=3, progress=False, layout="torchrec"
    )
    files = sorted(p.name for p in (tmp_path / "trec").iterdir())
    assert files[:3] == ["day_0_dense.npy", "day_0_labels.npy", "day_0_sparse.npy"] and "day_6_sparse.npy" in files
    assert np.load(tmp_path / "trec" / "day_0_sparse.npy").dtype == np.int64
    assert np.load(tmp_path / "trec" / "day_0_labels.npy").shape[1] == 1
    external = open_any(tmp_path / "trec", table_sizes=ours["table_sizes"])
    native = CriteoDataset(tmp_path / "ours")
    assert external.splits == native.splits and theirs["splits"] == ours["splits"]
    for name in ("train", "val", "test"):
        a, b = external.split(name), native.split(name)
        assert np.array_equal(np.asarray(a.sparse[0 : len(a.sparse)]), np.asarray(b.sparse))
        assert np.array_equal(np.asarray(a.labels[0 : len(a.labels)]), np.asarray(b.labels))
        assert np.array_equal(np.asarray(a.dense[0 : len(a.dense)]), np.asarray(b.dense))
