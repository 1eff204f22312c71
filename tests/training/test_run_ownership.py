"""A run directory has one writer (run.lock), a resume trains with the settings config.json records, a
checkpoint is tied to its data's fingerprint, and --tensorboard stays inside its run."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slipcache.cli import main
from slipcache.training import checkpoint, runlock, trainer
from slipcache.training import trainer as train
from slipcache.training.config import CONFIG_FIELDS, make_config
from tests.helpers import cli_fails_in_one_line, make_dataset
from tests.helpers import tiny_config as tiny


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), skewed=True)


def interrupted(data: Path, run: Path, monkeypatch: pytest.MonkeyPatch, **overrides: object) -> None:
    """A one-epoch run (31 batches of 64) stopped right after its second checkpoint (1280 samples)."""
    real = train.save_checkpoint
    calls = {"n": 0}

    def save_then_stop(r: Any) -> None:
        real(r)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(data, run, epochs=1, **overrides))
    monkeypatch.undo()


def resume_cli(run: Path, *flags: str) -> list[str]:
    return ["train", "--resume", str(run), "--no-progress", *flags]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ------------------------------------------------------------------------------------------- the lock
def test_a_second_writer_is_refused_naming_the_first(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch)
    assert not (run / runlock.LOCK_NAME).exists()  # released when the process stopped
    metrics = (run / "metrics.jsonl").read_bytes()
    holder = runlock.acquire(run, "other")  # another process, as far as flock can tell
    try:
        assert main(resume_cli(run)) == 3
        err = capsys.readouterr().err.strip()
        assert f"host {socket.gethostname()}, PID {os.getpid()}" in err and "\n" not in err
        assert "is in use by" in err
        assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing written by the refused one
    finally:
        holder.release()
    assert main(resume_cli(run)) == 0  # the holder gone, it resumes


def test_two_runs_into_one_new_out_directory(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    holder = runlock.acquire(out, "first")  # the first `train --out out` has just started
    try:
        code = main(["train", "--data", str(data_dir), "--out", str(out), "--no-progress", "--embeddings", "torch"])
        assert code == 3 and "is in use by" in capsys.readouterr().err
    finally:
        holder.release()


def test_a_stale_lock_after_a_crash_is_taken_over(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch)
    owner = {"host": socket.gethostname(), "pid": dead_pid(), "started": 0, "run_id": "x", "directory": str(run)}
    (run / runlock.LOCK_NAME).write_text(json.dumps(owner))  # what kill -9 leaves
    assert main(resume_cli(run)) == 0
    assert "stale run.lock" in capsys.readouterr().err
    assert not (run / runlock.LOCK_NAME).exists()


def test_a_lock_copied_with_the_run_is_not_ours(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch)
    owner = {"host": "elsewhere", "pid": os.getppid(), "started": 0, "run_id": "x", "directory": str(run)}
    (run / runlock.LOCK_NAME).write_text(json.dumps(owner))
    shutil.copytree(run, tmp_path / "copy")
    assert main(resume_cli(tmp_path / "copy")) == 0
    assert f"copied with the run from {run}" in capsys.readouterr().err


def test_without_flock_a_live_pid_on_this_host_still_holds_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "no locks")

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    owner = {"host": socket.gethostname(), "pid": os.getppid(), "started": 0, "directory": str(tmp_path)}
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(owner))
    with pytest.raises(runlock.RunLockedError, match=f"PID {os.getppid()}"):
        runlock.acquire(tmp_path, "me")
    owner["host"] = "elsewhere"
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(owner))
    with pytest.raises(runlock.RunLockedError, match="another machine"):
        runlock.acquire(tmp_path, "me")
    owner.update(host=socket.gethostname(), pid=dead_pid())
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(owner))
    runlock.acquire(tmp_path, "me").release()


def test_cleanup_deletes_only_our_temporary_files(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch)
    mine = [run / ".notes.tmp", run / "checkpoints" / ".draft.tmp"]
    ours = [run / "checkpoints" / ".ckpt-000000001920.pt.k2j_x9.tmp", run / ".summary.json.tmp"]
    for path in mine + ours:
        path.write_text("x")
    train.train(make_config({}, {"resume": str(run), "progress": False}))
    assert all(p.exists() for p in mine) and not any(p.exists() for p in ours)


# --------------------------------------------------------------------------- settings that take effect
CHANGED = {  # every setting a resume may change (--allow-changes), and a new valid value for it
    "lr": 0.11, "dense_lr": 0.07, "epochs": 2, "samples": 2560, "log_every": 128, "eval_every": 384,
    "eval_samples": 100, "checkpoint_every": 256, "keep_checkpoints": 3, "stale_target": 0.2,
    "stale_guard": False, "stale_guard_every": 7, "stale_alpha": 0.9, "stale_window": 0.05, "stale_recheck": 3,
    "stale_budget_mb": 64.0, "stale_min_updates": 3, "stale_count_share": 0.5, "stale_warmup": "epoch",
    "stale_warmup_epoch": 0, "stale_warmup_min": 0.2, "stale_warmup_tol": 0.01, "stale_decision": "epoch",
    "stale_keep": 0.1, "wire_precision": "bf16",
    "autocast": "bf16", "lr_schedule": "mlperf", "lr_warmup_steps": 0, "lr_decay_start": 5, "lr_decay_steps": 0,
    "stale_threshold_sample": 0.02, "stale_window_start": 0.9, "stale_window_start_max": 5,
}  # fmt: skip
SKIPPING = dict(skip_rule="stale", stale_window=0.1, stale_guard_every=4, stale_target=0.5, stale_warmup="none",
                stale_warmup_min=0.0, stale_min_updates=2, embeddings="cached", precision="fp32")


def test_every_resumable_setting_is_covered() -> None:
    resumable = {name for name, f in CONFIG_FIELDS.items() if f.metadata["resume"] == "changeable"}
    assert resumable == set(CHANGED)


def test_changed_settings_on_resume_are_what_trains(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch, **SKIPPING)
    seen: dict[str, Any] = {}
    real_finish = train.finish_run
    monkeypatch.setattr(train, "finish_run", lambda loop: seen.setdefault("loop", loop) and real_finish(loop))
    train.train(make_config({}, {"resume": str(run), "progress": False, "allow_changes": True, **CHANGED}))
    r = seen["loop"].run
    recorded = json.loads((run / "config.json").read_text())
    for name, value in CHANGED.items():
        assert recorded[name] == value and r.config.get(name) == value, name
    assert set(recorded["changed_on_resume"][-1]["changes"]) == set(CHANGED)
    # The copies each part keeps of a setting follow it, not the checkpoint:
    assert r.model.embeddings.lr == 0.11
    assert [g["lr"] for g in r.dense_opt.param_groups] == [0.07]
    skipper = next(c.skipper for c in seen["loop"].callbacks if c.state_key == "skipping")
    assert skipper.guard.base_target == 0.2 and skipper.detector.target <= 0.2
    assert r.budget == 2560 and r.consumed >= 2560  # trained + skipped reach the new budget
    final = checkpoint.load_checkpoint(run / "checkpoints")
    assert final["dense_optimizer"]["param_groups"][0]["lr"] == 0.07
    assert len([p for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-")]) == 3


def test_the_baseline_optimizer_takes_the_new_lr(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch)  # embeddings "torch": a torch SGD keeps the lr
    train.train(make_config({}, {"resume": str(run), "progress": False, "allow_changes": True, "lr": 0.05}))
    final = checkpoint.load_checkpoint(run / "checkpoints")
    assert final["embedding_optimizer"]["param_groups"][0]["lr"] == 0.05
    assert final["dense_optimizer"]["param_groups"][0]["lr"] == 0.05  # dense_lr unset: follows lr


def test_a_flag_given_with_its_default_value_counts_as_given(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch, lr=0.5)
    assert main(resume_cli(run, "--lr", "0.3")) == 2  # 0.3 is TrainConfig's default
    assert "lr 0.5 -> 0.3" in capsys.readouterr().err
    assert main(resume_cli(run, "--lr", "0.3", "--allow-changes")) == 0
    assert json.loads((run / "config.json").read_text())["lr"] == 0.3


def test_a_resume_with_changes_says_each_one_and_the_report_lists_them(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch, lr=0.5)
    capsys.readouterr()
    assert main(resume_cli(run, "--lr", "0.2", "--eval-every", "384", "--allow-changes")) == 0
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith("slipcache train: resuming with")]
    assert said == [
        "slipcache train: resuming with lr 0.5 → 0.2, at sample 1,280 (--allow-changes)",
        "slipcache train: resuming with eval_every 640 → 384, at sample 1,280 (--allow-changes)",
    ]
    report = (run / "report.md").read_text()
    section = report[report.index("## Settings changed on resume"):report.index("## Config")]
    assert "- lr 0.5 → 0.2, at sample 1,280" in section and "- eval_every 640 → 384, at sample 1,280" in section
    assert main(resume_cli(run, "--epochs", "2", "--allow-changes")) == 0  # a second resume adds to the history
    assert "resuming with epochs 1 → 2, at sample 1,984" in capsys.readouterr().out
    section = (run / "report.md").read_text().split("## Settings changed on resume")[1].split("## ")[0]
    assert [line for line in section.splitlines() if line.startswith("- ")] == [
        "- lr 0.5 → 0.2, at sample 1,280", "- eval_every 640 → 384, at sample 1,280", "- epochs 1 → 2, at sample 1,984",
    ]


def test_a_run_never_resumed_with_changes_has_no_such_section(data_dir: Path, tmp_path: Path) -> None:
    train.train(tiny(data_dir, tmp_path / "run", epochs=1))
    assert "Settings changed on resume" not in (tmp_path / "run" / "report.md").read_text()


# ------------------------------------------------------------------------------------- data fingerprint
def test_changed_data_under_a_run_is_refused_by_eval_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "data")
    run = tmp_path / "run"
    interrupted(data, run, monkeypatch)
    assert main(["eval", "--checkpoint", str(run)]) == 0
    make_dataset(data, nan_row=None, skewed=True)  # regenerated in place: same sizes, other rows
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not the data the run trained on (content differs" in err and "\n" not in err
    assert main(resume_cli(run)) == 2
    assert "--allow-changes" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--allow-changes"]) == 0
    assert main(resume_cli(run, "--allow-changes")) == 0
    recorded = json.loads((run / "config.json").read_text())
    assert "data_fingerprint" in recorded["changed_on_resume"][-1]["changes"]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 0  # the run now trained on this data


def test_a_run_from_before_fingerprints_and_locks_resumes_as_before(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch)
    for path in (run / "checkpoints").glob("*.pt"):
        state = checkpoint.load_checkpoint(path)
        for key in ("data_fingerprint", "run_id"):
            state["config"].pop(key)
        checkpoint.save_checkpoint(path, state)
    summary = train.train(make_config({}, {"resume": str(run), "progress": False}))
    assert summary["config"]["data_fingerprint"]["digest"] and summary["config"]["run_id"]


# ------------------------------------------------------------------------------------------ tensorboard
def test_tensorboard_dir_stays_inside_the_run_wherever_it_is_resumed(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    interrupted(data_dir, run, monkeypatch, tensorboard="tb")
    assert (run / "tb").is_dir() and not (work / "tb").exists()
    assert json.loads((run / "config.json").read_text())["tensorboard"] == "tb"
    shutil.copytree(run, tmp_path / "copy")
    shutil.rmtree(run / "tb")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    train.train(make_config({}, {"resume": str(tmp_path / "copy"), "progress": False}))
    assert (tmp_path / "copy" / "tb").is_dir()
    assert not (run / "tb").exists() and not (elsewhere / "tb").exists()  # never back to the original
    with pytest.raises(Exception, match="inside the run directory"):
        train.train(tiny(data_dir, tmp_path / "up", tensorboard="../tb"))


# ---------------------------------------------------------------------------------- ranks of one run
def _rank_apart(rank: int, world_size: int, data: list[str], out: str, results: str, rank1: dict[str, Any],
                hold_lock: bool) -> None:
    """Rank 1 starts with `rank1`'s settings and `data[1]`; each rank writes the error it stopped with."""
    from slipcache.errors import SlipcacheError
    from tests.distributed.test_training import _settings, _train_rank

    settings = _settings(data[rank], out, rank1 if rank == 1 else {})
    holder = runlock.acquire(Path(out), "another run") if hold_lock and rank == 0 else None
    try:
        _train_rank(rank, world_size, settings)
    except SlipcacheError as exc:
        Path(results, f"rank-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        if holder is not None:
            holder.release()


@pytest.mark.parametrize(
    ("rank1", "other_data", "hold_lock", "expected"),
    [
        ({"lr": 0.5}, False, False,
         "SlipcacheError: the ranks were started with different settings: lr is 0.3 on rank 0 but 0.5 on rank 1"),
        ({}, True, False, "SlipcacheError: the ranks were started with different settings: the data differ"),
        ({}, False, True, f"RunLockedError: run directory {{out}} is in use by host {socket.gethostname()}"),
    ],
    ids=["lr", "data", "locked"],
)
@pytest.mark.slow
def test_ranks_stop_together_on_different_settings_or_a_held_run(
    data_dir: Path, tmp_path: Path, rank1: dict[str, Any], other_data: bool, hold_lock: bool, expected: str
) -> None:
    from tests.ranks import exit_codes

    data = [str(data_dir), str(make_dataset(tmp_path / "other", n=2000, skewed=False) if other_data else data_dir)]
    out = tmp_path / "run"
    out.mkdir()
    assert exit_codes(_rank_apart, data, str(out), str(tmp_path), rank1, hold_lock) == [0, 0]
    for rank in range(2):
        message = (tmp_path / f"rank-{rank}.txt").read_text()
        assert message.startswith(expected.format(out=out)) and "\n" not in message, (rank, message)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def _train_pair(rank: int, world_size: int, data: str, out: str, extra: dict[str, Any], result: str) -> None:
    from slipcache.errors import SlipcacheError
    from tests.distributed.test_training import _settings, _train_rank

    try:
        _train_rank(rank, world_size, _settings(data, out, extra))
    except SlipcacheError as exc:
        Path(result, f"rank-{rank}.txt").write_text(str(exc))


@pytest.mark.slow
def test_a_damaged_newest_step_of_n_ranks_can_be_skipped(data_dir: Path, tmp_path: Path) -> None:
    from tests.ranks import exit_codes

    run = tmp_path / "run"
    assert exit_codes(_train_pair, str(data_dir), str(run), {}, str(tmp_path)) == [0, 0]
    steps = sorted((run / "checkpoints").glob("step-*"))
    newest = steps[-1] / "__1_0.distcp"  # rank 1's DCP file: its bytes are checked against the manifest
    raw = bytearray(newest.read_bytes())
    raw[-5] ^= 0xFF
    newest.write_bytes(bytes(raw))
    resume = {"resume": str(run), "allow_changes": True, "samples": 2560}
    assert exit_codes(_train_pair, str(data_dir), str(run), resume, str(tmp_path)) == [0, 0]
    for rank in range(2):  # every rank stops with the same line, naming the older step to resume from
        message = (tmp_path / f"rank-{rank}.txt").read_text()
        assert f"checkpoint {steps[-1]} is damaged (__1_0.distcp fails its checksum" in message
        assert f"--resume {steps[-2]}" in message
        (tmp_path / f"rank-{rank}.txt").unlink()
    resume["resume"] = str(steps[-2])
    assert exit_codes(_train_pair, str(data_dir), str(run), resume, str(tmp_path)) == [0, 0]
    assert not list(tmp_path.glob("rank-*.txt"))
    assert json.loads((run / "summary.json").read_text())["train_samples"] == 2560


@pytest.mark.usefixtures("private_cache_dir")
def test_a_lock_of_another_host_is_refused_with_the_way_forward(tmp_path: Path) -> None:
    import json

    from slipcache.training import runlock

    owner = {"host": "elsewhere", "pid": 1234, "started": 0, "run_id": "x", "directory": str(tmp_path.resolve())}
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(owner))
    with pytest.raises(runlock.RunLockedError, match=r"another machine; if that process is gone, delete .*run.lock"):
        runlock.acquire(tmp_path, "me")
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text()) == owner  # left as it was


@pytest.mark.usefixtures("private_cache_dir")
def test_a_relative_storage_path_is_recorded_absolute_and_used_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import json

    from tests.helpers import tiny_config

    data = make_dataset(tmp_path / "data", n=400)
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    monkeypatch.chdir(first)
    run = tmp_path / "run"
    trainer.train(tiny_config(data, run, embeddings="cached", storage_path="rows", epochs=1))
    recorded = json.loads((run / "config.json").read_text())["storage_path"]
    assert recorded == str(first / "rows")
    monkeypatch.chdir(other)
    assert main(["train", "--resume", str(run), "--samples", "640", "--allow-changes", "--no-progress"]) == 0
    assert not (other / "rows").exists()  # a resume elsewhere made no directory of its own
    assert json.loads((run / "config.json").read_text())["storage_path"] == str(first / "rows")
    # eval of a run whose storage directory became a file: said in eval's terms, not "--storage-path"
    shutil.rmtree(first / "rows", ignore_errors=True)
    (first / "rows").write_text("not a directory\n")
    capsys.readouterr()
    err = cli_fails_in_one_line(["eval", "--checkpoint", str(run)], capsys, f"the run's storage path {first / 'rows'}")
    assert "move that file away" in err and "give --storage-path" not in err

