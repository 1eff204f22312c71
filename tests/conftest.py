"""Fixtures shared across test modules."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# One torch thread unless a test asks for more, in this process and in the processes tests start: the runs
# here are tiny, and on 2 cores (or a loaded machine) a second OpenMP thread mostly spins, tripling the CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads once)

torch.set_num_threads(1)

CACHE_VARIABLE = "SLIPCACHE_CACHE_DIR"


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path plugin has set up the session's temporary root
def pytest_configure(config: pytest.Config) -> None:
    """slipcache's cache (generated and converted data, the compiled loops) lies under this session's
    temporary directory, for the suite and for every process it starts: a test run never writes into the
    user's cache (`$SLIPCACHE_CACHE_DIR`, else ~/.cache/slipcache). Set here, before collection, since
    test modules load the compiled loops when they are imported (their skip marks). The compiled loops
    are built once per session (about 3 s of CPU), the data each test generates once per session."""
    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]
    config.stash[_USERS_CACHE] = os.environ.get(CACHE_VARIABLE)
    os.environ[CACHE_VARIABLE] = str(factory.mktemp("slipcache-cache", numbered=False))


def pytest_unconfigure(config: pytest.Config) -> None:
    users = config.stash.get(_USERS_CACHE, None)
    if users is None:
        os.environ.pop(CACHE_VARIABLE, None)
    else:
        os.environ[CACHE_VARIABLE] = users


_USERS_CACHE = pytest.StashKey[str | None]()


@pytest.fixture(autouse=True)
def console_messages() -> Iterator[None]:
    """The library's log records printed as the command prints them (`slipcache.console`), also for tests
    that call the library directly: what they read on stdout and stderr is what a user of the command sees."""
    from slipcache.console import console_messages as show

    with show():
        yield


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One `slipcache train --quick` (the run directory and what it printed), shared by the tests that
    check the first-contact run and the ones that compare against it: the run is the suite's most costly."""
    from slipcache.cli import main

    run = tmp_path_factory.mktemp("quick") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", "--quick", "--no-progress", "--out", str(run)]) == 0
    return run, out.getvalue()


@pytest.fixture
def private_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """slipcache's cache (converted data, compiled loops) in the test's own directory: tmp_path/cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short run that ended (one epoch of `tiny_config`): resuming it writes config, metrics, a checkpoint,
    summary, report, plots. Tests that change it change a copy (`helpers.copy_run`)."""
    from slipcache.training.trainer import train
    from tests.helpers import make_dataset, tiny_config

    root = tmp_path_factory.mktemp("finished")
    train(tiny_config(make_dataset(root / "data"), root / "run", epochs=1))
    return root / "run"
