"""Shared test helpers: a tiny dataset in the binary format of docs/design.md."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slipcache.training.config import TrainConfig, make_config

SIZES = [20, 7, 50] + [5] * 23


def make_dataset(
    root: Path, n: int = 2000, sizes: list[int] = SIZES, nan_row: int | None = None, skewed: bool = False
) -> Path:
    """Labels depend on three tables and one dense feature, so a few hundred steps learn something.

    `skewed` draws Zipf ids (so some rows are hot, for stale skipping); `nan_row` poisons the dense
    features of the train split from that row on.
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weights = [rng.normal(0, 1.5, s) for s in sizes]
    splits = {"train": n, "val": n // 4, "test": n // 4}
    for name, m in splits.items():
        if skewed:
            sparse = np.stack([np.minimum(rng.zipf(1.5, m) - 1, s - 1) for s in sizes], 1).astype(np.int32)
        else:
            sparse = np.stack([rng.integers(0, s, m) for s in sizes], 1).astype(np.int32)
        dense = np.log1p(rng.exponential(2.0, (m, 13))).astype(np.float32)
        logit = sum(weights[t][sparse[:, t]] for t in range(3)) + 3.0 * (dense[:, 0] - 1.0)
        labels = (rng.random(m) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        if nan_row is not None and name == "train":
            dense[nan_row:] = np.nan
        np.save(root / f"{name}.labels.npy", labels)
        np.save(root / f"{name}.dense.npy", dense)
        np.save(root / f"{name}.sparse.npy", sparse)
    meta = {
        "format": "slipcache-dataset",
        "version": 1,
        "num_dense": 13,
        "num_tables": len(sizes),
        "table_sizes": sizes,
        "splits": splits,
        "positive_rate": 0.5,
        "source": {},
        "vocabulary": "synthetic",
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def tiny_config(data: Path, out: Path, **overrides: object) -> TrainConfig:
    """A run of a few seconds on `make_dataset` data: small MLPs, two epochs, frequent events."""
    values = dict(
        data=str(data), out=str(out), embeddings="torch", embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
        lr=0.3, batch_size=64, epochs=2, log_every=320, eval_every=640, checkpoint_every=640, progress=False,
    )
    values.update(overrides)
    return make_config({}, values)


def record_batches(monkeypatch: Any, when: Callable[[], bool] = lambda: True) -> list[torch.Tensor]:
    """The ids of every batch the trainer trains (while `when()` holds), in order: `train_step` recorded."""
    from slipcache.training import trainer

    seen: list[torch.Tensor] = []
    real_step = trainer.train_step

    def record(run, batch, batches=None):  # noqa: ANN001, ANN202
        if when():
            seen.append(batch.sparse.clone())
        return real_step(run, batch, batches)

    monkeypatch.setattr(trainer, "train_step", record)
    return seen


class FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises: a backward pass that fails midway."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


# ------------------------------------------------------------------------------------- the command's errors
def cli_fails(argv: list[str], capsys: Any, expected: str, code: int = 2) -> str:
    """Run the command: it must stop with `code` (returned, or argparse's usage exit), the last line on
    stderr holding `expected`, and no traceback. Returns stderr."""
    from slipcache.cli import main

    with pytest.raises(SystemExit) as exc:  # argparse's usage errors exit; ours return
        raise SystemExit(main(argv))
    assert exc.value.code == code
    err = capsys.readouterr().err.strip()
    assert expected in err.splitlines()[-1] and "Traceback" not in err, err
    return err


def cli_fails_in_one_line(argv: list[str], capsys: Any, expected: str, code: int = 2) -> str:
    """`cli_fails`, and stderr is that one line."""
    err = cli_fails(argv, capsys, expected, code)
    assert "\n" not in err, err
    return err


def train_argv(data: Path, tmp_path: Path, *flags: str) -> list[str]:
    """`slipcache train` of 256 samples on `data` into tmp_path/run: torch tables, batches of 64."""
    return ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--no-progress", "--embeddings", "torch",
            "--samples", "256", "--batch-size", "64", "--eval-samples", "64", *flags]


# ------------------------------------------------------------------------------------- run directories
def copy_run(run: Path, to: Path) -> Path:
    """A copy of a run directory, links kept as links."""
    shutil.copytree(run, to, symlinks=True)
    return to


def file_contents(root: Path) -> dict[str, bytes]:
    """Every file below `root` (its path relative to `root`) and its bytes: compare before and after."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def checkpoint_events(run: Path) -> list[int]:
    """The samples of every checkpoint event in the run's metrics.jsonl, in order."""
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["samples"] for e in events if e["event"] == "checkpoint"]


# ------------------------------------------------------------------------------------- raw Criteo files
# Where the real Criteo sample rows are expected: ../shared/data/criteo/ beside the clone (the README of that
# directory says where each file was published); $SLIPCACHE_TEST_CRITEO_DIR names another place.
SHARED_CRITEO = Path(
    __import__("os").environ.get("SLIPCACHE_TEST_CRITEO_DIR")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo"
)
SHARED_CRITEO_REASON = (
    f"real Criteo rows expected in {SHARED_CRITEO} (../shared/data/criteo/ beside the clone, or "
    "$SLIPCACHE_TEST_CRITEO_DIR); the same parsing checks run on written files in tests/data/test_written_formats.py"
)


class CriteoRows:
    """Raw Criteo rows drawn once (labels, 13 integer counts with missing ones, 26 categorical 32-bit values
    with missing ones), written in each of the three raw formats. Values of the first three tables carry
    the label's signal, so a few epochs on them learn something."""

    def __init__(self, n: int = 600, seed: int = 0, vocabulary: int = 40) -> None:
        rng = np.random.default_rng(seed)
        self.n = n
        pools = [rng.choice(2**32, size=vocabulary, replace=False) for _ in range(26)]
        picks = np.minimum(rng.zipf(1.6, (n, 26)) - 1, vocabulary - 1)
        self.categorical = np.stack([pools[t][picks[:, t]] for t in range(26)], axis=1).astype(np.int64)
        self.categorical[rng.random((n, 26)) < 0.1] = -1  # missing
        self.dense = rng.integers(-2, 3000, (n, 13)).astype(np.float64)
        self.dense[rng.random((n, 13)) < 0.15] = np.nan
        effect = [rng.normal(0, 1.5, vocabulary) for _ in range(3)]
        logit = sum(effect[t][picks[:, t]] for t in range(3)) - 1.0
        self.labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        # The last rows end in missing values, cut off when written as TSV (as on half of Kaggle's train.txt).
        self.cut = {n - 3: 2, n - 2: 3, n - 1: 25}
        for i, k in self.cut.items():
            self.categorical[i, 26 - k :] = -1

    def _fields(self, i: int, *, floats: bool) -> tuple[list[str], list[str]]:
        dense = ["" if np.isnan(v) else (f"{v:.1f}" if floats else str(int(v))) for v in self.dense[i]]
        cats = ["" if v < 0 else f"{int(v):08x}" for v in self.categorical[i]]
        return dense, cats

    def write_tsv(self, path: Path, *, cut: bool = True) -> Path:
        """Kaggle / Terabyte TSV: no header, trailing empty fields cut off on `self.cut`'s rows."""
        lines = []
        for i in range(self.n):
            dense, cats = self._fields(i, floats=False)
            if cut and i in self.cut:
                cats = cats[: 26 - self.cut[i]]
            lines.append("\t".join([str(int(self.labels[i])), *dense, *cats]))
        path.write_text("\n".join(lines) + "\n")
        return path

    def write_kaggle_csv(self, path: Path) -> Path:
        """Kaggle CSV: header Id,Label,I1..I13,C1..C26, CRLF line ends, an Id first."""
        header = ",".join(["Id", "Label", *(f"I{j}" for j in range(1, 14)), *(f"C{j}" for j in range(1, 27))])
        lines = [header]
        for i in range(self.n):
            dense, cats = self._fields(i, floats=False)
            lines.append(",".join([str(10_000_000 + i), str(int(self.labels[i])), *dense, *cats]))
        path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
        return path

    def write_float_csv(self, path: Path) -> Path:
        """CSV with header label,I1..I13,C1..C26, the integer features written as floats (`260.0`)."""
        header = ",".join(["label", *(f"I{j}" for j in range(1, 14)), *(f"C{j}" for j in range(1, 27))])
        lines = [header]
        for i in range(self.n):
            dense, cats = self._fields(i, floats=True)
            lines.append(",".join([str(int(self.labels[i])), *dense, *cats]))
        path.write_text("\n".join(lines) + "\n")
        return path
