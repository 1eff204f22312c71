"""`slipcache train` as 2 gloo processes under DistributedModelParallel: equal to 1 process, the gathered
test AUC equal to a one-process evaluation of the saved model, exact resume from its DCP checkpoint, a
resume on another number of processes, one-line refusals, and a clear stop when a rank dies."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from slipcache.errors import SlipcacheError
from slipcache.training import trainer
from slipcache.training.cli import evaluate_checkpoint
from slipcache.training.config import make_config
from tests.helpers import make_dataset
from tests.ranks import exit_codes, run_ranks

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")


def _train_rank(rank: int, world_size: int, values: dict[str, Any]) -> None:
    """One rank of `slipcache train` as torchrun would start it (the group is already joined)."""
    from slipcache.distributed.launch import init_from_env
    from slipcache.distributed.training import train_on_ranks

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    context = init_from_env()
    assert context is not None and context.threads >= 1
    train_on_ranks(make_config({}, values), context)


def _settings(data: str, out: str, settings: dict[str, Any]) -> dict[str, Any]:
    base = {"data": data, "out": out, "embeddings": "cached", "embedding_dim": 8, "bottom_mlp": [16, 8]}
    base.update(top_mlp=[16, 1], batch_size=64, epochs=1, log_every=64, eval_every=640, checkpoint_every=320)
    base.update(progress=False)
    return {**base, **settings}


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), n=1500)


@pytest.mark.slow
def test_two_processes_train_like_one_and_one_process_evaluates_the_same_auc(data_dir: Path, tmp_path: Path) -> None:
    """fp32 tables: the same global batches give the same losses and metrics as one process (summation
    order only), and the gathered test AUC is what one process computes from the saved model (1e-9)."""
    settings = {"precision": "fp32", "cache_size": 0.25}
    one = trainer.train(make_config({}, _settings(str(data_dir), str(tmp_path / "one"), settings)))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "two"), settings))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    single, double = _events(tmp_path / "one"), _events(tmp_path / "two")
    saved = [[e for e in events if e["event"] == "checkpoint"] for events in (single, double)]
    assert [e["samples"] for e in saved[0]] == [e["samples"] for e in saved[1]]
    assert all(e["bytes"] > 0 for e in saved[1])  # every file of the step, as its manifest records them
    single, double = ([e for e in events if e["event"] == "train"] for events in (single, double))
    assert len(single) == len(double) > 10
    for a, b in zip(single, double, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
        if "val_auc" in a:
            assert b["val_auc"] == pytest.approx(a["val_auc"], abs=1e-6)
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-6)
    assert two["logloss"] == pytest.approx(one["logloss"], abs=1e-6)
    assert two["test_samples"] == one["test_samples"]  # metrics over the whole split, gathered
    assert two["distributed"]["world_size"] == 2 and len(two["memory_per_rank"]) == 2
    assert sorted(two["distributed"]["plan"]) == sorted(f"t{i}" for i in range(len(two["table_sizes"])))
    assert (tmp_path / "two" / "rank-1.log").is_file()
    assert not list((tmp_path / "two").glob("rank-0*"))  # rank 0 writes the run's files, and no log of its own
    step = sorted((tmp_path / "two" / "checkpoints").glob("step-*"))[-1]
    assert (step / "manifest.json").is_file() and (step / ".metadata").is_file()
    # one process reads the DCP checkpoint (fp32 rows: exact) and evaluates the same model
    again = evaluate_checkpoint(tmp_path / "two")
    assert again["auc"] == pytest.approx(two["auc"], abs=1e-9)
    assert again["samples"] == two["test_samples"]


def _group_threads() -> list[str]:
    names = (Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))
    return [name for name in names if "gloo" in name or "tcpstore" in name]


def _train_rank_counting_threads(rank: int, world_size: int, values: dict[str, Any]) -> None:
    dist.barrier()  # gloo starts its worker threads with the first collective
    assert _group_threads()
    _train_rank(rank, world_size, values)
    # They ended with the group, not at interpreter exit, where one still releasing a tensor aborts the
    # process (SIGABRT after a good run, about 1 run in 40 on a loaded machine).
    assert not dist.is_initialized() and _group_threads() == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_rank_leaves_no_group_thread_behind_when_it_returns(data_dir: Path, tmp_path: Path) -> None:
    run_ranks(_train_rank_counting_threads, _settings(str(data_dir), str(tmp_path / "run"), {"samples": 640}))


@pytest.mark.slow
def test_int8_cache_run_on_two_processes_resumes_exactly(data_dir: Path, tmp_path: Path) -> None:
    """INT8 rows, an LFU cache, stochastic rounding: the DCP checkpoint with each rank's caches and
    generators resumes bit for bit; one process evaluates it within 1e-3 (the cached fp32 rows are saved
    rounded to nearest into INT8)."""
    settings = {"precision": "int8", "cache_size": 0.25, "policy": "lfu", "samples": 1280}
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "full"), settings))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "part"), {**settings, "samples": 640}))
    run_ranks(
        _train_rank,
        {"resume": str(tmp_path / "part"), "samples": 1280, "allow_changes": True, "progress": False},
    )
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    resumed = json.loads((tmp_path / "part" / "summary.json").read_text())
    for key in ("auc", "logloss", "train_samples"):
        assert resumed[key] == full[key], key
    losses = [[e["train_loss"] for e in _events(tmp_path / run) if e["event"] == "train"] for run in ("full", "part")]
    assert losses[0] == losses[1]
    assert evaluate_checkpoint(tmp_path / "full")["auc"] == pytest.approx(full["auc"], abs=1e-3)


@pytest.mark.slow
def test_rows_in_files_on_two_processes_train_and_resume_as_rows_in_memory(data_dir: Path, tmp_path: Path) -> None:
    """--storage-path on 2 processes: each rank keeps its shards' INT8 rows in unnamed files there (nothing
    is left in the directory), trains bit for bit as the same run with its rows in memory, and a resume from
    its checkpoint in the middle reads the rows back into files and ends as the uninterrupted run."""
    settings = {"precision": "int8", "cache_size": 0.25, "samples": 1280}
    rows = tmp_path / "rows"
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "memory"), settings))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "files"), {**settings, "storage_path": str(rows)}))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "part"),
                                     {**settings, "storage_path": str(rows), "samples": 640}))
    run_ranks(_train_rank, {"resume": str(tmp_path / "part"), "samples": 1280, "allow_changes": True,
                            "progress": False})
    assert rows.is_dir() and not any(rows.iterdir())  # made by the first storage file, none left
    runs = ("memory", "files", "part")
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in runs]
    for key in ("auc", "logloss", "train_samples"):
        assert summaries[0][key] == summaries[1][key] == summaries[2][key], key
    losses = [[e["train_loss"] for e in _events(tmp_path / run) if e["event"] == "train"] for run in runs]
    assert losses[0] == losses[1] == losses[2]


def _train_rank_saying(rank: int, world_size: int, values: dict[str, Any], result: str) -> None:
    """`_train_rank`, its one-line error written to `result` + rank."""
    try:
        _train_rank(rank, world_size, values)
    except SlipcacheError as exc:
        Path(result + str(rank)).write_text(str(exc))
        raise SystemExit(2) from exc


@pytest.mark.slow
def test_a_storage_path_under_a_file_stops_every_rank_in_one_line(data_dir: Path, tmp_path: Path) -> None:
    """--storage-path under a file: asked once a machine (as is its disk's free space), before any shard is
    built; every rank stops with the same line."""
    (tmp_path / "a-file").write_text("")
    values = _settings(str(data_dir), str(tmp_path / "run"), {"storage_path": str(tmp_path / "a-file" / "rows")})
    assert exit_codes(_train_rank_saying, values, str(tmp_path / "said")) == [2, 2]
    lines = {(tmp_path / f"said{rank}").read_text() for rank in (0, 1)}
    assert lines == {f"--storage-path {tmp_path / 'a-file' / 'rows'} lies under the file {tmp_path / 'a-file'}; "
                     "give a directory (new or existing)"}
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_two_process_run_resumes_on_one(data_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """2 -> 1 process: the whole tables and their optimizer state read from the DCP checkpoint (fp32:
    exactly); the run continues as the uninterrupted one-process run does, and says what it did."""
    settings = {"precision": "fp32", "cache_size": 0.25, "samples": 640, "optimizer": "adagrad"}
    full = trainer.train(make_config({}, _settings(str(data_dir), str(tmp_path / "full"), settings)))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "two"), {**settings, "samples": 320}))
    capfd.readouterr()
    one = trainer.train(make_config({}, {"samples": 640, "allow_changes": True, "progress": False,
                                         "resume": str(tmp_path / "two")}))
    assert "written by 2 processes, into 1" in capfd.readouterr().out
    assert one["train_samples"] == full["train_samples"]
    assert one["auc"] == pytest.approx(full["auc"], abs=1e-5)
    assert one["logloss"] == pytest.approx(full["logloss"], abs=1e-5)


@pytest.mark.slow
def test_a_two_process_run_resumes_on_three(data_dir: Path, tmp_path: Path) -> None:
    """2 -> 3 processes: DCP re-shards the tables and their optimizer state over three ranks as they load
    (fp32, row-wise Adagrad); the run ends where the uninterrupted run ends (summation order only)."""
    settings = {"precision": "fp32", "cache_size": 0.25, "samples": 1152, "optimizer": "adagrad",
                "batch_size": 96, "log_every": 96, "eval_every": 576, "checkpoint_every": 288}
    full = trainer.train(make_config({}, _settings(str(data_dir), str(tmp_path / "full"), settings)))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "run"), {**settings, "samples": 576}))
    resume = {"resume": str(tmp_path / "run"), "samples": 1152, "allow_changes": True, "progress": False}
    run_ranks(_train_rank, resume, world_size=3)
    three = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert three["distributed"]["world_size"] == 3 and len(three["memory_per_rank"]) == 3
    assert three["train_samples"] == full["train_samples"]
    assert three["auc"] == pytest.approx(full["auc"], abs=1e-5)
    assert three["logloss"] == pytest.approx(full["logloss"], abs=1e-5)
    resumed = [e for e in _events(tmp_path / "run") if e["event"] == "train" and e["samples"] > 576]
    expected = [e for e in _events(tmp_path / "full") if e["event"] == "train" and e["samples"] > 576]
    assert [e["samples"] for e in resumed] == [e["samples"] for e in expected]
    for a, b in zip(expected, resumed, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_half_precision_on_the_wire_trains_as_fp32_does_within_its_rounding(data_dir: Path, tmp_path: Path) -> None:
    """--wire-precision fp16 / bf16: TorchRec's codecs round the pooled rows and their gradients on the
    all-to-all, so the losses move off fp32's by about their rounding, not more (and not by nothing)."""
    settings = {"precision": "fp32", "cache_size": 0.25, "samples": 640}
    losses = {}
    for wire in ("fp32", "fp16", "bf16"):
        run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / wire), {**settings, "wire_precision": wire}))
        losses[wire] = [e["train_loss"] for e in _events(tmp_path / wire) if e["event"] == "train"]
    assert len(losses["fp32"]) == 10
    for wire, bound in (("fp16", 1e-3), ("bf16", 1e-2)):
        gaps = [abs(a - b) / a for a, b in zip(losses["fp32"], losses[wire], strict=True)]
        assert 0 < max(gaps) < bound, (wire, max(gaps))
    recorded = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert recorded["wire_precision"] == "fp16"


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "stale_rule"), [("random", "paper"), ("stale", "paper"), ("stale", "convergence")])
def test_skipping_across_two_processes_trains_like_one(tmp_path: Path, rule: str, stale_rule: str) -> None:
    """Every rank profiles the same hot set and decides on the global positions and the gathered logits;
    `random` reads no rows; `stale` reads the hot rows from every rank's shards at once (the planner cuts
    these tables row-wise): the paper rule its snapshots, the convergence rule the rows updated often enough,
    counted on the global batch that every rank reads. So 2 processes skip the same inputs and train like 1
    (fp32 tables)."""
    data = make_dataset(tmp_path / "data", n=1500, skewed=True)
    settings = {"precision": "fp32", "cache_size": 0.25, "skip_rule": rule, "stale_rule": stale_rule,
                "stale_hot_share": 0.6, "stale_warmup": "none", "stale_warmup_min": 0.0, "stale_target": 0.5,
                "stale_window": 0.1, "epochs": 2}
    one = trainer.train(make_config({}, _settings(str(data), str(tmp_path / "one"), settings)))
    run_ranks(_train_rank, _settings(str(data), str(tmp_path / "two"), settings))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["skipped_fraction"] > 0.02 and two["skipped_fraction"] == one["skipped_fraction"]
    assert two["staleness"]["rows_read"] == one["staleness"]["rows_read"] and (rule == "random") == (
        one["staleness"]["rows_read"] == 0)
    single, double = ([e for e in _events(tmp_path / run) if e["event"] == "train"] for run in ("one", "two"))
    assert len(single) == len(double) > 10
    for a, b in zip(single, double, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-6)


@pytest.mark.slow
def test_loss_pruning_across_processes_trains_like_one_and_resumes_on_more(tmp_path: Path) -> None:
    """--skip-rule loss: every rank decides on the gathered logits' losses, each keeping its own copy of the
    per-input bytes, so 2 processes prune the inputs 1 process prunes and train like it (fp32 tables). A
    2-process run stopped in its second epoch (pruning on) and resumed on 3 ends where the uninterrupted
    2-process run ends: the third rank starts from rank 0's bytes."""
    data = make_dataset(tmp_path / "data", n=1500)
    settings = {"precision": "fp32", "cache_size": 0.25, "skip_rule": "loss", "prune_share": 0.5,
                "prune_final": 0.0, "epochs": 2, "batch_size": 96, "log_every": 96, "eval_every": 576,
                "checkpoint_every": 576, "keep_checkpoints": 10}
    one = trainer.train(make_config({}, _settings(str(data), str(tmp_path / "one"), settings)))
    run_ranks(_train_rank, _settings(str(data), str(tmp_path / "two"), settings))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["skipped_fraction"] > 0.05 and two["skipped_fraction"] == one["skipped_fraction"]
    single, double = ([e for e in _events(tmp_path / run) if e["event"] == "train"] for run in ("one", "two"))
    assert len(single) == len(double) > 10
    for a, b in zip(single, double, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
    assert (tmp_path / "two" / "prune-rank-1" / "prune_losses_0.u8").is_file()
    # Resumed from the 2-process run's checkpoint in its second epoch (pruning on), on 3 processes.
    shutil.copytree(tmp_path / "two", tmp_path / "again")
    step = tmp_path / "again" / "checkpoints" / f"step-{1728:012d}"
    run_ranks(_train_rank, {"resume": str(step), "progress": False}, world_size=3)
    resumed = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert resumed["distributed"]["world_size"] == 3
    assert resumed["skipped_fraction"] == two["skipped_fraction"]
    assert resumed["train_samples"] == two["train_samples"]
    assert resumed["auc"] == pytest.approx(two["auc"], abs=1e-5)


@pytest.mark.slow
def test_prefetch_and_lookahead_across_two_processes_train_like_one(tmp_path: Path) -> None:
    """--prefetch under the lookahead policy on 2 processes: every rank reads the whole upcoming batches and
    shows each of its shards the rows of them it holds. At fp32 the cache's contents change no value: 2
    processes train like 1 with the same settings. The rows shown are the ones the steps then read: the
    shards' hit rate rises above the same 2-process run without the prefetch."""
    data = make_dataset(tmp_path / "data", n=1500, sizes=[2000, 1000, 500] + [50] * 23, skewed=True)
    settings = {"precision": "fp32", "cache_size": 0.25, "prefetch": True, "policy": "lookahead", "samples": 960}
    one = trainer.train(make_config({}, _settings(str(data), str(tmp_path / "one"), settings)))
    run_ranks(_train_rank, _settings(str(data), str(tmp_path / "two"), settings))
    run_ranks(_train_rank, _settings(str(data), str(tmp_path / "plain"), {**settings, "prefetch": False}))
    two, plain = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("two", "plain"))
    assert one["embedding_stats"]["prefetched_rows"] > 0 and two["embedding_stats"]["prefetched_rows"] > 0
    assert plain["embedding_stats"]["prefetched_rows"] == 0
    assert two["embedding_stats"]["hit_rate"] > plain["embedding_stats"]["hit_rate"]
    single, double = ([e for e in _events(tmp_path / run) if e["event"] == "train"] for run in ("one", "two"))
    assert len(single) == len(double) > 10
    for a, b in zip(single, double, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-6)


@pytest.mark.slow
def test_fae_order_across_two_processes_trains_like_one(tmp_path: Path) -> None:
    """`--input-order cold_first` (each epoch's cold inputs, then its hot ones) reads no rows: every rank
    profiles the same hot set from the data and reads its slice of the same reordered batches, so 2
    processes train like 1 (fp32 tables)."""
    data = make_dataset(tmp_path / "data", n=1500, skewed=True)
    settings = {"precision": "fp32", "cache_size": 0.25, "input_order": "cold_first", "stale_hot_share": 0.6,
                "epochs": 2}
    one = trainer.train(make_config({}, _settings(str(data), str(tmp_path / "one"), settings)))
    run_ranks(_train_rank, _settings(str(data), str(tmp_path / "two"), settings))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert 0.05 < one["staleness"]["hot_input_share"] < 0.95  # an order that differs from the data's
    assert two["staleness"]["hot_input_share"] == one["staleness"]["hot_input_share"]
    single, double = ([e for e in _events(tmp_path / run) if e["event"] == "train"] for run in ("one", "two"))
    assert len(single) == len(double) > 10
    for a, b in zip(single, double, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-6)


def _die_midway(rank: int, world_size: int, data: str, out: str, result: str) -> None:
    real_loss = trainer.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def loss(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 8:
            os._exit(3)  # a rank dies without a word
        return real_loss(*args, **kwargs)

    trainer.F.binary_cross_entropy_with_logits = loss
    try:
        _train_rank(rank, world_size, _settings(data, out, {}))
    except SlipcacheError as exc:
        Path(result).write_text(str(exc))
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_dead_rank_stops_the_others_with_one_line(data_dir: Path, tmp_path: Path) -> None:
    result = tmp_path / "rank0.txt"
    assert exit_codes(_die_midway, str(data_dir), str(tmp_path / "run"), str(result)) == [0, 3]
    message = result.read_text()  # the closed connection, not a collective's timeout, stopped rank 0
    assert "another rank stopped" in message
    assert "--resume" in message and "\n" not in message


def _train_on_a_small_machine(rank: int, world_size: int, data: str, out: str, result: str, per_node: int) -> None:
    """A rank of a run whose machines each have 1.3 GB: a rank's 1 GB of runtime and 300 MB more."""
    os.environ["SLIPCACHE_MEMORY_AVAILABLE_GB"] = "1.3"
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(per_node),
                       "LOCAL_RANK": str(rank % per_node)})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    from slipcache.distributed.launch import init_from_env
    from slipcache.distributed.training import train_on_ranks

    try:
        train_on_ranks(make_config({}, _settings(data, out, {"precision": "fp32", "eval_every": None})),
                       init_from_env())
    except SlipcacheError as exc:
        Path(result + str(rank)).write_text(str(exc))
        raise SystemExit(2) from exc


@pytest.mark.slow
def test_a_machine_short_of_memory_for_its_ranks_shards_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    """Two tables of 1.5 M rows (and a small one) at dim 8 in fp32, one per rank (about 110 MB each with
    its cache and the rows a new run streams in), priced after the plan and before any shard is built: one
    rank per machine fits in 1.3 GB and trains; two ranks on one such machine do not (each has 1 GB of
    runtime), and both stop with the line that says so. The whole tables (about 220 MB) would fit beside
    one rank's runtime."""
    data = make_dataset(tmp_path / "data", n=600, sizes=[1_500_000, 1_500_000, 10])
    result = str(tmp_path / "said")
    assert exit_codes(_train_on_a_small_machine, str(data), str(tmp_path / "apart"), result, 1) == [0, 0]
    assert json.loads((tmp_path / "apart" / "summary.json").read_text())["distributed"]["world_size"] == 2
    assert exit_codes(_train_on_a_small_machine, str(data), str(tmp_path / "together"), result, 2) == [2, 2]
    lines = {Path(result + str(rank)).read_text() for rank in (0, 1)}
    assert len(lines) == 1
    line = lines.pop()
    assert line.startswith("ranks 0-1 on this machine: their shards of the tables (with the fp32 rows a new run")
    assert "SLIPCACHE_MEMORY_AVAILABLE_GB is 1.3 GB" in line and "\n" not in line
    assert not (tmp_path / "together" / "checkpoints").exists()


# ------------------------------------------------------------------------ one-line refusals, no ranks
def _backend(world_size: int = 2) -> Any:
    from slipcache.distributed.launch import DistributedContext
    from slipcache.distributed.training import DistributedBackend

    return DistributedBackend(DistributedContext(0, world_size, 0, world_size, "gloo", torch.device("cpu"), 1))


def test_a_ranks_shards_are_priced_from_the_plan_not_from_the_whole_tables() -> None:
    """Each rank's share of a table-wise plan is its own tables' bytes; the two ranks' add up to the whole
    tables'; a new run adds the fp32 rows it streams in; a data-parallel table counts on every rank."""
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from slipcache.distributed.model import KeyedTables, bag_configs, shard_bytes_of_ranks
    from slipcache.distributed.training import node_memory_refusal
    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection
    from slipcache.interop.torchrec_planner import shard_bytes, slipcache_planner
    from slipcache.interop.torchrec_sharding import KeyedCachedEmbeddingBagCollectionSharder
    from slipcache.model import DLRM, ModelConfig

    sizes, dim = [40_000, 30_000, 20], 8
    tables = KeyedCachedEmbeddingBagCollection(bag_configs(sizes, dim), device="meta", precision="int8",
                                               cache_size=0.05)
    dlrm = DLRM(ModelConfig(sizes, 4, dim, [8, dim], [8, 1]), KeyedTables(tables, sizes, dim))  # type: ignore[arg-type]
    constraints = {"t0": ParameterConstraints(sharding_types=["table_wise"]),
                   "t1": ParameterConstraints(sharding_types=["table_wise"]),
                   "t2": ParameterConstraints(sharding_types=["data_parallel"])}
    planner = slipcache_planner(Topology(world_size=2, compute_device="cpu"), constraints=constraints)
    plan = planner.plan(dlrm, [KeyedCachedEmbeddingBagCollectionSharder()])
    whole = {t: sum(shard_bytes(tables, t, rows, dim, None).values())
             for t, rows in zip(("t0", "t1", "t2"), sizes, strict=True)}
    per_rank = [shard_bytes_of_ranks(tables, plan, range(r, r + 1), staged=False)[0] for r in (0, 1)]
    assert sorted(per_rank) == sorted([whole["t0"] + whole["t2"], whole["t1"] + whole["t2"]])  # t2 on both
    both = shard_bytes_of_ranks(tables, plan, range(2), staged=False)
    assert both == (whole["t0"] + whole["t1"] + 2 * whole["t2"], 0)
    staged = shard_bytes_of_ranks(tables, plan, range(2), staged=True)[0]
    assert staged - sum(per_rank) == 4 * dim * (sizes[0] + sizes[1] + 2 * sizes[2])
    # Rows in files (--storage-path): the INT8 codes leave memory for the disk, the rest stays.
    tables.options["storage_path"] = "rows"
    memory, in_files = shard_bytes_of_ranks(tables, plan, range(2), staged=False)
    codes = sum(sizes) + sizes[2]  # rows held: t2 is on both ranks; one byte per value
    assert in_files == dim * codes and memory + in_files == both[0]
    assert node_memory_refusal(10**9, 10**8, range(2), (int(4e9), "available memory"), staged=True) is None
    line = node_memory_refusal(10**9, 10**8, range(1), (int(1.5e9), "available memory"), staged=False)
    assert line is not None and line.startswith("rank 0: their shards of the tables need 1.0 GB + ")
    assert "available memory is 1.5 GB; spread the ranks over more machines" in line
    assert node_memory_refusal(1, 1, range(1), None, staged=False) is None  # no known limit


def test_the_plan_weighs_shards_by_a_profile_of_the_training_rows(tmp_path: Path) -> None:
    """`plan_lookups`: each table's row histogram from the training split's ids, under the names the
    trainer's collection gives its tables, drawn the same for the same seed; a table whose ids crowd into its
    first rows gets a histogram that says so."""
    from slipcache.data.formats import open_any
    from slipcache.distributed.model import bag_configs, plan_lookups
    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection
    from slipcache.planning.profile import HISTOGRAM_BUCKETS

    dataset = open_any(make_dataset(tmp_path / "data", n=600, sizes=[1000, 50, 20], skewed=True))
    tables = KeyedCachedEmbeddingBagCollection(bag_configs(list(dataset.table_sizes), 8), device="meta")
    lookups = plan_lookups(dataset, tables, seed=0)
    assert list(lookups) == tables.table_names
    for table in lookups.values():
        assert len(table.histogram) == HISTOGRAM_BUCKETS and table.lookups_per_sample == 1.0
    train = dataset.split("train").sparse[:, 0]
    expected = np.bincount(np.asarray(train) * HISTOGRAM_BUCKETS // 1000, minlength=HISTOGRAM_BUCKETS)
    assert list(lookups["t0"].histogram) == expected.tolist()  # fewer training rows than the sample: all
    assert lookups["t0"].histogram[0] > sum(lookups["t0"].histogram) / 2  # Zipf ids: most in the first rows
    assert plan_lookups(dataset, tables, seed=0) == lookups


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"embeddings": "torch"}, "--embeddings torch is sharded only as slipcache's cached tables"),
        ({"batch_size": 63}, "--batch-size 63 does not split evenly over 2 processes"),
    ],
)
def test_what_the_sharded_trainer_does_not_do_is_refused_in_one_line(values: dict[str, Any], expected: str) -> None:
    with pytest.raises(SlipcacheError) as caught:
        _backend().check_config(make_config({}, values))
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    _backend().check_config(make_config({}, {"batch_size": 64}))  # the defaults are supported


def _old_step(run_dir: Path) -> Path:
    """A step directory of the earlier per-rank format, as that release wrote it."""
    step = run_dir / "checkpoints" / "step-000000000640"
    step.mkdir(parents=True)
    for rank in range(2):
        (step / f"rank-{rank}.pt").write_bytes(b"old")
    manifest = {"format": "slipcache-sharded-checkpoint", "version": 1, "world_size": 2, "samples": 640,
                "files": {"rank-0.pt": 3, "rank-1.pt": 3}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


def test_a_checkpoint_of_the_old_per_rank_format_is_refused_in_one_line(tmp_path: Path) -> None:
    from slipcache.training.step_checkpoint import read_step

    step = _old_step(tmp_path / "run")
    for read in (lambda: read_step(step), lambda: _backend().read_resume_checkpoint(step, tmp_path / "run")):
        with pytest.raises(SlipcacheError) as caught:
            read()
        message = str(caught.value)
        assert "per-rank format of an earlier slipcache" in message and "start it again" in message
        assert "\n" not in message


def test_a_one_process_checkpoint_resumed_on_n_is_refused_in_one_line(tmp_path: Path) -> None:
    file = tmp_path / "ckpt-000000000640.pt"
    file.write_bytes(b"one process")
    with pytest.raises(SlipcacheError, match="written by one process; resume it on one process"):
        _backend().read_resume_checkpoint(file, None)
