"""Issue 12, trainer and CLI: runs never write into another run or the user's files, damaged checkpoints
and bad input get one-line errors, a full disk does not strand a run."""

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from slipcache.cli import main
from slipcache.errors import SlipcacheError
from slipcache.training import checkpoint
from slipcache.training import trainer as train
from slipcache.training.cli import evaluate_checkpoint
from slipcache.training.config import make_config
from tests.helpers import cli_fails, file_contents, make_dataset, train_argv
from tests.helpers import tiny_config as tiny


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


def interrupted_run(data_dir: Path, run: Path, monkeypatch: pytest.MonkeyPatch, **overrides: object) -> None:
    """A one-epoch run killed after its second checkpoint (at 1280 of 1984 samples)."""
    real_loss = torch.nn.functional.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def crash(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train.F, "binary_cross_entropy_with_logits", crash)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(data_dir, run, epochs=1, **overrides))
    monkeypatch.undo()


def resume(run: Path | str, **flags: object) -> dict:
    return train.train(make_config({}, {"resume": str(run), "progress": False, **flags}))


def cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_resume_writes_only_into_the_directory_it_names(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = tmp_path / "original"
    interrupted_run(data_dir, original, monkeypatch)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    before = file_contents(original)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (copy / "checkpoints" / ".latest.pt.x1y2.tmp").write_bytes(b"PK half")  # a write killed midway
    monkeypatch.chdir(elsewhere)  # a relative --resume from another working directory
    summary = resume(os.path.relpath(copy))
    assert not [p for p in (copy / "checkpoints").iterdir() if p.name.startswith(".")]
    assert Path(summary["run_dir"]) == copy and (copy / "summary.json").is_file()
    assert file_contents(original) == before  # the run the checkpoint came from is untouched
    assert list(elsewhere.iterdir()) == []  # and nothing appeared in the working directory

    with pytest.raises(SlipcacheError, match="already holds a run"):
        resume(original, out=str(copy))  # --resume A --out B never overwrites run B
    moved = tmp_path / "moved"
    assert Path(resume(original, out=str(moved))["run_dir"]) == moved  # a new --out is fine
    assert file_contents(original) == before
    assert json.loads((moved / "summary.json").read_text())["auc"] == summary["auc"]


def test_damaged_latest_names_the_complete_older_checkpoints(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    interrupted_run(data_dir, run, monkeypatch, keep_checkpoints=3)
    latest = run / "checkpoints" / "latest.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the payload: this used to load and train on
    latest.write_bytes(bytes(data))
    older = run / "checkpoints" / "ckpt-000000000640.pt"
    with pytest.raises(SlipcacheError, match="checksum mismatch") as info:
        resume(run)
    message = str(info.value)
    assert "\n" not in message and f"complete older checkpoints: {older.name}" in message
    assert f"--resume {older}" in message
    with pytest.raises(SlipcacheError, match="checksum mismatch"):
        evaluate_checkpoint(run)
    summary = resume(older)  # as the message says
    assert summary["train_samples"] == 1984 and Path(summary["run_dir"]) == run


def test_malformed_lines_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    raw = tmp_path / "day.tsv"
    lines = []
    for i in range(1000):
        cats = [f"{v:08x}" for v in rng.integers(0, 50, 26)]
        line = "\t".join([str(int(rng.random() < 0.3)), *map(str, rng.integers(0, 9, 13)), *cats])
        lines.append("not a criteo line" if i % 10 == 3 else line)
    raw.write_text("\n".join(lines) + "\n")
    config = tmp_path / "tiny.yaml"
    config.write_text("bottom_mlp: [16, 8]\ntop_mlp: [16, 1]\nembeddings: torch\nbatch_size: 64\n")
    run = tmp_path / "run"
    code = main(["train", "--config", str(config), "--data", str(raw), "--dim", "8", "--vocab", "hash",
                 "--max-rows", "64", "--out", str(run), "--no-progress"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0
    assert "100 of 1,000 lines of" in captured.err and f"{raw}:4: expected 15 to 40 fields, found 1" in captured.err
    assert "malformed lines" in captured.out
    quality = json.loads((run / "summary.json").read_text())["data_quality"]
    assert quality["malformed_lines"] == 100 and quality["good_lines"] == 900
    assert quality["examples"][1] == f"{raw}:14: expected 15 to 40 fields, found 1"
    report = (run / "report.md").read_text()
    assert "100 of 1,000 lines were malformed" in report and f"{raw}:24:" in report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "day.tsv", "run", "tiny.yaml"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache-size", "inf"], "--cache-size must be a finite number, got inf"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--seed", "-1"], "--seed must be in"),
        (["--seed", str(2**40)], "--seed must be in"),
        (["--samples", "-3"], "--samples must be positive, got -3"),  # the flag the user typed, named
        (["--dim", "0"], "--dim (embedding_dim) must be positive, got 0"),
    ],
)
def test_bad_flags_are_one_line_errors(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, err = cli(["train", "--out", str(tmp_path / "run"), *flags], capsys)
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_out_must_be_new_empty_or_a_run(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for out, message in [
        (a_file, "is a file, not a directory"),
        (a_file / "run", "cannot create run directory"),
        (tmp_path, "is not empty and is not a slipcache run directory"),
    ]:
        code, err = cli(["train", "--data", str(data_dir), "--out", str(out)], capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err
    monkeypatch.chdir(tmp_path)
    code, err = cli(["train", "--data", str(data_dir), "--out", "."], capsys)
    assert code == 2 and "not a slipcache run directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and a_file.read_text() == "mine"


class FullDisk:
    """A file whose writes fail with ENOSPC after `room` bytes, as on a full disk (torch.save turns that
    into a RuntimeError about the zip position)."""

    def __init__(self, f: object, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.f, name)

    def __enter__(self) -> "FullDisk":
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()  # type: ignore[attr-defined]


def disk_fills_after(monkeypatch: pytest.MonkeyPatch, checkpoints: int) -> None:
    """Checkpoint files after the first `checkpoints` find the disk full."""
    real_fdopen = os.fdopen
    calls = {"n": 0}

    def fdopen(fd: int, mode: str = "r", *args: object) -> object:
        calls["n"] += 1
        f = real_fdopen(fd, mode, *args)  # type: ignore[call-overload]
        return FullDisk(f, 10_000) if calls["n"] > checkpoints else f

    monkeypatch.setattr(checkpoint.os, "fdopen", fdopen)


def test_full_disk_at_the_first_checkpoint_does_not_strand_the_run(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    disk_fills_after(monkeypatch, 0)
    with pytest.raises(SlipcacheError, match="No space left on device; no checkpoint was written yet") as info:
        train.train(tiny(data_dir, run, epochs=1))
    assert "\n" not in str(info.value) and not list((run / "checkpoints").iterdir())
    monkeypatch.undo()
    assert resume(run)["train_samples"] == 1984  # starts again from its config.json
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    assert train.train(tiny(data_dir, run, epochs=1))["train_samples"] == 1984  # --out again works too


def test_full_disk_later_names_the_last_checkpoint(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    disk_fills_after(monkeypatch, 1)
    with pytest.raises(SlipcacheError, match=r"last complete checkpoint is .*ckpt-000000000640.pt; free space"):
        train.train(tiny(data_dir, run, epochs=1))
    monkeypatch.undo()
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] == []
    assert resume(run)["train_samples"] == 1984


def test_eval_rejects_bad_samples_and_crafted_checkpoints(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    train.train(tiny(Path(os.path.relpath(data_dir)), Path("run"), epochs=1))  # relative paths
    for samples in ("0", "-5"):
        with pytest.raises(SystemExit) as stopped:
            main(["eval", "--checkpoint", str(run), "--eval-samples", samples])
        assert stopped.value.code == 2 and "--eval-samples: must be at least 1" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the stored paths still work from another directory
    assert main(["eval", "--checkpoint", os.path.relpath(run), "--eval-samples", "100"]) == 0
    assert "100 samples" in capsys.readouterr().out

    state = checkpoint.load_checkpoint(run / "checkpoints")
    for bad_config, message in [
        ({**state["config"], "lr": "fast"}, "holds an invalid run config: lr: expected float"),
        ({**state["config"], "bottom_mlp": [-3, 8]}, "MLP layer sizes must be positive"),
        ({**state["config"], "batch_size": 0}, "--batch-size must be positive"),
        ("rm -rf /", "holds no run config"),
    ]:
        checkpoint.save_checkpoint(tmp_path / "crafted.pt", {**state, "config": bad_config})
        code, err = cli(["eval", "--checkpoint", str(tmp_path / "crafted.pt")], capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err
    checkpoint.save_checkpoint(tmp_path / "crafted.pt", {**state, "table_sizes": "many"})
    code, err = cli(["eval", "--checkpoint", str(tmp_path / "crafted.pt")], capsys)
    assert code == 2 and "is malformed: table_sizes must be a list of positive row counts" in err


def test_dim_moves_the_bottom_mlp(data_dir: Path, tmp_path: Path) -> None:
    assert make_config({}, {"embedding_dim": 32}).model.bottom_mlp == [512, 256, 64, 32]
    assert make_config({}, {"quick": True, "embedding_dim": 32}).model.bottom_mlp == [128, 64, 32]
    assert make_config({}, {"embedding_dim": 32, "bottom_mlp": [8, 32]}).model.bottom_mlp == [8, 32]
    config = make_config({}, {"data": str(data_dir), "out": str(tmp_path / "run"), "embedding_dim": 32,
                                    "embeddings": "torch", "samples": 256, "progress": False})  # fmt: skip
    assert train.train(config)["train_samples"] == 256


@pytest.mark.parametrize(
    ("free_gb", "said"),
    [
        (2.5, "room for 2: the run will stop at a checkpoint that does not fit; give --keep-checkpoints 1"),
        (1.5, "room for 1: the run will stop at a checkpoint that does not fit; give --checkpoint-every"),
        (3.5, None),  # three at once fit: nothing said
    ],
)
def test_checkpoints_the_disk_cannot_hold_are_said_at_the_start(
    free_gb: float, said: str | None, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(checkpoint, "tensor_bytes", lambda state: 10**9)  # each checkpoint: 1 GB
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=int(free_gb * 1e9)))
    train.train(tiny(data_dir, tmp_path / "run", epochs=1))  # 4 checkpoints, 2 kept: 3 on disk at once
    err = capsys.readouterr().err
    if said is None:
        assert "checkpoint" not in err
    else:
        assert said in err and "take about 1.0 GB each and 3 new ones are on disk at once" in err
        assert err.count("\n") == 1
    # one checkpoint at the end (timed ones are not counted: their number depends on the speed): room for one
    train.train(tiny(data_dir, tmp_path / "once", epochs=1, checkpoint_every=10**6))
    assert "checkpoint" not in capsys.readouterr().err


def test_a_run_whose_checkpoint_cannot_fit_stops_before_training(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint, "tensor_bytes", lambda state: 10**9)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=int(0.4e9)))
    with pytest.raises(SlipcacheError, match=r"takes about 1\.0 GB and .* has 400\.0 MB free: not one fits"):
        train.train(tiny(data_dir, tmp_path / "run", epochs=1))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_start_that_fails_leaves_no_empty_run_directory(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("mine")
    for out in ([], ["--out", str(tmp_path / "new" / "run")]):  # runs/<time> by default, or a new --out
        code, err = cli(["train", "--quick", "--storage-path", str(tmp_path / "a-file"), *out], capsys)
        assert code == 2 and "is a file; give a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    existing = tmp_path / "mine"
    existing.mkdir()
    cli(["train", "--quick", "--storage-path", str(tmp_path / "a-file"), "--out", str(existing)], capsys)
    assert existing.is_dir()  # a directory the user made stays


@pytest.mark.usefixtures("private_cache_dir")
def test_nan_dense_values_in_the_test_split_stop_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    data = make_dataset(tmp_path / "d", n=640)
    assert main(train_argv(data, tmp_path)) == 0
    dense = np.load(data / "test.dense.npy")
    dense[3, 0] = np.nan
    np.save(data / "test.dense.npy", dense)
    cli_fails(["eval", "--checkpoint", str(tmp_path / "run"), "--allow-changes"], capsys,
              "1 of 160 predictions are not finite")


def test_tensorboard_without_the_extra_is_refused_before_anything_is_made(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the tensorboard extra not installed
    out = tmp_path / "new" / "run"
    code, err = cli(["train", "--data", str(data_dir), "--tensorboard", "--epochs", "1", "--no-progress",
                     "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and "pip install 'slipcache[tensorboard]'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory (nor its parent) to block a retry
    with pytest.raises(SlipcacheError, match="needs the tensorboard package"):
        train.train(tiny(data_dir, out, epochs=1, tensorboard=""))  # the library call refuses the same way
    assert not (tmp_path / "new").exists()
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard")
    train.train(tiny(data_dir, out, epochs=1))  # the retry without --tensorboard starts in the same place
    assert (out / "report.md").is_file()
