"""External preprocessed Criteo formats (TorchRec .npy days, DLRM .npz, MLPerf .bin) read in place."""

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data import formats, mapped
from slipcache.data.preprocess import dense_transform
from slipcache.errors import SlipcacheError
from slipcache.training import trainer as train
from slipcache.training.cli import evaluate_checkpoint
from tests.helpers import cli_fails, cli_fails_in_one_line, make_dataset, tiny_config, train_argv

SIZES = np.array([20, 7, 50] + [5] * 23)


def _rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels int, raw dense counts int, ids below SIZES; labels learnable from table 0 and dense 0."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, s, n) for s in SIZES], 1)
    ids[:5] = SIZES - 1  # every table reaches its size, so max id + 1 == SIZES
    dense = rng.integers(-1, 30, (n, 13))
    logit = np.where(ids[:, 0] % 2 == 0, 2.0, -2.0) + 0.2 * (dense[:, 0] - 10)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int32)
    return labels, dense.astype(np.int32), ids


def write_torchrec(root: Path, days: int = 3, n: int = 600) -> list[tuple[np.ndarray, ...]]:
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(days):
        labels, dense, ids = _rows(n, i)
        np.save(root / f"day_{i}_labels.npy", labels.reshape(-1, 1))
        np.save(root / f"day_{i}_dense.npy", dense_transform(dense.astype(np.float32)))
        np.save(root / f"day_{i}_sparse.npy", ids.astype(np.int64))
        written.append((labels, dense, ids))
    return written


def write_dlrm(root: Path, compressed: bool, n: int = 1400) -> tuple[np.ndarray, ...]:
    root.mkdir(parents=True, exist_ok=True)
    labels, dense, ids = _rows(n, 7)
    save = np.savez_compressed if compressed else np.savez
    save(
        root / "kaggleAdDisplayChallenge_processed.npz",
        X_int=dense,
        X_cat=ids.astype(np.int32),
        y=labels,
        counts=SIZES,
    )
    return labels, dense, ids


def write_mlperf(root: Path, with_val: bool, n: int = 1200) -> list[np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for part, seed in (("train", 1), ("test", 2), ("val", 3))[: 3 if with_val else 2]:
        labels, dense, ids = _rows(n if part == "train" else n // 4, seed)
        rows = np.concatenate([labels[:, None], dense, ids], axis=1).astype(np.int32)
        rows.tofile(root / f"terabyte_{part}.bin")
        written.append(rows)
    return written


pytestmark = pytest.mark.usefixtures("private_cache_dir")


def test_torchrec_days_split_and_no_second_log(tmp_path: Path) -> None:
    written = write_torchrec(tmp_path / "tr")
    ds = formats.open_any(tmp_path / "tr")
    assert ds.splits == {"train": 1200, "val": 300, "test": 300}
    assert ds.table_sizes == SIZES.tolist() and ds.meta["table_sizes_from"] == "max id + 1"
    assert ds.meta["split_order"] == "val-test" and "not applied twice" in ds.meta["dense_transform"]
    train_split, test = ds.split("train"), ds.split("test")
    np.testing.assert_array_equal(train_split.sparse[600:605], written[1][2][:5])  # day 1 follows day 0
    np.testing.assert_array_equal(train_split.labels[:], np.concatenate([w[0] for w in written[:2]]))
    np.testing.assert_allclose(test.dense[:], dense_transform(written[2][1][300:].astype(np.float32)))
    assert train_split.sparse[:].dtype == np.int32 and train_split.labels[:].dtype == np.float32
    picked = np.array([1199, 3, 600])
    np.testing.assert_array_equal(train_split.sparse[picked], train_split.sparse[:][picked])
    flipped = formats.open_any(tmp_path / "tr", split_order="test-val")
    np.testing.assert_array_equal(flipped.split("val").labels[:], written[2][0][300:])


def test_table_sizes_given_take_ids_modulo(tmp_path: Path) -> None:
    written = write_torchrec(tmp_path / "tr")
    ds = formats.open_any(tmp_path / "tr", table_sizes=[3])
    assert ds.table_sizes == [3] * 26 and ds.meta["table_sizes_from"] == "given"
    np.testing.assert_array_equal(ds.split("train").sparse[:600], written[0][2] % 3)


def test_dlrm_npz_memory_mapped_test_then_val(tmp_path: Path) -> None:
    labels, dense, ids = write_dlrm(tmp_path / "dl", compressed=False)
    ds = formats.open_any(tmp_path / "dl")
    assert isinstance(ds, formats.ExternalDataset)
    assert ds.meta["table_sizes_from"] == "counts" and ds.meta["split_order"] == "test-val"
    assert ds.splits == {"train": 1200, "test": 100, "val": 100}  # 7 days of 200
    assert isinstance(ds.split("train").sparse.pieces[0].array, np.memmap)
    np.testing.assert_array_equal(ds.split("test").sparse[:], ids[1200:1300])
    np.testing.assert_allclose(ds.split("val").dense[:], dense_transform(dense[1300:].astype(np.float32)))


def test_compressed_npz_converted_once_into_the_cache(tmp_path: Path) -> None:
    labels, dense, ids = write_dlrm(tmp_path / "dl", compressed=True)
    ds = formats.open_any(tmp_path / "dl")
    assert Path(ds.path).is_relative_to(tmp_path / "cache" / "converted")
    np.testing.assert_array_equal(ds.split("val").labels, labels[1300:].astype(np.float32))
    np.testing.assert_array_equal(ds.split("train").sparse, ids[:1200])
    again = formats.open_any(tmp_path / "dl")
    assert (
        again.path == ds.path
        and (ds.path / "meta.json").stat().st_mtime_ns == (again.path / "meta.json").stat().st_mtime_ns
    )
    assert not list((tmp_path / "cache" / "converted").glob("*.decompressed"))


def test_mlperf_bin_with_and_without_val(tmp_path: Path) -> None:
    rows = write_mlperf(tmp_path / "mp", with_val=True)
    ds = formats.open_any(tmp_path / "mp")
    assert ds.splits == {"train": 1200, "val": 300, "test": 300}
    np.testing.assert_array_equal(ds.split("val").sparse[:], rows[2][:, 14:])
    np.testing.assert_array_equal(ds.split("test").labels[:], rows[1][:, 0].astype(np.float32))
    rows = write_mlperf(tmp_path / "mp2", with_val=False)
    halves = formats.open_any(tmp_path / "mp2")
    assert halves.splits == {"train": 1200, "test": 150, "val": 150}
    np.testing.assert_array_equal(halves.split("val").sparse[:], rows[1][150:, 14:])


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            [
                "day_0_dense.npy",
                "day_0_sparse.npy",
                "day_0_labels.npy",
                "day_1_dense.npy",
                "day_1_labels.npy",
            ],
            "day_1_sparse.npy",
        ),
        (["day_0_dense.npy", "day_0_sparse.npy", "day_0_labels.npy", "x_train.bin"], "mixed"),
        (["x_train.bin"], "_test.bin"),
        (["day_0_processed.npz", "day_2_processed.npz"], "day_1_processed.npz"),
    ],
)
def test_incomplete_or_mixed_directory_names_the_file(tmp_path: Path, files: list[str], message: str) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(SlipcacheError, match=message):
        formats.detect_format(tmp_path)


def test_mlperf_file_of_partial_rows_is_an_error(tmp_path: Path) -> None:
    write_mlperf(tmp_path, with_val=False)
    with open(tmp_path / "terabyte_test.bin", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(SlipcacheError, match="terabyte_test.bin"):
        formats.open_any(tmp_path)


def test_stored_npz_members_are_memory_mapped_at_the_right_offset(tmp_path: Path) -> None:
    big = np.arange(5000, dtype=np.int64).reshape(-1, 2)
    np.savez(tmp_path / "a.npz", first=np.ones(3), big=big)
    with zipfile.ZipFile(tmp_path / "a.npz") as zf:
        info = zf.getinfo("big.npy")
    np.testing.assert_array_equal(mapped.mmap_npz_member(tmp_path / "a.npz", info), big)


@pytest.mark.parametrize("kind", ["torchrec", "dlrm", "dlrm-compressed", "mlperf"])
@pytest.mark.slow
def test_a_run_trains_on_each_format(tmp_path: Path, kind: str) -> None:
    data = tmp_path / kind
    if kind == "torchrec":
        write_torchrec(data)
    elif kind == "mlperf":
        write_mlperf(data, with_val=False)
    else:
        write_dlrm(data, compressed=kind == "dlrm-compressed")
    config = tiny_config(data, tmp_path / "run", epochs=3, eval_every=None, checkpoint_every=None)
    summary = train.train(config)
    assert summary["auc"] > 0.6  # table 0's parity and dense 0 carry the signal
    expected_order = "val-test" if kind == "torchrec" else "test-val"
    assert summary["config"]["split_order"] == expected_order
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["dense_transform"]
    assert recorded == summary["config"]["dense_transform"]
    assert ("not applied twice" in recorded) == (kind == "torchrec")  # TorchRec's values: left as they are
    assert kind == "torchrec" or recorded.startswith("log(1 + max(x, 0))")
    scores = evaluate_checkpoint(tmp_path / "run", split="val")
    assert scores["samples"] > 0


def test_stats_reads_an_external_format(tmp_path: Path) -> None:
    from slipcache.data.stats import compute_stats

    rows = write_mlperf(tmp_path / "mp", with_val=False)
    stats = compute_stats(tmp_path / "mp")
    assert stats["rows"] == 1500 and stats["source"]["splits"] == {"train": 1200, "val": 150, "test": 150}
    assert stats["tables"][0]["distinct"] == len(np.unique(np.concatenate([r[:, 14] for r in rows])))


def test_wrong_shapes_name_the_day(tmp_path: Path) -> None:
    write_torchrec(tmp_path, days=2, n=50)
    np.save(tmp_path / "day_1_sparse.npy", np.zeros((50, 25), dtype=np.int64))
    with pytest.raises(SlipcacheError, match="day_1"):
        formats.open_any(tmp_path)


def _relabel(kind: str, root: Path, value: int) -> None:
    """Write a small dataset of `kind` whose labels are -1/1 style: 0 replaced by `value`."""
    if kind == "torchrec":
        write_torchrec(root, days=2, n=200)
        labels = np.load(root / "day_1_labels.npy")
        np.save(root / "day_1_labels.npy", np.where(labels == 0, value, labels))
    elif kind == "dlrm":
        labels, dense, ids = write_dlrm(root, compressed=False, n=700)
        np.savez(root / "kaggleAdDisplayChallenge_processed.npz", X_int=dense, X_cat=ids.astype(np.int32),
                 y=np.where(labels == 0, value, labels), counts=np.array([20, 7, 50] + [5] * 23))
    else:
        write_mlperf(root, with_val=False, n=400)
        rows = np.fromfile(root / "terabyte_train.bin", dtype=np.int32).reshape(-1, 40)
        rows[:, 0] = np.where(rows[:, 0] == 0, value, rows[:, 0])
        rows.tofile(root / "terabyte_train.bin")


@pytest.mark.parametrize("kind", ["torchrec", "dlrm", "mlperf"])
@pytest.mark.parametrize("value", [-1, 5])
def test_labels_other_than_0_1_are_named_in_every_external_reader(tmp_path: Path, kind: str, value: int) -> None:
    _relabel(kind, tmp_path / kind, value)
    with pytest.raises(SlipcacheError, match=rf"labels must be 0 or 1, found {value}\b"):
        formats.open_any(tmp_path / kind)


def test_labels_beyond_the_first_block_are_checked_as_they_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_torchrec(tmp_path, days=2, n=200)
    labels = np.load(tmp_path / "day_0_labels.npy").astype(np.float32).reshape(-1)
    labels[150] = 0.5  # a soft label past the rows checked at open
    np.save(tmp_path / "day_0_labels.npy", labels)
    monkeypatch.setattr(formats, "LABEL_PROBE_ROWS", 100)
    train = formats.open_any(tmp_path).split("train")
    assert train.labels[:100].tolist() == labels[:100].tolist()
    with pytest.raises(SlipcacheError, match="found 0.5"):
        train.labels[100:200]


def test_damaged_compressed_npz(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_dlrm(tmp_path / "d", compressed=True)
    f = tmp_path / "d" / "kaggleAdDisplayChallenge_processed.npz"
    data = bytearray(f.read_bytes())
    data[2000:2100] = bytes(b ^ 0xFF for b in data[2000:2100])
    f.write_bytes(bytes(data))
    for argv in (train_argv(tmp_path / "d", tmp_path), ["stats", str(tmp_path / "d")]):
        cli_fails(argv, capsys, "damaged compressed .npz")


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        (lambda a: a.astype(np.float32) + 0.5, "ids must be integers, found 19.5"),
        (lambda a: np.where(a == a.max(), 2**31 + 5, a).astype(np.int64), "id 2147483653 is beyond 2147483647"),
    ],
    ids=["fractional", "beyond int32"],
)
def test_torchrec_ids_that_cannot_size_a_table(tmp_path: Path, capsys: pytest.CaptureFixture, ids, expected) -> None:  # noqa: ANN001
    write_torchrec(tmp_path / "t", days=2, n=200)
    for day in range(2):
        path = tmp_path / "t" / f"day_{day}_sparse.npy"
        np.save(path, ids(np.load(path)))
    cli_fails(train_argv(tmp_path / "t", tmp_path), capsys, expected)


@pytest.mark.slow
def test_unsigned_and_integral_float_ids_train(tmp_path: Path) -> None:
    for kind, dtype in (("u", np.uint64), ("f", np.float64)):
        write_torchrec(tmp_path / kind, days=2, n=200)
        for day in range(2):
            path = tmp_path / kind / f"day_{day}_sparse.npy"
            np.save(path, np.load(path).astype(dtype))
        assert main(train_argv(tmp_path / kind, tmp_path / kind)) == 0
        assert main(train_argv(tmp_path / kind, tmp_path / f"{kind}-hashed", "--table-sizes", "7")) == 0


def test_symlink_loop_and_pipe_as_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "b", tmp_path / "a")
    cli_fails(train_argv(tmp_path / "a", tmp_path), capsys, "symlink loop")
    os.mkfifo(tmp_path / "fifo")
    cli_fails(train_argv(tmp_path / "fifo", tmp_path), capsys, "is a pipe")


def test_bom_and_unknown_formats_are_named_without_echoing_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    header = "label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + header.encode() + b"\n")
    cli_fails(["train", "--data", str(tmp_path / "bom.csv"), "--out", str(tmp_path / "r")], capsys, "byte-order mark")
    (tmp_path / "secret.txt").write_text("password=hunter2\n")
    train = ["train", "--data", str(tmp_path / "secret.txt"), "--out", str(tmp_path / "r")]
    cli_fails(train, capsys, "unrecognized format")
    assert "hunter2" not in capsys.readouterr().err


def test_a_directory_holding_two_formats_is_refused_naming_a_file_of_each(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = make_dataset(tmp_path / "data", n=400)
    for name in ("day_0_dense.npy", "day_0_sparse.npy", "day_0_labels.npy"):
        (out / name).write_bytes(b"")  # the state an older `--force` left (names decide the format)
    cli_fails_in_one_line(
        ["train", "--data", str(out), "--no-progress", "--out", str(tmp_path / "run")], capsys,
        "mixed data formats: day_0_dense.npy (torchrec) and meta.json (slipcache); keep one per directory",
    )


def test_an_external_file_changed_in_place_with_its_time_kept_is_measured_again(tmp_path: Path) -> None:
    from slipcache.data import formats

    write_torchrec(tmp_path / "tr", days=2, n=200)
    first = formats.open_any(tmp_path / "tr").table_sizes
    sparse = tmp_path / "tr" / "day_0_sparse.npy"
    stat = sparse.stat()
    ids = np.load(sparse)
    ids[:, 3] = first[3] + 7  # larger ids, same size: rewritten in place, its time put back
    np.save(sparse, ids)
    os.utime(sparse, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert formats.open_any(tmp_path / "tr").table_sizes[3] == first[3] + 8

