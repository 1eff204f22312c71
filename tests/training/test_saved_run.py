"""One way to find a run's checkpoint: `--resume`, `slipcache eval` and `slipcache export` agree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from slipcache.cli import main
from slipcache.errors import SlipcacheError
from slipcache.export import load_tables
from slipcache.training import trainer as train
from slipcache.training.checkpoint import save_checkpoint
from slipcache.training.cli import evaluate_checkpoint
from slipcache.training.saved_run import find_checkpoint
from tests.helpers import checkpoint_events, cli_fails, copy_run, make_dataset, train_argv
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


@pytest.mark.usefixtures("private_cache_dir")
def test_what_a_kill_leaves_never_turns_a_resume_back(tmp_path: Path) -> None:
    """The states a kill -9 leaves between the writes of a checkpoint: the newest complete one wins."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"dataset": "d", "embeddings": "cached", "seed": 0}))
    for samples in (320, 960):  # N processes; the newer step lacks its manifest (killed while writing)
        step = checkpoints / f"step-{samples:012d}"
        step.mkdir()
        (step / "rank-0.pt").write_bytes(b"x")
    (checkpoints / "step-000000000320" / "manifest.json").write_text("{}")
    save_checkpoint(checkpoints / "ckpt-000000000640.pt", {"n": 640})  # 1 process, killed before latest.pt
    assert find_checkpoint(tmp_path / "run").path == (checkpoints / "ckpt-000000000640.pt").resolve()
    os.link(checkpoints / "ckpt-000000000640.pt", checkpoints / "latest.pt")
    assert find_checkpoint(tmp_path / "run").path == (checkpoints / "latest.pt").resolve()
    (checkpoints / "step-000000000960" / "manifest.json").write_text("{}")  # the step completed after all
    assert find_checkpoint(tmp_path / "run").path == (checkpoints / "step-000000000960").resolve()
    assert find_checkpoint(checkpoints / "step-000000000320").path.name == "step-000000000320"  # named: that one


@pytest.mark.usefixtures("private_cache_dir")
def test_a_run_killed_after_its_final_checkpoint_resumes_without_a_second_one(
    finished_run: Path, tmp_path: Path
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    (run / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    events = checkpoint_events(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert checkpoint_events(run) == events and len(set(events)) == len(events)
    assert json.loads((run / "summary.json").read_text())["last_checkpoint"]["samples"] == events[-1]


@pytest.mark.usefixtures("private_cache_dir")
def test_eval_of_a_damaged_checkpoint_names_the_older_one_for_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "d", n=640)
    assert main(train_argv(data, tmp_path, "--checkpoint-every", "128")) == 0
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    raw = bytearray(latest.read_bytes())
    latest.unlink()
    raw[-10] ^= 0xFF
    latest.write_bytes(bytes(raw))
    cli_fails(["eval", "--checkpoint", str(tmp_path / "run")], capsys, "to use the newest: --checkpoint ")

