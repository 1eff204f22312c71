"""The variables torchrun sets: a malformed one is one line, and under torchrun the error line says that
torchrun's own report follows."""

from pathlib import Path

import pytest
import torch

from slipcache.cli import main
from tests.helpers import cli_fails

pytestmark = pytest.mark.usefixtures("private_cache_dir")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE must be a non-negative integer, got 'abc'"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
          "SLIPCACHE_DIST_BACKEND": "nccl"}, "SLIPCACHE_DIST_BACKEND=nccl needs a CUDA GPU"),
    ],
)
def test_launch_variables(env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    if "nccl" in env.values() and torch.cuda.is_available():
        pytest.skip("a GPU is present: nccl is valid here")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cli_fails(["train", "--quick", "--out", str(tmp_path / "run")], capsys, expected)
    assert not (tmp_path / "run").exists()


def test_under_torchrun_the_error_line_says_torchrun_reports_next(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--quick"]) == 2  # torchrun's variables, but not all of them
    cause = "torchrun's report of the stopped processes, a ChildFailedError traceback, follows"
    assert cause in capsys.readouterr().err

