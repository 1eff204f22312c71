"""Every checkpoint a run writes is an event in metrics.jsonl (its size and write time), as the last one is
in summary.json; a resumed run keeps the events of the checkpoints before it."""

import json
from pathlib import Path

import pytest

from slipcache.training import trainer as train
from tests.helpers import make_dataset, tiny_config


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_checkpoints_are_events_with_size_and_write_time(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data", n=640)
    run = tmp_path / "run"
    summary = train.train(tiny_config(data, run, epochs=2, log_every=128, checkpoint_every=320, keep_checkpoints=5))
    saved = [e for e in _events(run) if e["event"] == "checkpoint"]
    assert [e["samples"] for e in saved] == [320, 640, 960, 1280]  # every 320 samples; the end is one of them
    for event in saved:
        assert event["bytes"] == (run / "checkpoints" / f"ckpt-{event['samples']:012d}.pt").stat().st_size
        assert event["write_s"] > 0
    on_disk = json.loads((run / "summary.json").read_text())
    newest = {k: saved[-1][k] for k in ("samples", "bytes", "write_s")}
    assert on_disk["last_checkpoint"] == summary["last_checkpoint"] == newest
    samples = [e["samples"] for e in _events(run)]
    assert samples == sorted(samples)  # in the order they happened

    resumed = tmp_path / "resumed"
    train.train(tiny_config(data, resumed, epochs=1, log_every=128, checkpoint_every=320))
    first = [e for e in _events(resumed) if e["event"] == "checkpoint"]
    train.train(tiny_config(data, resumed, resume=str(resumed), epochs=2, allow_changes=True))
    after = [e for e in _events(resumed) if e["event"] == "checkpoint"]
    assert [e["samples"] for e in after][:2] == [320, 640] and after[-1]["samples"] == 1280
    assert after[0] == first[0]  # written before the resume point: kept as it was
    assert after[1]["bytes"] == first[1]["bytes"] and after[1]["write_s"] is None  # the one resumed from
    assert len(after) > 2 and all(e["bytes"] and e["write_s"] > 0 for e in after[2:])
