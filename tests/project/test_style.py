"""The code stays ruff-clean (configuration in pyproject.toml)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed with the [test] extra")
def test_ruff_clean() -> None:
    paths = ["src", "tests", "benchmarks", "tools", "examples"]
    result = subprocess.run(["ruff", "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
