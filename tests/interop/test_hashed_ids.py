"""Hashed TorchRec ids without --table-sizes: the tables (max id + 1 rows) are checked against the memory
before anything is allocated, and one line says to pass --table-sizes."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from slipcache import cli
from slipcache.training.config import make_config
from slipcache.training.datasets import open_dataset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrec_dlrm.py"


def _hashed_torchrec_days(root: Path, n: int = 64) -> Path:
    """TorchRec's per-day .npy layout whose ids are 31-bit hashes, as TorchRec's preprocessing leaves them."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for day in range(2):
        np.save(root / f"day_{day}_dense.npy", rng.random((n, 13), dtype=np.float32))
        np.save(root / f"day_{day}_sparse.npy", rng.integers(0, 2**31 - 1, (n, 26), dtype=np.int64))
        np.save(root / f"day_{day}_labels.npy", rng.integers(0, 2, (n, 1), dtype=np.int32))
    return root


@pytest.fixture(autouse=True)
def _small_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLIPCACHE_MEMORY_AVAILABLE_GB", "8")


def test_train_on_hashed_ids_says_to_pass_table_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _hashed_torchrec_days(tmp_path / "hashed")
    code = cli.main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "Traceback" not in err
    assert "--table-sizes" in err and "GB" in err and "available 8.0 GB" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    # with sizes given, the same data opens (ids taken modulo 1000)
    dataset = open_dataset(data, make_config({}, {"data": str(data), "table_sizes": [1000], "progress": False}))
    assert dataset.table_sizes == [1000] * 26


def test_the_example_says_it_too(tmp_path: Path) -> None:
    pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")
    data = _hashed_torchrec_days(tmp_path / "hashed")
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit, match="--table-sizes"):
        example.open_data(str(data), None, 16, "int8")
    assert example.open_data(str(data), [1000], 16, "int8").table_sizes == [1000] * 26
