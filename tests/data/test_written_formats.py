"""Parsing the three raw Criteo formats, checked on files the tests write themselves, so that every clone
checks what the tests on the real sample rows check (those need ../shared/data/criteo/ and skip without it):
the ragged Kaggle TSV (trailing empty fields cut off), the Kaggle CSV (header Id,Label,..., CRLF line ends)
and the CSV whose integer features are written as floats; gzip and chunking; preprocessing them."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from slipcache.data.criteo import MISSING, ReadStats, read_chunks
from slipcache.data.dataset import CriteoDataset
from slipcache.data.preprocess import hash_ids, preprocess
from tests.helpers import CriteoRows

ROWS = 700


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[CriteoRows, dict[str, Path]]:
    root = tmp_path_factory.mktemp("formats")
    rows = CriteoRows(n=ROWS, seed=11)
    files = {
        "tsv": rows.write_tsv(root / "train.txt"),
        "kaggle_csv": rows.write_kaggle_csv(root / "train.tiny.csv"),
        "csv": rows.write_float_csv(root / "criteo_sample.txt"),
    }
    return rows, files


def read_all(path: Path, **kwargs: object) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReadStats]:
    stats = ReadStats()
    chunks = list(read_chunks(path, stats=stats, **kwargs))  # type: ignore[arg-type]
    return (*(np.concatenate([getattr(c, f) for c in chunks]) for f in ("labels", "dense", "categorical")), stats)


def test_the_files_look_like_the_real_ones(written: tuple[CriteoRows, dict[str, Path]]) -> None:
    rows, files = written
    tsv_lines = files["tsv"].read_text().splitlines()
    fields = [len(line.split("\t")) for line in tsv_lines]
    assert fields[:-3] == [40] * (ROWS - 3) and fields[-3:] == [38, 37, 15]  # ragged: trailing fields cut off
    raw = files["kaggle_csv"].read_bytes()
    assert raw.startswith(b"Id,Label,I1,") and raw.count(b"\r\n") == ROWS + 1 and raw.count(b"\n") == ROWS + 1
    assert files["csv"].read_text().startswith("label,I1,") and ".0," in files["csv"].read_text()


@pytest.mark.parametrize("fmt", ["tsv", "kaggle_csv", "csv"])
def test_each_format_reads_the_rows_it_holds(fmt: str, written: tuple[CriteoRows, dict[str, Path]]) -> None:
    rows, files = written
    labels, dense, cats, stats = read_all(files[fmt])
    assert stats.formats[str(files[fmt])] == fmt and stats.good == ROWS and stats.bad == 0
    np.testing.assert_array_equal(labels, rows.labels)
    assert set(np.unique(labels)) <= {0.0, 1.0} and int(labels.sum()) == int(rows.labels.sum())
    np.testing.assert_array_equal(dense, rows.dense.astype(np.float32))  # NaN where missing, floats as ints
    np.testing.assert_array_equal(cats, rows.categorical)  # no '\r' left on C26; cut fields read as missing
    assert (cats[-1, 1:] == MISSING).all() and cats[-1, 0] == rows.categorical[-1, 0]
    assert np.isnan(dense).any() and (cats == MISSING).any()


def test_gzip_and_small_chunks_give_the_same_rows(
    written: tuple[CriteoRows, dict[str, Path]], tmp_path: Path
) -> None:
    _, files = written
    for fmt, path in files.items():
        plain = read_all(path)
        packed = tmp_path / f"{fmt}.gz"
        packed.write_bytes(gzip.compress(path.read_bytes()))
        for other in (read_all(packed), read_all(path, chunk_bytes=1000)):
            for a, b in zip(plain[:3], other[:3], strict=True):
                np.testing.assert_array_equal(a, b)


def test_frequency_vocab_and_contiguous_split(written: tuple[CriteoRows, dict[str, Path]], tmp_path: Path) -> None:
    rows, files = written
    meta = preprocess([files["kaggle_csv"]], tmp_path / "ds", progress=False)
    ds = CriteoDataset(tmp_path / "ds")
    n_train = int(ROWS * 0.8)
    assert ds.splits == {"train": n_train, "val": int(ROWS * 0.1), "test": ROWS - n_train - int(ROWS * 0.1)}
    assert meta["vocabulary"] == "frequency" and meta["source"]["good_lines"] == ROWS
    parts = [ds.split(name) for name in ("train", "val", "test")]
    labels, dense, sparse = (np.concatenate([np.asarray(getattr(p, f)) for p in parts])
                             for f in ("labels", "dense", "sparse"))
    np.testing.assert_array_equal(labels, rows.labels)  # contiguous: input order kept
    np.testing.assert_allclose(dense, np.log1p(np.maximum(np.nan_to_num(rows.dense, nan=0.0), 0.0)), rtol=1e-6)
    raw = rows.categorical
    for t in (0, 2, 25):
        train_raw = raw[:n_train, t]
        values, counts = np.unique(train_raw[train_raw != MISSING], return_counts=True)
        assert ds.table_sizes[t] == len(values) + 1
        assert sparse[np.flatnonzero(raw[:, t] == values[np.argmax(counts)])[0], t] == 1  # most frequent: row 1
        assert (sparse[raw[:, t] == MISSING, t] == 0).all()
        assert (sparse[n_train:, t][~np.isin(raw[n_train:, t], values)] == 0).all()  # unseen in train: row 0
        assert (sparse[:, t] < ds.table_sizes[t]).all()


def test_hash_vocab_and_day_split_over_two_formats(
    written: tuple[CriteoRows, dict[str, Path]], tmp_path: Path
) -> None:
    rows, files = written
    gz = tmp_path / "day1.csv.gz"
    gz.write_bytes(gzip.compress(files["csv"].read_bytes()))
    meta = preprocess([files["tsv"], gz], tmp_path / "ds", vocab="hash", max_rows=500, split="days", progress=False)
    ds = CriteoDataset(tmp_path / "ds")
    assert ds.splits == {"train": ROWS, "val": ROWS // 2, "test": ROWS - ROWS // 2}
    assert ds.table_sizes == [500] * 26 and meta["source"]["rows_per_file"] == [ROWS, ROWS]
    assert meta["source"]["formats"] == {str(files["tsv"]): "tsv", str(gz): "csv"}
    sparse = np.concatenate([np.asarray(ds.split(name).sparse) for name in ("train", "val", "test")])
    raw = np.concatenate([rows.categorical, rows.categorical])
    np.testing.assert_array_equal(sparse, hash_ids(raw, 500))
    np.testing.assert_array_equal(sparse[:ROWS], sparse[ROWS:])  # the same rows in two formats: the same ids


def test_a_malformed_written_line_is_named(written: tuple[CriteoRows, dict[str, Path]], tmp_path: Path) -> None:
    _, files = written
    lines = files["kaggle_csv"].read_bytes().split(b"\r\n")
    lines[3] = lines[3].replace(b",", b";", 5)
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\r\n".join(lines))
    labels, _, _, stats = read_all(bad)
    assert len(labels) == ROWS - 1 and stats.bad == 1 and stats.examples[0].startswith(f"{bad}:4: expected 41")
