"""The suite writes only under pytest's temporary directories: slipcache's cache, which runs would otherwise
share in the user's home (`$SLIPCACHE_CACHE_DIR`, else ~/.cache/slipcache), is the session's own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slipcache import _native
from slipcache.cache_dir import default_cache_root

ROOT = Path(__file__).resolve().parents[2]


def test_the_cache_lies_under_the_sessions_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    session = tmp_path_factory.getbasetemp().resolve()
    assert default_cache_root().resolve().is_relative_to(session)
    assert not default_cache_root().resolve().is_relative_to(Path.home().resolve() / ".cache")


def test_processes_the_tests_start_use_it_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    code = "from slipcache.cache_dir import default_cache_root; print(default_cache_root())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert Path(done.stdout.strip()).resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())


def test_the_compiled_loops_are_built_there(tmp_path_factory: pytest.TempPathFactory) -> None:
    library = _native.native()  # loaded while the test modules were collected
    if library is None:
        pytest.skip("no C compiler: the compiled loops are not built")
    assert Path(library._name).resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())


def test_no_module_but_cache_dir_names_the_home_cache() -> None:
    """Every write to the cache goes through `default_cache_root`, so pointing the variable covers them all."""
    pattern = re.compile(r"Path\.home\(\)|expanduser\(\s*['\"]~|['\"]~/\.cache|XDG_CACHE_HOME")
    named = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
        if path.name != "cache_dir.py" and pattern.search(path.read_text())
    ]
    assert named == []
