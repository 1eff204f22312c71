"""The binary dataset format and BatchIterator: exact coverage, determinism, peek, filters, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slipcache.cli import main
from slipcache.data import dataset as dataset_module
from slipcache.data.batches import BatchIterator
from slipcache.data.dataset import CriteoDataset, DatasetWriter, SplitArrays, check_output_dir
from slipcache.errors import SlipcacheError
from slipcache.training.datasets import training_batches
from tests.helpers import cli_fails, make_dataset


def make_split(n: int) -> SplitArrays:
    """Sample i has label i % 2, dense[:, 0] == i and sparse[:, 0] == i, so samples are identifiable."""
    labels = (np.arange(n) % 2).astype(np.float32)
    dense = np.zeros((n, 13), dtype=np.float32)
    dense[:, 0] = np.arange(n)
    sparse = np.zeros((n, 26), dtype=np.int32)
    sparse[:, 0] = np.arange(n)
    sparse[:, 1] = np.arange(n) % 7
    return SplitArrays(labels, dense, sparse)


def sample_ids(batches: list) -> list[int]:
    return [int(i) for b in batches for i in b.sparse[:, 0]]


def write_dataset(path: Path, n: int = 50) -> None:
    split = make_split(n)
    with DatasetWriter(path, {"train": n, "val": 3}) as writer:
        writer.write("train", 0, split.labels, split.dense, split.sparse)
        writer.write("val", 0, split.labels[:3], split.dense[:3], split.sparse[:3])
        writer.commit({"table_sizes": [n] * 26, "positive_rate": 0.5, "vocabulary": "hash"})


def test_writer_and_dataset_roundtrip(tmp_path: Path) -> None:
    write_dataset(tmp_path / "ds")
    ds = CriteoDataset(tmp_path / "ds")
    assert ds.splits == {"train": 50, "val": 3}
    assert ds.table_sizes == [50] * 26 and ds.num_dense == 13 and ds.num_tables == 26
    train = ds.split("train")
    assert isinstance(train.labels, np.memmap)
    assert len(train) == 50 and train.sparse.dtype == np.int32
    np.testing.assert_array_equal(train.dense[:, 0], np.arange(50))
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "ds").iterdir())


def test_writer_failure_leaves_no_dataset(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), DatasetWriter(tmp_path / "ds", {"train": 5}):
        raise RuntimeError("crash")
    assert not (tmp_path / "ds").exists()  # the directory the writer made goes with it
    (tmp_path / "ds").mkdir()
    with pytest.raises(RuntimeError), DatasetWriter(tmp_path / "ds", {"train": 5}):
        raise RuntimeError("crash")
    assert list((tmp_path / "ds").iterdir()) == []  # one it did not make stays
    with pytest.raises(SlipcacheError, match="no meta.json"):
        CriteoDataset(tmp_path / "ds")


def test_dataset_open_errors(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="no such dataset"):
        CriteoDataset(tmp_path / "missing")
    write_dataset(tmp_path / "ds")
    with pytest.raises(SlipcacheError, match="no split 'test'"):
        CriteoDataset(tmp_path / "ds").split("test")
    meta_path = tmp_path / "ds" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(SlipcacheError, match="version 99"):
        CriteoDataset(tmp_path / "ds")
    meta_path.write_text(json.dumps({**meta, "format": "other"}))
    with pytest.raises(SlipcacheError, match="not a slipcache dataset"):
        CriteoDataset(tmp_path / "ds")
    meta_path.write_text("{not json")
    with pytest.raises(SlipcacheError, match="unreadable meta.json"):
        CriteoDataset(tmp_path / "ds")
    meta_path.write_text(json.dumps(meta))
    (tmp_path / "ds" / "val.dense.npy").unlink()
    with pytest.raises(SlipcacheError, match="missing file"):
        CriteoDataset(tmp_path / "ds").split("val")
    np.save(tmp_path / "ds" / "val.dense.npy", np.zeros((4, 13), dtype=np.float32))
    with pytest.raises(SlipcacheError, match="expected float32"):
        CriteoDataset(tmp_path / "ds").split("val")


def test_batches_types_and_len() -> None:
    it = BatchIterator(make_split(10), 4)
    assert len(it) == 3
    batches = list(it)
    assert [len(b) for b in batches] == [4, 4, 2]
    b = batches[0]
    assert b.dense.dtype == torch.float32 and b.dense.shape == (4, 13)
    assert b.sparse.dtype == torch.int64 and b.sparse.shape == (4, 26)
    assert b.labels.dtype == torch.float32 and b.labels.shape == (4,)
    assert sample_ids(batches) == list(range(10))
    assert len(BatchIterator(make_split(10), 4, drop_last=True)) == 2
    assert [len(b) for b in BatchIterator(make_split(10), 4, drop_last=True)] == [4, 4]
    assert list(BatchIterator(make_split(0), 4)) == []


def test_shuffle_covers_every_sample_once_and_is_deterministic() -> None:
    split = make_split(1003)
    runs = [
        sample_ids(list(BatchIterator(split, 10, shuffle=True, seed=s, chunk_batches=4))) for s in (1, 1, 2)
    ]
    assert sorted(runs[0]) == list(range(1003))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0] != list(range(1003))
    other_epoch = sample_ids(list(BatchIterator(split, 10, shuffle=True, seed=1, epoch=1, chunk_batches=4)))
    assert other_epoch != runs[0] and sorted(other_epoch) == list(range(1003))
    # Batches keep features of one sample together.
    for b in BatchIterator(split, 10, shuffle=True, seed=3, chunk_batches=4):
        np.testing.assert_array_equal(b.dense[:, 0].numpy(), b.sparse[:, 0].numpy())
        np.testing.assert_array_equal(b.labels.numpy(), (b.sparse[:, 0] % 2).numpy())


def test_peek_does_not_consume() -> None:
    split = make_split(95)
    it = BatchIterator(split, 10, shuffle=True, seed=5, chunk_batches=2, lookahead=1)
    reference = sample_ids(list(BatchIterator(split, 10, shuffle=True, seed=5, chunk_batches=2)))
    got: list = []
    while True:
        ahead = it.peek(4)
        assert len(ahead) == min(4, 10 - len(got))
        try:
            batch = next(it)
        except StopIteration:
            assert ahead == []
            break
        assert torch.equal(batch.sparse, ahead[0].sparse)
        if len(ahead) > 1:
            assert torch.equal(it.peek(1)[0].sparse, ahead[1].sparse)
        got.append(batch)
    assert sample_ids(got) == reference
    assert it.samples_seen == 95 and it.batch_index == 10


def test_sample_filter_keeps_batches_full() -> None:
    split = make_split(1000)

    def keep(sparse: np.ndarray) -> np.ndarray:
        return sparse[:, 1] != 3

    it = BatchIterator(split, 16, shuffle=True, seed=2, chunk_batches=3, sample_filter=keep)
    batches = list(it)
    assert all(len(b) == 16 for b in batches[:-1])
    ids = sample_ids(batches)
    expected = [i for i in range(1000) if i % 7 != 3]
    assert sorted(ids) == expected
    assert it.samples_seen == len(expected)
    assert it.samples_dropped == 1000 - len(expected)
    with pytest.raises(TypeError):
        len(it)


@pytest.mark.parametrize("use_filter", [False, True])
@pytest.mark.parametrize("start", [0, 1, 7, 12, 13, 20])
def test_start_batch_resumes_exactly(use_filter: bool, start: int) -> None:
    split = make_split(131)
    kwargs = {"shuffle": True, "seed": 9, "chunk_batches": 3}
    if use_filter:
        kwargs["sample_filter"] = lambda sparse: sparse[:, 1] != 0
    full = [b.sparse[:, 0].tolist() for b in BatchIterator(split, 10, **kwargs)]
    resumed_it = BatchIterator(split, 10, start_batch=start, **kwargs)
    resumed = [b.sparse[:, 0].tolist() for b in resumed_it]
    assert resumed == full[start:]
    if start <= len(full):
        assert resumed_it.batch_index == len(full)


def test_writer_removes_staging_of_dead_writers_only(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    out = tmp_path / "ds"
    (out / f".tmp-{dead.stdout.strip()}-raw-x").mkdir(parents=True)
    (out / f".tmp-{os.getppid()}").mkdir()  # a live process: left alone
    write_dataset(out)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".tmp")) == [f".tmp-{os.getppid()}"]


def test_sample_filter_runs_only_as_batches_are_assembled() -> None:
    seen: list[int] = []

    def keep_all(sparse: np.ndarray) -> np.ndarray:
        seen.append(len(sparse))
        return np.ones(len(sparse), dtype=bool)

    it = BatchIterator(make_split(1000), 10, chunk_batches=64, sample_filter=keep_all)
    assert seen == []
    next(it)
    assert seen == [10]
    it.peek(3)
    assert seen == [10] * 4  # the next three batches
    assert sample_ids(list(it)) == list(range(10, 1000))


@pytest.mark.usefixtures("private_cache_dir")
@pytest.mark.parametrize("command", ["synth", "preprocess"])
def test_dataset_out_refuses_foreign_directories_and_needs_force_to_overwrite(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture
) -> None:
    raw = tmp_path / "raw.tsv"
    raw.write_text("".join(f"{i % 2}\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a0b0c0d"] * 26) + "\n"
                           for i in range(60)))
    args = {"synth": ["synth", "--samples", "300", "--scale", "0.0005", "--no-progress"],
            "preprocess": ["preprocess", str(raw), "--no-progress"]}[command]
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    assert main([*args, "--out", str(home)]) == 2
    assert "is not empty and is not a slipcache dataset" in capsys.readouterr().err
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]
    out = tmp_path / "ds"
    assert main([*args, "--out", str(out)]) == 0
    before = (out / "meta.json").read_bytes()
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 2
    assert "already holds a dataset; pass --force" in capsys.readouterr().err
    assert (out / "meta.json").read_bytes() == before
    assert main([*args, "--out", str(out), "--force"]) == 0
    assert main([*args, "--out", str(tmp_path / "raw.tsv")]) == 2


@pytest.mark.usefixtures("private_cache_dir")
@pytest.mark.parametrize("value", [2.0, -1.0])
def test_labels_of_our_own_format_are_checked_when_it_trains(
    tmp_path: Path, value: float, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "data")
    labels = np.load(data / "train.labels.npy")
    np.save(data / "train.labels.npy", np.where(labels == 0, value, labels).astype(np.float32))
    cli_fails(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--embeddings", "torch",
              "--samples", "640", "--no-progress"], capsys, f"labels must be 0 or 1, found {value:g}")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.usefixtures("private_cache_dir")
def test_labels_past_the_opening_probe_are_checked_in_every_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_dataset(tmp_path / "data")
    labels = np.load(data / "train.labels.npy")
    labels[1500] = 2.0  # past the rows checked when the split is opened
    np.save(data / "train.labels.npy", labels)
    monkeypatch.setattr(dataset_module, "LABEL_PROBE_ROWS", 100, raising=False)
    split = CriteoDataset(data).split("train")
    with pytest.raises(SlipcacheError, match=r"train\.labels\.npy: labels must be 0 or 1, found 2 \(1 of"):
        for _ in training_batches(CriteoDataset(data), 64, seed=0, epoch=0):
            pass
    assert split.labels[:100].tolist() == labels[:100].tolist()


@pytest.mark.usefixtures("private_cache_dir")
def test_a_dataset_whose_commit_was_cut_short_can_be_replaced_with_force(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data")
    (data / "meta.json").unlink()  # killed between removing the old meta.json and writing the new one
    assert check_output_dir(data, force=True) == data
    (data / "notes.txt").write_text("mine")
    with pytest.raises(SlipcacheError, match="is not empty and is not a slipcache dataset"):
        check_output_dir(data, force=True)

