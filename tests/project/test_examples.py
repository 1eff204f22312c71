"""The README's Python snippets are files under examples/ (the library one and the TorchRec one), and those
files run and print what the README says they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "torchrec_quickstart.py"
LIBRARY = ROOT / "examples" / "library_quickstart.py"


def _readme_snippet(heading: str) -> tuple[list[str], str]:
    """The lines of the first Python block under `heading`, and the README's text after it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()], section[block.end():]


def _readme_torchrec_snippet() -> list[str]:
    return _readme_snippet("## Using slipcache with TorchRec")[0]


def test_the_readme_library_snippet_is_the_examples_code() -> None:
    lines, _ = _readme_snippet("### As a library")
    assert lines == [line for line in LIBRARY.read_text().split('"""')[-1].splitlines() if line.strip()]


LIBRARY_OUTPUT = (r"cache hit rate (\d\.\d\d) after 10 batches \((\d\.\d\d) after the first: the cache starts empty\); "
                  r"embedding memory (\d\.\d\d)x less than fp32")


def test_the_library_quickstart_prints_what_the_readme_says(capsys: pytest.CaptureFixture) -> None:
    import runpy

    runpy.run_path(str(LIBRARY), run_name="__main__")
    printed = re.fullmatch(LIBRARY_OUTPUT, capsys.readouterr().out.strip())
    assert printed is not None
    _, after = _readme_snippet("### As a library")
    quoted = re.search(LIBRARY_OUTPUT, " ".join(after.strip().split("\n\n")[0].split()))  # the paragraph after the code
    assert quoted is not None
    hit_rate, first, ratio = (float(x) for x in printed.groups())
    assert first == 0.0 and float(quoted.group(2)) == 0.0  # the first batch finds an empty cache: all misses
    assert ratio == float(quoted.group(3))  # the bytes do not depend on the ids
    assert abs(hit_rate - float(quoted.group(1))) < 0.05 and hit_rate > 0.4  # uniform random ids: it varies a little


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
