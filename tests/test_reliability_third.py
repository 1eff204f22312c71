"""A run writes inside its directory and nowhere else, the newest complete checkpoint wins, and bad data or
crafted checkpoints stop in one line with the run left as it was."""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slipcache.cli import main
from slipcache.data import dataset as dataset_module
from slipcache.data.dataset import CriteoDataset, check_output_dir
from slipcache.errors import SlipcacheError
from slipcache.training import runlock
from slipcache.training.checkpoint import load_checkpoint, save_checkpoint
from slipcache.training.config import make_config
from slipcache.training.datasets import training_batches
from slipcache.training.saved_run import find_checkpoint
from slipcache.training.trainer import train
from tests.helpers import make_dataset, tiny_config


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))


def one_line(argv: list[str], capsys: pytest.CaptureFixture, expected: str, code: int = 2) -> str:
    """Run the CLI; it must fail with `code` and one line holding `expected` (no traceback)."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert expected in err.splitlines()[-1] and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------- labels
@pytest.mark.parametrize("value", [2.0, -1.0])
def test_labels_of_our_own_format_are_checked_when_it_trains(
    tmp_path: Path, value: float, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "data")
    labels = np.load(data / "train.labels.npy")
    np.save(data / "train.labels.npy", np.where(labels == 0, value, labels).astype(np.float32))
    one_line(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--embeddings", "torch",
              "--samples", "640", "--no-progress"], capsys, f"labels must be 0 or 1, found {value:g}")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_labels_past_the_opening_probe_are_checked_in_every_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_dataset(tmp_path / "data")
    labels = np.load(data / "train.labels.npy")
    labels[1500] = 2.0  # past the rows checked when the split is opened
    np.save(data / "train.labels.npy", labels)
    monkeypatch.setattr(dataset_module, "LABEL_PROBE_ROWS", 100, raising=False)
    split = CriteoDataset(data).split("train")
    with pytest.raises(SlipcacheError, match=r"train\.labels\.npy: labels must be 0 or 1, found 2 \(1 of"):
        for _ in training_batches(CriteoDataset(data), 64, seed=0, epoch=0):
            pass
    assert split.labels[:100].tolist() == labels[:100].tolist()


# ---------------------------------------------------------------------------------------- links
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short run that ended: resuming it writes config, metrics, a checkpoint, summary, report, plots."""
    root = tmp_path_factory.mktemp("finished")
    train(tiny_config(make_dataset(root / "data"), root / "run", epochs=1))
    return root / "run"


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


@pytest.mark.parametrize("name", ["metrics.jsonl", "report.md", "training.png", "summary.json", "config.json"])
def test_a_linked_run_file_is_replaced_and_its_target_never_written(
    finished_run: Path, tmp_path: Path, name: str
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / name).unlink()
    (run / name).symlink_to(victim)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert victim.read_text() == "precious\n"
    assert not (run / name).is_symlink() and (run / name).stat().st_size > 0


@pytest.mark.parametrize("name", ["run.lock", "checkpoints"])
def test_a_linked_lock_or_checkpoints_directory_is_refused_in_one_line(
    finished_run: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    victim = tmp_path / "victim"
    if name == "checkpoints":
        (run / name).rename(victim)
        before = sorted(p.name for p in victim.iterdir())
    else:
        victim.write_text("precious\n")
    (run / name).symlink_to(victim)
    metrics = (run / "metrics.jsonl").read_text()
    one_line(["train", "--resume", str(run), "--no-progress"], capsys, f"{run / name} is a symbolic link")
    if name == "checkpoints":
        assert sorted(p.name for p in victim.iterdir()) == before
    else:
        assert victim.read_text() == "precious\n"
    assert (run / "metrics.jsonl").read_text() == metrics


# ---------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("where", ["the run", "its parent", "inside it"])
def test_export_never_writes_into_or_over_the_run_it_reads(
    finished_run: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture
) -> None:
    run = copy_run(finished_run, tmp_path / "runs" / "run")
    out = {"the run": run, "its parent": run.parent, "inside it": run / "export"}[where]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    one_line(["export", "--checkpoint", str(run), "--out", str(out), "--force", "--format", "int8"],
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
    one_line(["export", "--checkpoint", str(finished_run), "--out", str(out), "--force", "--format", "int8"],
             capsys, f"holds a slipcache {kind}")
    assert sorted(str(p.relative_to(tmp_path)) for p in out.rglob("*")) == before


def test_export_force_respects_the_lock_of_a_run_in_use(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    busy = copy_run(finished_run, tmp_path / "busy")
    lock = runlock.acquire(busy, "someone")  # a live process (this one) holds it
    try:
        one_line(["export", "--checkpoint", str(finished_run), "--out", str(busy), "--force", "--format", "int8"],
                 capsys, f"run directory {busy} is in use by host", code=3)
    finally:
        lock.release()
    assert (busy / "checkpoints").is_dir()


# ---------------------------------------------------------------------------------------- the newest wins
def _checkpoint_events(run: Path) -> list[int]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [e["samples"] for e in events if e["event"] == "checkpoint"]


@pytest.mark.slow
def test_the_newest_checkpoint_wins_across_process_counts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """2 processes, then 1, then 1, then 2: every resume goes on from the newest checkpoint, whoever wrote
    it, and keeps the settings changed on the way."""
    from tests.distributed.test_training import _settings, _train_rank
    from tests.ranks import run_ranks

    data, run = make_dataset(tmp_path / "data", n=1500), tmp_path / "run"
    settings = {"precision": "fp32", "cache_size": 0.25, "samples": 320}
    run_ranks(_train_rank, _settings(str(data), str(run), settings))

    def resume(samples: int) -> None:
        train(make_config({}, {"resume": str(run), "samples": samples, "allow_changes": True,
                                       "progress": False}))

    capfd.readouterr()
    resume(640)  # 2 -> 1: re-sharded from step-320
    assert "written by 2 processes, into 1" in capfd.readouterr().out
    resume(960)  # 1 -> 1: from ckpt-640, not from the older step-320 again
    assert "re-sharding" not in capfd.readouterr().out
    assert [c["samples"] for c in json.loads((run / "config.json").read_text())["changed_on_resume"]] == [320, 640]
    run_ranks(_train_rank, {"resume": str(run), "samples": 1280, "allow_changes": True, "progress": False})
    assert "written by 1 process, over 2 processes" in capfd.readouterr().out  # from ckpt-960
    assert _checkpoint_events(run) == [320, 640, 960, 1280]
    history = json.loads((run / "config.json").read_text())["changed_on_resume"]
    assert [c["samples"] for c in history] == [320, 640, 960]
    assert find_checkpoint(run).path.name == "step-000000001280"


def test_what_a_kill_leaves_never_turns_a_resume_back(tmp_path: Path) -> None:
    """The states a kill -9 leaves between the writes of a checkpoint: the newest complete one wins."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"dataset": "d", "embeddings": "cached", "seed": 0}))
    for samples in (320, 960):  # N processes; the newer step lacks its manifest (killed while writing)
        step = checkpoints / f"step-{samples:012d}"
        step.mkdir()
        (step / "rank-0.pt").write_bytes(b"x")
    (checkpoints / "step-000000000320" / "manifest.json").write_text("{}")
    save_checkpoint(checkpoints / "ckpt-000000000640.pt", {"n": 640})  # 1 process, killed before latest.pt
    assert find_checkpoint(tmp_path / "run").path == (checkpoints / "ckpt-000000000640.pt").resolve()
    os.link(checkpoints / "ckpt-000000000640.pt", checkpoints / "latest.pt")
    assert find_checkpoint(tmp_path / "run").path == (checkpoints / "latest.pt").resolve()
    (checkpoints / "step-000000000960" / "manifest.json").write_text("{}")  # the step completed after all
    assert find_checkpoint(tmp_path / "run").path == (checkpoints / "step-000000000960").resolve()
    assert find_checkpoint(checkpoints / "step-000000000320").path.name == "step-000000000320"  # named: that one


# ---------------------------------------------------------------------------------------- crafted checkpoints
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


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


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
    before = _snapshot(run)
    one_line(["train", "--resume", str(run), "--no-progress"], capsys, expected)
    assert _snapshot(run) == before  # metrics.jsonl, config.json, checkpoints: all as they were


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
    before = _snapshot(run)
    one_line(["train", "--resume", str(run), "--no-progress"], capsys, f"a tensor record is damaged: {field}")
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("world_size", "two", "world_size must be a number of processes"),
        ("world_size", 0, "world_size must be a number of processes"),
        ("world_size", 10**9, "world_size must be a number of processes"),
        ("files", ["rank-0.pt"], "files must name rank-0.pt"),
        ("files", {"../../victim": 1}, "files must name rank-0.pt"),
        ("plan", {"format": "x"}, "plan is not a sharding plan"),
    ],
)
def test_a_crafted_manifest_is_one_line_and_leaves_the_run_as_it_was(
    finished_run: Path, tmp_path: Path, field: str, value: object, expected: str, capsys: pytest.CaptureFixture
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    step = run / "checkpoints" / "step-000000999999"  # newer than the run's own: the one a resume takes
    step.mkdir()
    shutil.copyfile(run / "checkpoints" / "latest.pt", step / "rank-0.pt")
    manifest = {"format": "slipcache-sharded-checkpoint", "version": 1, "world_size": 1, "samples": 999999,
                "files": {"rank-0.pt": (step / "rank-0.pt").stat().st_size}, "plan": {}, field: value}
    (step / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(run)
    one_line(["train", "--resume", str(run), "--no-progress"], capsys, f"manifest.json is malformed: {expected}")
    one_line(["eval", "--checkpoint", str(step)], capsys, f"manifest.json is malformed: {expected}")
    assert _snapshot(run) == before


# ---------------------------------------------------------------------------------------- minor ones
def test_a_run_killed_after_its_final_checkpoint_resumes_without_a_second_one(
    finished_run: Path, tmp_path: Path
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    (run / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    events = _checkpoint_events(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert _checkpoint_events(run) == events and len(set(events)) == len(events)
    assert json.loads((run / "summary.json").read_text())["last_checkpoint"]["samples"] == events[-1]


def test_a_dataset_whose_commit_was_cut_short_can_be_replaced_with_force(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data")
    (data / "meta.json").unlink()  # killed between removing the old meta.json and writing the new one
    assert check_output_dir(data, force=True) == data
    (data / "notes.txt").write_text("mine")
    with pytest.raises(SlipcacheError, match="is not empty and is not a slipcache dataset"):
        check_output_dir(data, force=True)


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
    with pytest.raises(SystemExit) as exc:  # argparse's usage errors exit; ours return
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert expected in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("value", "expected"), [(1e100, "--batch-size must fit a 64-bit integer"),
                                                 ("256", "batch_size: expected int, got '256'")])
def test_a_config_file_value_of_the_wrong_type_is_one_line(value: object, expected: str) -> None:
    with pytest.raises(SlipcacheError, match=expected):
        make_config({"batch_size": value})
    batch_size = make_config({"batch_size": 256.0}).batch_size
    assert batch_size == 256 and isinstance(batch_size, int)


def test_storage_path_on_a_file_and_sizes_on_a_tiny_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache import memory
    from slipcache.embedding.config import EmbeddingConfig

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for path, where in ((notes, "is a file"), (notes / "rows", "lies under the file")):
        config = EmbeddingConfig(table_sizes=[1000], dim=8, storage_path=str(path))
        with pytest.raises(SlipcacheError, match=where):
            memory.require_storage_room(config, "train")
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**6, 10**6 - 4096, 4096))
    config = EmbeddingConfig(table_sizes=[100_000], dim=16, storage_path=str(tmp_path / "rows"))
    with pytest.raises(SlipcacheError, match=r"needs \d+\.\d MB on disk under .*, which has 4\.1 kB free"):
        memory.require_storage_room(config, "train")
    assert notes.read_text() == "mine"


def test_preprocess_of_one_line_writes_no_dataset(tmp_path: Path) -> None:
    from slipcache.data.preprocess import preprocess

    line = "\t".join(["1", *["3"] * 13, *["0a1b2c3d"] * 26])
    (tmp_path / "day.tsv").write_text(line + "\n")
    with pytest.raises(SlipcacheError, match="1 valid input row leave the train split empty"):
        preprocess([tmp_path / "day.tsv"], tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()


def test_under_torchrun_the_error_line_says_torchrun_reports_next(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--quick"]) == 2  # torchrun's variables, but not all of them
    cause = "torchrun's report of the stopped processes, a ChildFailedError traceback, follows"
    assert cause in capsys.readouterr().err


def test_an_external_file_changed_in_place_with_its_time_kept_is_measured_again(tmp_path: Path) -> None:
    from slipcache.data import formats
    from tests.data.test_formats import write_torchrec

    write_torchrec(tmp_path / "tr", days=2, n=200)
    first = formats.open_any(tmp_path / "tr").table_sizes
    sparse = tmp_path / "tr" / "day_0_sparse.npy"
    stat = sparse.stat()
    ids = np.load(sparse)
    ids[:, 3] = first[3] + 7  # larger ids, same size: rewritten in place, its time put back
    np.save(sparse, ids)
    os.utime(sparse, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert formats.open_any(tmp_path / "tr").table_sizes[3] == first[3] + 8
