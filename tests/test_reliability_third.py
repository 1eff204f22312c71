"""A run writes inside its directory and nowhere else, the newest complete checkpoint wins, and bad data or
crafted checkpoints stop in one line with the run left as it was."""

from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data import dataset as dataset_module
from slipcache.data.dataset import CriteoDataset
from slipcache.errors import SlipcacheError
from slipcache.training.datasets import training_batches
from tests.helpers import make_dataset


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))


def one_line(argv: list[str], capsys: pytest.CaptureFixture, expected: str, code: int = 2) -> str:
    """Run the CLI; it must fail with `code` and one line holding `expected` (no traceback)."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert expected in err.splitlines()[-1] and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------- labels
@pytest.mark.parametrize("value", [2.0, -1.0])
def test_labels_of_our_own_format_are_checked_when_it_trains(
    tmp_path: Path, value: float, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "data")
    labels = np.load(data / "train.labels.npy")
    np.save(data / "train.labels.npy", np.where(labels == 0, value, labels).astype(np.float32))
    one_line(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--embeddings", "torch",
              "--samples", "640", "--no-progress"], capsys, f"labels must be 0 or 1, found {value:g}")
    assert not (tmp_path / "run" / "checkpoints").exists()


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
