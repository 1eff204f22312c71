"""One way to find a run's checkpoint: `--resume`, `slipcache eval` and `slipcache export` agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipcache.errors import SlipcacheError
from slipcache.export import load_tables
from slipcache.training import trainer as train
from slipcache.training.cli import evaluate_checkpoint
from slipcache.training.saved_run import find_checkpoint
from tests.helpers import make_dataset
from tests.helpers import tiny_config as tiny


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    data = make_dataset(root / "data", n=640)
    train.train(tiny(data, root / "run", epochs=1, embeddings="cached"))
    return root / "run"


def test_every_way_of_naming_a_checkpoint_finds_the_same_one(run: Path) -> None:
    latest = run / "checkpoints" / "latest.pt"
    for name in (run, run / "checkpoints", latest):
        saved = find_checkpoint(name)
        assert (saved.path, saved.run_dir, saved.sharded) == (latest.resolve(), run.resolve(), False), name
    scores = {str(name): evaluate_checkpoint(name)["auc"] for name in (run, run / "checkpoints", latest)}
    assert len(set(scores.values())) == 1
    tables = [load_tables(name) for name in (run, run / "checkpoints", latest)]
    assert all(torch.equal(a, b) for t in tables[1:] for a, b in zip(tables[0], t, strict=True))


def test_a_wrong_name_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match=r"^--checkpoint .*: no such run directory or checkpoint file$"):
        find_checkpoint(tmp_path / "missing")
    (tmp_path / "notes").mkdir()
    with pytest.raises(SlipcacheError, match=r"^--resume .*notes: not a slipcache run directory"):
        find_checkpoint(tmp_path / "notes", "--resume")
