"""`--tensorboard`: the metrics.jsonl scalars land in event files TensorBoard reads back."""

import json
import re
from pathlib import Path

import pytest

from slipcache.training import trainer as train
from slipcache.training.tensorboard import scalars
from tests.helpers import make_dataset, tiny_config

pytest.importorskip("tensorboard", reason="tensorboard not installed (the tensorboard extra)")


def test_event_files_hold_the_metrics_jsonl_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = make_dataset(tmp_path / "data", n=1000)
    config = tiny_config(
        data,
        tmp_path / "run",
        embeddings="cached",
        cache_size=0.2,
        epochs=1,
        tensorboard=str(tmp_path / "tb"),
    )
    summary = train.train(config)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    expected = {
        "train/train_loss",
        "train/hit_rate",
        "train/samples_per_s",
        "train/skipped_fraction",
        "val/auc",
        "val/logloss",
        "hit_rate/table_0",
        "hit_rate/table_25",
        "memory/storage_payload",
        "memory/cache_rows",
        "test/auc",
    }
    assert expected <= tags
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for event in events:
        for tag, value in scalars(event).items():
            logged = {e.step: e.value for e in accumulator.Scalars(tag)}
            assert logged[event["samples"]] == pytest.approx(value, rel=1e-6)
    assert accumulator.Scalars("test/auc")[-1].value == pytest.approx(summary["auc"], rel=1e-6)
    assert all("hit_rate_per_table" in e and "memory_bytes" in e for e in events if e["event"] == "train")
    assert "checkpoint/bytes" in tags and "checkpoint/write_s" in tags


def test_scalars_skip_text_and_missing_values() -> None:
    event = {
        "event": "train",
        "samples": 64,
        "train_loss": 0.5,
        "hit_rate": None,
        "skipping": True,
        "val_auc": 0.7,
    }
    assert scalars(event) == {"train/train_loss": 0.5, "val/auc": 0.7}


def test_default_directory_is_inside_the_run(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data", n=600)
    train.train(tiny_config(data, tmp_path / "run", epochs=1, tensorboard=""))
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    # report.md links only plots on disk, and a run without skipping has no staleness plot
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (tmp_path / "run" / "report.md").read_text())
    assert "training.png" in links and all((tmp_path / "run" / name).is_file() for name in links)
    assert not (tmp_path / "run" / "staleness.png").exists()
