"""No lost work: Ctrl-C and SIGTERM write a checkpoint and stop, a finished run says so, a resume keeps how
the run computes (threads) unless told otherwise."""

from __future__ import annotations

import json
import os
import signal
import types
from pathlib import Path

import pytest
import torch

from slipcache import cli
from slipcache.errors import RunInterrupted
from slipcache.training import checkpoint, stopping, trainer
from slipcache.training import trainer as train
from slipcache.training.config import make_config
from tests.helpers import make_dataset
from tests.helpers import tiny_config as tiny


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _keep_threads() -> object:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _signal_at_call(monkeypatch: pytest.MonkeyPatch, n: int, signum: int) -> None:
    """Send this process `signum` from inside the n-th training step's loss (mid-step, as a user would)."""
    real_loss = train.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def loss(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), signum)
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train.F, "binary_cross_entropy_with_logits", loss)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow
def test_a_signal_writes_a_checkpoint_at_the_step_and_the_resume_ends_as_uninterrupted(
    signum: int, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    full = train.train(tiny(data_dir, tmp_path / "full"))
    handler = signal.getsignal(signum)
    _signal_at_call(monkeypatch, 13, signum)  # step 13: between the periodic checkpoints (every 10 steps)
    with pytest.raises(RunInterrupted) as stopped:
        train.train(tiny(data_dir, tmp_path / "part"))
    monkeypatch.undo()
    assert stopped.value.exit_code == 128 + signum
    assert f"--resume {tmp_path / 'part'}" in str(stopped.value) and "\n" not in str(stopped.value)
    assert signal.getsignal(signum) == handler  # put back
    state = checkpoint.load_checkpoint(tmp_path / "part" / "checkpoints")
    assert state["progress"]["samples"] == 13 * 64  # the step the signal came in, not the last periodic one
    assert "writing a checkpoint" in capsys.readouterr().err
    resumed = train.train(make_config({}, {"resume": str(tmp_path / "part"), "progress": False}))
    for key in ("auc", "logloss", "train_samples"):
        assert resumed[key] == full[key], key


def test_the_command_exits_130_on_ctrl_c_naming_the_resume(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _signal_at_call(monkeypatch, 5, signal.SIGINT)
    out = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(out), "--dim", "8", "--batch-size", "64", "--quiet"]
    assert cli.main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith(f"run: {out}\n")  # the run directory comes first, before training
    assert f"continue with `slipcache train --resume {out}`" in captured.err
    assert checkpoint.load_checkpoint(out / "checkpoints")["progress"]["samples"] == 5 * 64


def test_resuming_a_finished_run_says_it_was_complete(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = train.train(tiny(data_dir, tmp_path / "run"))
    capsys.readouterr()
    again = train.train(make_config({}, {"resume": str(tmp_path / "run"), "progress": False}))
    said = f"the run was already complete ({first['train_samples']:,} samples trained): nothing to train"
    assert said in capsys.readouterr().out
    assert again["auc"] == first["auc"] and again["train_samples"] == first["train_samples"]


def test_a_resume_keeps_the_runs_threads_unless_given(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt), pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "finish_run", lambda run: (_ for _ in ()).throw(KeyboardInterrupt))
        train.train(tiny(data_dir, run, threads=1))
    config = json.loads((run / "config.json").read_text())
    assert config["threads"] == 1
    torch.set_num_threads(2)
    seen: list[int] = []
    real_finish = train.finish_run

    def finish(run: object) -> object:  # inside the run, where its settings hold
        seen.append(torch.get_num_threads())
        return real_finish(run)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "finish_run", finish)
        train.train(make_config({}, {"resume": str(run), "progress": False}))
    assert json.loads((run / "config.json").read_text())["threads"] == 1 and seen == [1]
    assert torch.get_num_threads() == 2  # and the caller's setting is back afterwards
    train.train(make_config({}, {"resume": str(run), "progress": False, "threads": 2}))
    assert json.loads((run / "config.json").read_text())["threads"] == 2


def test_a_checkpoint_every_few_minutes_of_training(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = {"now": 0.0}
    monkeypatch.setattr(stopping, "time", types.SimpleNamespace(monotonic=lambda: clock["now"]))
    real_loss = train.F.binary_cross_entropy_with_logits

    def slow_step(*args: object, **kwargs: object) -> torch.Tensor:
        clock["now"] += 25.0  # every step takes 25 s on this clock
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train.F, "binary_cross_entropy_with_logits", slow_step)
    run = tmp_path / "run"
    train.train(tiny(data_dir, run, epochs=1, checkpoint_every=10**9, checkpoint_minutes=1.0))
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = [e["samples"] for e in events if e["event"] == "checkpoint"]
    assert saved == [3 * 64 * k for k in range(1, 11)] + [1984]  # 75 s > 1 min: every third step, then the end


@pytest.mark.usefixtures("private_cache_dir")
def test_sighup_writes_the_checkpoint_as_sigterm_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from slipcache.errors import RunInterrupted
    from slipcache.training import checkpoint as ckpt
    from tests.helpers import tiny_config

    data = make_dataset(tmp_path / "data", n=1000)
    real_loss = trainer.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def loss(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal closed
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(trainer.F, "binary_cross_entropy_with_logits", loss)
    # As under a terminal: a suite started under nohup inherits SIGHUP ignored, which the run keeps ignored.
    outer = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(RunInterrupted) as stopped:
            trainer.train(tiny_config(data, tmp_path / "run", epochs=1))
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # the run put back what it found
    finally:
        signal.signal(signal.SIGHUP, outer)
    assert stopped.value.exit_code == 128 + signal.SIGHUP
    assert ckpt.load_checkpoint(tmp_path / "run" / "checkpoints")["progress"]["samples"] == 3 * 64

