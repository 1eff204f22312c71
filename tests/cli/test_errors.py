"""Bad input to the command stops in one line (exit code 2) naming what is wrong, without a traceback."""

from pathlib import Path

import pytest

from tests.helpers import cli_fails, make_dataset

pytestmark = pytest.mark.usefixtures("private_cache_dir")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "--seed", "-1", "--budget-gb", "1"], "a seed must be in [0, 2**32), got -1"),
        (["stats", "data", "--seed", "-1"], "a seed must be in [0, 2**32), got -1"),
        (["synth", "--out", "x", "--seed", "-1"], "a seed must be in [0, 2**32), got -1"),
        (["synth", "--out", "x", "--scale", "1e6"], "argument --scale: must be in (0, 8], got 1e6"),
        (["stats", "data", "--plot", "x.txt"], "argument --plot: expected a .png"),
        (["bench", "cache", "--out", "x", "--ways", "0"], "argument --ways: must be at least 1, got 0"),
        (["bench", "cache", "--out", "x", "--zipf", "nan"], "argument --zipf: must be in (0, 100], got nan"),
        (["train", "--lr", "1e308"], "lr must fit a float32"),
    ],
)
def test_flags_out_of_range(argv: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    cli_fails(argv, capsys, expected)


def test_hash_rows_beyond_int32_and_an_empty_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = tmp_path / "raw.tsv"
    raw.write_text(("1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a0b0c0d"] * 26) + "\n") * 10)
    cli_fails(["preprocess", str(raw), "--out", str(tmp_path / "o"), "--vocab", "hash", "--max-rows", "3000000000"],
              capsys, "--max-rows must be in [2, 2**31], got 3000000000")
    cli_fails(["train", "--out", ""], capsys, "need a directory name, got an empty one")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["plan", "--budget-gb", "1", "--threads", "100000"], {}, "--threads 100000 is more than 4 per core"),
        (["train", "--quick"], {"SLIPCACHE_THREADS": "abc"}, "SLIPCACHE_THREADS must be a positive integer, got 'abc'"),
        (["train", "--quick"], {"SLIPCACHE_THREADS": "0"}, "SLIPCACHE_THREADS must be a positive integer, got '0'"),
        (["train", "--quick"], {"SLIPCACHE_MEMORY_AVAILABLE_GB": "-5"},
         "SLIPCACHE_MEMORY_AVAILABLE_GB must be a non-negative number of GB, got '-5'"),
    ],
)
def test_threads_and_memory_settings_out_of_range(
    argv: list[str], env: dict[str, str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if argv[0] == "train":
        argv = [*argv, "--data", str(make_dataset(tmp_path / "data")), "--out", str(tmp_path / "run")]
    cli_fails(argv, capsys, expected)
    assert not (tmp_path / "run" / "checkpoints").exists()

