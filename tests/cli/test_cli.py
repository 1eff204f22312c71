"""The `slipcache` command's own behaviour (argument handling shared by every subcommand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipcache.cli import build_parser, main


def test_unknown_flag_is_reported_by_its_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    # `--no-progress` belongs to train; given to eval it must point at eval's usage, not the top-level one.
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--checkpoint", "run", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "slipcache eval: error: unrecognized arguments: --no-progress (`slipcache eval --help` lists the flags)\n"
    )


def test_a_misspelt_flag_names_the_closest_one_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--cache-sise", "0.1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "slipcache train: error: unrecognized arguments: --cache-sise 0.1 (did you mean --cache-size?)\n"
    )


def test_unknown_flag_without_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--bogus"])
    assert exc.value.code == 2
    assert "slipcache: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_synth_out_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes").write_text("mine")
    assert main(["synth", "--out", str(tmp_path / "notes"), "--samples", "1000", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"slipcache synth: error: --out {tmp_path / 'notes'} is a file, not a directory"


def test_every_long_job_takes_quiet_and_no_progress() -> None:
    # One flag under both spellings everywhere: users learnt --no-progress on plan and tried it on stats.
    required = {"train": [], "plan": ["--budget-gb", "1"], "preprocess": ["in.txt", "--out", "o"], "synth": [],
                "stats": ["data"]}  # fmt: skip
    for command, argv in required.items():
        for flag in ("--quiet", "--no-progress"):
            assert build_parser(command).parse_args([command, *argv, flag]).progress is False, (command, flag)
