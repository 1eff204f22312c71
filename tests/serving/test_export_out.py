"""Where `slipcache export` writes: never into or over the run it reads, never over a run, a dataset or a
run in use, never through a link."""

import os
from pathlib import Path

import pytest

from slipcache.errors import SlipcacheError
from slipcache.training import runlock
from tests.helpers import cli_fails, copy_run, make_dataset

pytestmark = pytest.mark.usefixtures("private_cache_dir")


@pytest.mark.parametrize("where", ["the run", "its parent", "inside it"])
def test_export_never_writes_into_or_over_the_run_it_reads(
    finished_run: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture
) -> None:
    run = copy_run(finished_run, tmp_path / "runs" / "run")
    out = {"the run": run, "its parent": run.parent, "inside it": run / "export"}[where]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    cli_fails(["export", "--checkpoint", str(run), "--out", str(out), "--force", "--format", "int8"],
              capsys, "which the export reads; choose a directory outside it")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("kind", ["run", "dataset"])
def test_export_force_never_replaces_a_run_or_a_dataset(
    finished_run: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    if kind == "run":
        copy_run(finished_run, out / "nested" / "other-run")
    else:
        make_dataset(out)
    before = sorted(str(p.relative_to(tmp_path)) for p in out.rglob("*"))
    cli_fails(["export", "--checkpoint", str(finished_run), "--out", str(out), "--force", "--format", "int8"],
              capsys, f"holds a slipcache {kind}")
    assert sorted(str(p.relative_to(tmp_path)) for p in out.rglob("*")) == before


def test_export_force_respects_the_lock_of_a_run_in_use(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    busy = copy_run(finished_run, tmp_path / "busy")
    lock = runlock.acquire(busy, "someone")  # a live process (this one) holds it
    try:
        cli_fails(["export", "--checkpoint", str(finished_run), "--out", str(busy), "--force", "--format", "int8"],
                  capsys, f"run directory {busy} is in use by host", code=3)
    finally:
        lock.release()
    assert (busy / "checkpoints").is_dir()


def test_export_out_through_a_link_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    from slipcache import export

    target = tmp_path / "real"
    target.mkdir()
    (target / "old.txt").write_text("old\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(SlipcacheError, match=f"--out {link} is a symbolic link \\(to {target}\\)"):
        export.check_out(link, force=True)
    with pytest.raises(SlipcacheError, match="is a symbolic link"):
        export.export_tables([__import__("torch").zeros(3, 2)], link, ("fp32",), force=True)
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]  # no .replaced or staging directory left
    assert (target / "old.txt").read_text() == "old\n"

