"""A run writes through no link: a linked run file is replaced, a linked lock or checkpoints directory and
a file with a second name (a hard link) are refused, and what the link points to is left untouched."""

import os
from pathlib import Path

import pytest

from slipcache.cli import main
from slipcache.training import trainer
from tests.helpers import cli_fails, cli_fails_in_one_line, copy_run, make_dataset

pytestmark = pytest.mark.usefixtures("private_cache_dir")


@pytest.mark.parametrize("name", ["metrics.jsonl", "report.md", "training.png", "summary.json", "config.json"])
def test_a_linked_run_file_is_replaced_and_its_target_never_written(
    finished_run: Path, tmp_path: Path, name: str
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / name).unlink()
    (run / name).symlink_to(victim)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert victim.read_text() == "precious\n"
    assert not (run / name).is_symlink() and (run / name).stat().st_size > 0


@pytest.mark.parametrize("name", ["run.lock", "checkpoints"])
def test_a_linked_lock_or_checkpoints_directory_is_refused_in_one_line(
    finished_run: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    victim = tmp_path / "victim"
    if name == "checkpoints":
        (run / name).rename(victim)
        before = sorted(p.name for p in victim.iterdir())
    else:
        victim.write_text("precious\n")
    (run / name).symlink_to(victim)
    metrics = (run / "metrics.jsonl").read_text()
    cli_fails(["train", "--resume", str(run), "--no-progress"], capsys, f"{run / name} is a symbolic link")
    if name == "checkpoints":
        assert sorted(p.name for p in victim.iterdir()) == before
    else:
        assert victim.read_text() == "precious\n"
    assert (run / "metrics.jsonl").read_text() == metrics


def _hard_link_to_a_victim(tmp_path: Path, at: Path) -> Path:
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("precious\n")
    at.parent.mkdir(parents=True, exist_ok=True)
    with_name = at
    if with_name.exists():
        with_name.unlink()
    os.link(victim, with_name)
    return victim


def test_a_hard_link_at_run_lock_is_refused_and_its_other_name_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tests.helpers import tiny_config

    data = make_dataset(tmp_path / "data", n=400)
    run = tmp_path / "run"
    trainer.train(tiny_config(data, run, epochs=1))
    victim = _hard_link_to_a_victim(tmp_path, run / "run.lock")
    metrics = (run / "metrics.jsonl").read_text()
    err = cli_fails_in_one_line(["train", "--resume", str(run), "--no-progress"], capsys,
                                f"{run / 'run.lock'} has 2 hard links")
    assert "never writes a run's file through a link" in err
    assert victim.read_text() == "precious\n"
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_rank_log_and_the_pruning_state_refuse_hard_links(tmp_path: Path) -> None:
    import sys
    import types

    from slipcache.distributed.launch import redirect_output
    from slipcache.safe_files import LinkRefusedError
    from slipcache.staleness.pruning import LossPruner

    run = tmp_path / "run"
    victim = _hard_link_to_a_victim(tmp_path, run / "rank-1.log")
    stdout = sys.stdout
    with pytest.raises(LinkRefusedError, match="rank-1.log has 2 hard links"):
        redirect_output(run, 1)
    assert sys.stdout is stdout and victim.read_text() == "precious\n"
    victim.unlink()
    victim = _hard_link_to_a_victim(tmp_path, run / "prune" / "prune_losses_0.u8")
    config = types.SimpleNamespace(skipping=types.SimpleNamespace(prune_share=0.5, prune_final=0.0),
                                   model=types.SimpleNamespace(seed=0), schedule=types.SimpleNamespace(samples=100))
    with pytest.raises(LinkRefusedError, match="prune_losses_0.u8 has 2 hard links"):
        LossPruner(config, 100, run / "prune")
    assert victim.read_text() == "precious\n"  # not resized to 100 bytes of zeros


def test_open_fd_truncates_only_after_the_check(tmp_path: Path) -> None:
    from slipcache.safe_files import LinkRefusedError, open_fd

    victim = _hard_link_to_a_victim(tmp_path, tmp_path / "run" / "file")
    with pytest.raises(LinkRefusedError):
        open_fd(tmp_path / "run" / "file", os.O_WRONLY | os.O_TRUNC)
    assert victim.read_text() == "precious\n"
    fifo = tmp_path / "run" / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(LinkRefusedError, match="is not a regular file"):
        open_fd(fifo, os.O_RDWR)
    fresh = open_fd(tmp_path / "run" / "new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fresh, b"x")
    os.close(fresh)
    assert (tmp_path / "run" / "new").read_bytes() == b"x"

