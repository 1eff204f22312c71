"""`slipcache preprocess`: vocabularies, splits, the dense transform, errors and atomic output."""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data import preprocess as pp
from slipcache.data import preprocess_cli
from slipcache.data.criteo import MISSING, read_chunks
from slipcache.data.dataset import CriteoDataset, DatasetWriter
from slipcache.data.preprocess import hash_ids, parse_split, preprocess
from slipcache.errors import SlipcacheError
from tests.helpers import SHARED_CRITEO, SHARED_CRITEO_REASON, cli_fails, cli_fails_in_one_line

SHARED = SHARED_CRITEO
TSV = SHARED / "kaggle_train_head.tsv"
CSV = SHARED / "kaggle_train_tiny.csv"
needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=SHARED_CRITEO_REASON,
)


def raw_rows(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = list(read_chunks(path))
    return tuple(np.concatenate([getattr(c, f) for c in chunks]) for f in ("labels", "dense", "categorical"))  # type: ignore[return-value]


def all_splits(ds: CriteoDataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parts = [ds.split(name) for name in ("train", "val", "test")]
    return tuple(np.concatenate([getattr(p, f) for p in parts]) for f in ("labels", "dense", "sparse"))  # type: ignore[return-value]


def check_ids_in_range(ds: CriteoDataset) -> None:
    for name in ds.splits:
        sparse = np.asarray(ds.split(name).sparse)
        assert (sparse >= 0).all() and (sparse < np.array(ds.table_sizes)).all()


@needs_shared
def test_frequency_vocab_and_contiguous_split(tmp_path: Path) -> None:
    meta = preprocess([TSV], tmp_path / "ds", progress=False)
    ds = CriteoDataset(tmp_path / "ds")
    assert ds.splits == {"train": 800, "val": 100, "test": 100} == meta["splits"]
    assert meta["vocabulary"] == "frequency" and meta["source"]["good_lines"] == 1000
    check_ids_in_range(ds)
    labels, dense, raw = raw_rows(TSV)
    got_labels, got_dense, sparse = all_splits(ds)
    np.testing.assert_array_equal(got_labels, labels)  # contiguous: input order is kept
    expected_dense = np.log1p(np.maximum(np.nan_to_num(dense, nan=0.0), 0.0))
    np.testing.assert_allclose(got_dense, expected_dense, rtol=1e-6)
    assert got_dense[0, 4] == pytest.approx(np.log(1383.0)) and got_dense[0, 11] == 0.0

    vocab = np.load(tmp_path / "ds" / "vocab.npz")
    for t in (0, 2, 21):
        train_raw = raw[:800, t]
        values, counts = np.unique(train_raw[train_raw != MISSING], return_counts=True)
        assert ds.table_sizes[t] == len(values) + 1
        # Row 1 is the most frequent train value; rows follow descending frequency.
        assert sparse[np.flatnonzero(raw[:, t] == values[np.argmax(counts)])[0], t] == 1
        id_counts = np.bincount(sparse[:800, t], minlength=ds.table_sizes[t])[1:]
        assert (np.diff(id_counts) <= 0).all()
        np.testing.assert_array_equal(vocab[f"t{t}"], values)
        assert (sparse[raw[:, t] == MISSING, t] == 0).all()  # missing -> unknown row 0
        unseen = ~np.isin(raw[800:, t], values)
        assert (sparse[800:, t][unseen] == 0).all()  # values never seen in train -> row 0
        same = raw[:, t] == raw[0, t]
        assert (sparse[same, t] == sparse[0, t]).all()


@needs_shared
def test_min_count_maps_rare_values_to_unknown(tmp_path: Path) -> None:
    preprocess([TSV], tmp_path / "ds", min_count=3, split="1,0,0", progress=False)
    ds = CriteoDataset(tmp_path / "ds")
    assert ds.splits == {"train": 1000, "val": 0, "test": 0}
    _, _, raw = raw_rows(TSV)
    sparse = np.asarray(ds.split("train").sparse)
    for t in (2, 9):
        values, inverse, counts = np.unique(raw[:, t], return_inverse=True, return_counts=True)
        rare = (counts[inverse] < 3) | (raw[:, t] == MISSING)
        assert (sparse[rare, t] == 0).all() and (sparse[~rare, t] > 0).all()
        assert ds.table_sizes[t] == int(((counts >= 3) & (values != MISSING)).sum()) + 1


@needs_shared
def test_hash_vocab_and_day_split(tmp_path: Path) -> None:
    gz = tmp_path / "day1.csv.gz"
    gz.write_bytes(gzip.compress(CSV.read_bytes()))
    meta = preprocess([TSV, gz], tmp_path / "ds", vocab="hash", max_rows=500, split="days", progress=False)
    ds = CriteoDataset(tmp_path / "ds")
    assert ds.splits == {"train": 1000, "val": 999, "test": 1000}
    assert ds.table_sizes == [500] * 26 and meta["max_rows"] == 500
    assert meta["source"]["rows_per_file"] == [1000, 1999]
    assert not (tmp_path / "ds" / "vocab.npz").exists()
    check_ids_in_range(ds)
    _, _, sparse = all_splits(ds)
    raw = np.concatenate([raw_rows(TSV)[2], raw_rows(CSV)[2]])
    np.testing.assert_array_equal(sparse, hash_ids(raw, 500))
    assert (sparse[raw == MISSING] == 0).all() and (sparse[raw != MISSING] > 0).all()
    # The first 1000 rows of the CSV are the TSV's rows: same raw values, same ids.
    np.testing.assert_array_equal(sparse[:1000], sparse[1000:2000])


def test_hash_ids_spread_and_seed() -> None:
    raw = np.arange(100_000, dtype=np.int64).reshape(-1, 1)
    ids = hash_ids(raw, 1000)
    counts = np.bincount(ids.ravel(), minlength=1000)
    assert counts[0] == 0 and counts[1:].min() > 50
    assert not np.array_equal(ids, hash_ids(raw, 1000, seed=1))


def test_parse_split() -> None:
    assert parse_split("0.8,0.1,0.1") == (0.8, 0.1, 0.1)
    assert parse_split("days") == "days"
    assert parse_split((1, 0, 0)) == (1.0, 0.0, 0.0)
    for bad in ("0.8,0.1", "0.5,0.5,0.5", "a,b,c", "-0.1,0.6,0.5"):
        with pytest.raises(SlipcacheError, match="--split"):
            parse_split(bad)


def test_errors_leave_no_dataset(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("0\t1\t2\n\nxyz\n")
    out = tmp_path / "out"
    with pytest.raises(
        SlipcacheError, match=r"no valid rows .*3 malformed lines.*bad.tsv:1: expected 15 to 40"
    ):
        preprocess([bad], out, progress=False)
    assert not out.exists()  # the directory it made is removed again
    with pytest.raises(SlipcacheError, match=rf"{bad}:1: expected"):
        preprocess([bad], out, strict=True, progress=False)
    with pytest.raises(SlipcacheError, match="no such file"):
        preprocess([tmp_path / "missing.tsv"], out, progress=False)
    with pytest.raises(SlipcacheError, match="at least two input files"):
        preprocess([bad], out, split="days", progress=False)
    with pytest.raises(SlipcacheError, match="--vocab"):
        preprocess([bad], out, vocab="nope", progress=False)
    assert not out.exists()


def test_crash_before_commit_leaves_no_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "good.tsv"
    line = "\t".join(["1"] + ["5"] * 13 + ["0000abcd"] * 26)
    good.write_text((line + "\n") * 20)
    preprocess([good], tmp_path / "out", progress=False)
    assert CriteoDataset(tmp_path / "out").splits["train"] == 16

    def crash(self: DatasetWriter, meta: dict) -> dict:
        raise OSError("disk full")

    monkeypatch.setattr(DatasetWriter, "commit", crash)
    with pytest.raises(OSError, match="disk full"):
        preprocess([good], tmp_path / "out", split="0.5,0.5,0", progress=False)
    # The old dataset is still whole, and no temporary directories are left.
    assert CriteoDataset(tmp_path / "out").splits["train"] == 16
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".tmp")]


def test_cli_reports_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "mixed.tsv"
    line = "\t".join(["0"] + ["2"] * 13 + ["0000abcd"] * 26)
    data.write_text((line + "\n") * 9 + "oops\n" + line + "\n")
    parser = argparse.ArgumentParser()
    preprocess_cli.add_preprocess_arguments(parser)
    args = parser.parse_args(
        [str(data), "--out", str(tmp_path / "ds"), "--vocab", "hash", "--max-rows", "64", "--quiet"]
    )
    assert preprocess_cli.run_preprocess(args) == 0
    out = capsys.readouterr().out
    assert "good lines: 10, bad lines: 1" in out
    assert f"{data}:10: expected 15 to 40 fields, found 1" in out
    assert CriteoDataset(tmp_path / "ds").table_sizes == [64] * 26


def test_scratch_of_a_killed_preprocess_is_removed_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited: what a kill -9 leaves
    out = tmp_path / "out"
    (out / f".tmp-{pid}-raw-abc123").mkdir(parents=True)
    (out / f".tmp-{pid}-raw-abc123" / "cats").write_bytes(b"\0" * 1000)
    good = tmp_path / "good.tsv"
    good.write_text(("\t".join(["1"] + ["5"] * 13 + ["0000abcd"] * 26) + "\n") * 20)
    real_read = pp.read_chunks

    def read_after_cleanup(*args: object, **kwargs: object) -> object:
        # Gone before parsing starts, not only when the new dataset is written: they hold hundreds of MB.
        assert not (out / f".tmp-{pid}-raw-abc123").exists()
        return real_read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pp, "read_chunks", read_after_cleanup)
    preprocess([good], out, progress=False)
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]


def test_missing_input_creates_no_output_directory(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="missing.tsv: no such file"):
        preprocess([tmp_path / "missing.tsv"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@needs_shared
def test_hashed_tables_far_larger_than_the_data_are_warned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preprocess([TSV], tmp_path / "big", vocab="hash", max_rows=10_000_000, progress=False)
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "warning: --max-rows 10,000,000 gives every table 10,000,000 rows" in warning
    distinct = max(len(np.unique(column)) for column in hash_ids(raw_rows(TSV)[2], 10_000_000).T)
    assert f"at most {distinct:,} distinct values in a table (1,000 rows)" in warning
    fits = int(warning.split("--max-rows ")[-1].split(" fits")[0].replace(",", ""))
    assert 4 * distinct <= fits < 8 * distinct
    preprocess([TSV], tmp_path / "fits", vocab="hash", max_rows=fits, progress=False)
    assert capsys.readouterr().err == ""  # sized to the data: nothing to say


@pytest.mark.usefixtures("private_cache_dir")
def test_failed_preprocessing_leaves_no_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = tmp_path / "raw.tsv"
    raw.write_text("1\tnot a line\n")
    cli_fails(["preprocess", str(raw), "--out", str(tmp_path / "o"), "--strict"], capsys, "raw.tsv:1")
    assert not (tmp_path / "o").exists()


@pytest.mark.usefixtures("private_cache_dir")
def test_preprocess_of_one_line_writes_no_dataset(tmp_path: Path) -> None:
    from slipcache.data.preprocess import preprocess

    line = "\t".join(["1", *["3"] * 13, *["0a1b2c3d"] * 26])
    (tmp_path / "day.tsv").write_text(line + "\n")
    with pytest.raises(SlipcacheError, match="1 valid input row leave the train split empty"):
        preprocess([tmp_path / "day.tsv"], tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()


@pytest.mark.usefixtures("private_cache_dir")
def test_sigterm_during_preprocess_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    import signal

    from slipcache.data import preprocess as prep

    good = "0\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a1b2c3d"] * 26) + "\n"
    raw = tmp_path / "day.tsv"
    raw.write_text(good * 400)
    real = prep.read_chunks

    def read_then_stop(*args: object, **kwargs: object):  # noqa: ANN202
        for chunk in real(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` would, while the scratch files are written
            yield chunk

    monkeypatch.setattr(prep, "read_chunks", read_then_stop)
    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    assert main(["preprocess", str(raw), "--out", str(out), "--no-progress"]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert not out.exists()  # neither the directory it made nor its scratch
    assert signal.getsignal(signal.SIGTERM) == handler


@pytest.mark.usefixtures("private_cache_dir")
def test_preprocess_refuses_a_character_device(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cli_fails_in_one_line(["preprocess", "/dev/zero", "--out", str(tmp_path / "out")], capsys,
                          "/dev/zero: is a character device, not a Criteo data file")
    assert not (tmp_path / "out").exists()

