"""`python -m benchmarks.checkpoint_load`: both arms put the same rows into the storage files."""

from pathlib import Path

import pytest

from benchmarks import checkpoint_load
from slipcache.training import trainer
from tests.helpers import SIZES, make_dataset, tiny_config


@pytest.mark.parametrize("arm", checkpoint_load.ARMS)
def test_both_arms_load_the_checkpoints_tables(arm: str, tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data")
    run = tmp_path / "run"
    trainer.train(tiny_config(data, run, embeddings="cached", precision="int4", cache_size=0.05, epochs=1,
                              storage_path=str(tmp_path / "trained_rows")))
    record = checkpoint_load.load_once(run, tmp_path / "rows", arm, 8, "int4", 0.05, ",".join(map(str, SIZES)))
    assert record["arm"] == arm and record["load_s"] >= 0
    assert list((tmp_path / "rows").iterdir()) == []  # the storage files are unlinked: nothing left
