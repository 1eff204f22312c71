"""Help for people: `train --help` fits a screen, `--help-all` has every flag, usage errors are one line with
the hint to the help, unknown config keys get a "did you mean", and a live run is refused before anything else
is said about it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slipcache.cli import main
from slipcache.training import runlock
from slipcache.training.config import CONFIG_FIELDS
from slipcache.training.settings import flag_strings
from tests.helpers import make_dataset, tiny_config


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_train_help_shows_the_common_flags_on_one_screen(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    short = _help(["train", "--help"], capsys)
    assert len(short.splitlines()) <= 120
    for flag in ("--data", "--out", "--resume", "--precision", "--cache-size", "--quick", "--help-all", "--lr"):
        assert f"  {flag}" in short, flag
    assert "--stale-alpha" not in short and "--lr-warmup-steps" not in short  # research and details: --help-all
    assert "`slipcache train --help-all` shows every one" in " ".join(short.split())
    everything = _help(["train", "--help-all"], capsys)
    for name, f in CONFIG_FIELDS.items():
        if "help" in f.metadata:
            assert flag_strings(name, f)[0] in everything, name
    assert len(everything.splitlines()) > 2 * len(short.splitlines())


def test_the_generator_flag_lists_v5_as_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["train", "--help"], capsys)
    entry = " ".join(text[text.index("--generator") : text.index("--table-sizes")].split())
    assert entry.startswith("--generator {v5,v4,v3}") and "v5 (the default" in entry
    assert entry.endswith("(default v5)")


@pytest.mark.parametrize(("argv", "says"), [
    (["train", "--precision", "int3"], "argument --precision: invalid choice: 'int3'"),
    (["train", "--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["export", "--checkpoint", "x"], "the following arguments are required: --out"),
])
def test_a_bad_choice_or_type_is_one_line_with_the_hint(argv: list[str], says: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert says in err and f"(`slipcache {argv[0]} --help` lists the flags)" in err


def test_an_unknown_config_key_says_what_was_meant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    for text, meant in (("learning_rate = 0.1\n", "did you mean 'lr'"),
                        ("precison = 'int4'\n", "did you mean 'precision'"),
                        ("zzz = 1\n", "`slipcache train --help-all` lists every setting")):
        config.write_text(text)
        assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert meant in err and err.count("\n") == 1 and "allow_changes, " not in err  # no list of every key


def test_a_live_run_is_refused_before_anything_is_said_about_its_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that has just started has no checkpoint yet: a second `train --resume` on it says it is in use,
    first and only, not that it has no checkpoint and starts again."""
    from slipcache.training import trainer

    run = tmp_path / "run"
    trainer.train(tiny_config(make_dataset(tmp_path / "data", n=300), run, epochs=1))
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()  # as a run looks before its first checkpoint
    holder = runlock.acquire(run, "first")
    try:
        assert main(["train", "--resume", str(run), "--no-progress"]) == 3
        err = capsys.readouterr().err
    finally:
        holder.release()
    assert err.startswith("slipcache train: error: run directory") and "is in use by" in err
    assert "has no checkpoint" not in err and err.count("\n") == 1
