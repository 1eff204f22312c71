"""Data a run can trust: labels checked in every reader, dataset outputs that never overwrite someone's
files."""

from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data import formats
from slipcache.errors import SlipcacheError
from tests.data.test_formats import write_dlrm, write_mlperf, write_torchrec


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))


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
