"""Crafted checkpoints (a valid checksum over content no run wrote) stop in one line and leave the run as
it was."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slipcache.cli import main
from slipcache.training.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import cli_fails, copy_run, file_contents, make_dataset, train_argv

pytestmark = pytest.mark.usefixtures("private_cache_dir")


def _set(path: str, value: object) -> Callable[[dict], None]:
    """A craft that sets the item at a dotted path ("progress.samples", "rng.python") to `value`."""

    def craft(state: dict) -> None:
        *parents, last = path.split(".")
        node: Any = state
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return craft


_DELETE = object()


CRAFTS = {
    "samples a string": (_set("progress.samples", "abc"), "progress.samples must be a non-negative integer"),
    "negative samples": (_set("progress.samples", -5), "progress.samples must be a non-negative integer"),
    "unknown progress field": (_set("progress.__class__", 1), "progress holds an unknown field '__class__'"),
    "events not a list": (_set("progress.events", 5), "progress.events must be a list of events"),
    "torch rng": (_set("rng.torch", torch.zeros(3, dtype=torch.uint8)), "rng.torch is not a generator state"),
    "numpy rng": (_set("rng.numpy.1", "keys"), "rng.numpy is not a generator state"),
    "python rng": (_set("rng.python", (3, (1, 2), None)), "rng.python is not a generator state"),
    "lr a string": (_set("dense_optimizer.param_groups.0.lr", "fast"), "dense_optimizer.param_groups[0].lr must be"),
    "groups not a list": (_set("dense_optimizer.param_groups", 5), "dense_optimizer must hold 'state'"),
    "a parameter short": (_set("dense_optimizer.param_groups.0.params", [0]), "dense_optimizer has groups of [1]"),
    "no dense": (_set("dense", _DELETE), "dense is missing"),
    "no progress": (_set("progress", _DELETE), "progress is missing"),
}


@pytest.mark.parametrize("name", list(CRAFTS))
def test_a_crafted_checkpoint_is_one_line_and_leaves_the_run_as_it_was(
    finished_run: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    craft, expected = CRAFTS[name]
    run = copy_run(finished_run, tmp_path / "run")
    latest = run / "checkpoints" / "latest.pt"
    state = load_checkpoint(latest)
    craft(state)
    latest.unlink()  # a hard link to the periodic file: replaced, not written through
    save_checkpoint(latest, state)  # a valid checksum over crafted content
    before = file_contents(run)
    cli_fails(["train", "--resume", str(run), "--no-progress"], capsys, expected)
    assert file_contents(run) == before  # metrics.jsonl, config.json, checkpoints: all as they were


@pytest.mark.parametrize("field", ["dtype", "shape"])
def test_a_crafted_raw_tensor_record_is_one_line(
    finished_run: Path, tmp_path: Path, field: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from slipcache.training import checkpoint

    run = copy_run(finished_run, tmp_path / "run")
    latest = run / "checkpoints" / "latest.pt"
    state = load_checkpoint(latest)
    real_write_raw = checkpoint._write_raw

    def crafted(f: Any, raw: list) -> None:
        real_write_raw(f, raw)
        raw[0][1][field] = "nn" if field == "dtype" else [-4, "x"]  # the record, before the payload is hashed

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "RAW_MIN_BYTES", 64)
        patch.setattr(checkpoint, "_write_raw", crafted)
        latest.unlink()
        save_checkpoint(latest, state)
    before = file_contents(run)
    cli_fails(["train", "--resume", str(run), "--no-progress"], capsys, f"a tensor record is damaged: {field}")
    assert file_contents(run) == before


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("world_size", "two", "world_size must be a number of processes"),
        ("world_size", 0, "world_size must be a number of processes"),
        ("world_size", 10**9, "world_size must be a number of processes"),
        ("files", ["trainer.pt"], "files must name trainer.pt and .metadata"),
        ("files", {"../../victim": 1, "trainer.pt": 1, ".metadata": 0}, "files must name trainer.pt and .metadata"),
        ("plan", ["x"], "plan is not a sharding plan"),
        ("sha256", {"trainer.pt": "0" * 64}, "sha256 must give every file's digest"),
    ],
)
def test_a_crafted_manifest_is_one_line_and_leaves_the_run_as_it_was(
    finished_run: Path, tmp_path: Path, field: str, value: object, expected: str, capsys: pytest.CaptureFixture
) -> None:
    from slipcache.training.step_checkpoint import file_digest

    run = copy_run(finished_run, tmp_path / "run")
    step = run / "checkpoints" / "step-000000999999"  # newer than the run's own: the one a resume takes
    step.mkdir()
    shutil.copyfile(run / "checkpoints" / "latest.pt", step / "trainer.pt")
    (step / ".metadata").write_bytes(b"")
    files = {"trainer.pt": (step / "trainer.pt").stat().st_size, ".metadata": 0}
    digests = {name: file_digest(step / name) for name in files}
    manifest = {"format": "slipcache-dcp-checkpoint", "version": 1, "world_size": 1, "samples": 999999,
                "files": files, "sha256": digests, "plan": {}, field: value}
    (step / "manifest.json").write_text(json.dumps(manifest))
    before = file_contents(run)
    cli_fails(["train", "--resume", str(run), "--no-progress"], capsys, f"manifest.json is malformed: {expected}")
    cli_fails(["eval", "--checkpoint", str(step)], capsys, f"manifest.json is malformed: {expected}")
    assert file_contents(run) == before


@pytest.mark.parametrize(
    ("craft", "expected"),
    [
        (lambda rows: rows.__setitem__(0, 10**8), "cache state holds row 100000000 outside [0, 192)"),
        (lambda rows: rows.__setitem__(slice(0, 2), int(rows.max())), "cache state holds a row in two slots"),
    ],
    ids=["row out of range", "row twice"],
)
def test_crafted_cache_state_with_a_valid_checksum(
    tmp_path: Path, capsys: pytest.CaptureFixture, craft, expected
) -> None:  # noqa: ANN001
    from slipcache.training import checkpoint

    data = make_dataset(tmp_path / "d", n=640)
    assert main(train_argv(data, tmp_path, "--embeddings", "cached", "--cache-size", "1")) == 0
    latest = tmp_path / "run" / "checkpoints" / "latest.pt"
    state = checkpoint.load_checkpoint(latest)
    craft(state["embeddings"]["cache.slot_rows"])
    latest.unlink()
    checkpoint.save_checkpoint(latest, state)  # a valid checksum over inconsistent content
    cli_fails(["eval", "--checkpoint", str(latest)], capsys, expected)

