"""The README's TorchRec snippet is `examples/torchrec_quickstart.py`, and that file runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "torchrec_quickstart.py"


def _readme_torchrec_snippet() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using slipcache with TorchRec"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_snippet_is_the_examples_code() -> None:
    example = QUICKSTART.read_text().splitlines()
    missing = [line for line in _readme_torchrec_snippet() if line not in example]
    assert missing == []  # every line the README shows is a line of the file the next test runs


def test_the_torchrec_quickstart_runs() -> None:
    pytest.importorskip("torchrec", reason="the torchrec extra is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.match(r"loss 0\.\d{4}; embedding memory \d\.\d\dx less than fp32", done.stdout)
