"""`slipcache train` as 2 gloo processes: equal to 1 process, exact resume, a clear stop when a rank dies."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slipcache import export
from slipcache.distributed import checkpoint as dckpt
from slipcache.errors import SlipcacheError
from slipcache.training import trainer
from slipcache.training.cli import evaluate_checkpoint
from slipcache.training.config import make_config
from tests.helpers import make_dataset
from tests.ranks import exit_codes, run_ranks


def _train_rank(rank: int, world_size: int, values: dict[str, Any]) -> None:
    """One rank of `slipcache train` as torchrun would start it (the group is already joined)."""
    from slipcache.distributed.launch import init_from_env
    from slipcache.distributed.training import train_on_ranks

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
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
    drop = {"samples_per_s", "train_wall_s", "train_seconds", "train_cpu_s", "disk_read_bytes_per_step"}
    drop |= {"disk_write_bytes_per_step", "train_disk_read_bytes"}
    return [
        {k: v for k, v in json.loads(line).items() if k not in drop} for line in open(run / "metrics.jsonl")
    ]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), n=1500)


@pytest.mark.slow
def test_two_processes_train_like_one_step_by_step(data_dir: Path, tmp_path: Path) -> None:
    """fp32 tables, no stochastic rounding: the same global batches give the same losses and metrics."""
    settings = {"precision": "fp32", "cache_size": 0.25, "batch_size": 63}  # 63 = 32 + 31: uneven slices
    one = trainer.train(make_config({}, _settings(str(data_dir), str(tmp_path / "one"), settings)))
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "two"), settings))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    single, double = _events(tmp_path / "one"), _events(tmp_path / "two")
    saved = [[e for e in events if e["event"] == "checkpoint"] for events in (single, double)]
    assert [e["samples"] for e in saved[0]] == [e["samples"] for e in saved[1]] == [315, 630, 945, 1260, 1449]
    assert all(e["bytes"] > 0 for e in saved[1])  # every rank's file, as the step's manifest records them
    single, double = ([e for e in events if e["event"] == "train"] for events in (single, double))
    assert len(single) == len(double) == 23
    for a, b in zip(single, double, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
        if "val_auc" in a:
            assert b["val_auc"] == pytest.approx(a["val_auc"], abs=1e-6)
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-6)
    assert two["test_samples"] == one["test_samples"]  # metrics over the whole split
    # cache lookups summed over ranks: every lookup of every sample, once
    assert two["embedding_stats"]["lookups"] == one["embedding_stats"]["lookups"]
    assert len(two["memory_per_rank"]) == 2 and two["distributed"]["world_size"] == 2
    assert sum(r["total_bytes"] for r in two["memory_per_rank"]) == two["embedding_bytes"]
    assert (tmp_path / "two" / "rank-1.log").is_file() and (tmp_path / "two" / "plan.json").is_file()
    # `slipcache eval` reads the 2-rank checkpoint in one process (fp32: flushing the caches is exact)
    again = evaluate_checkpoint(tmp_path / "two")
    assert again["auc"] == pytest.approx(two["auc"], abs=1e-9)
    # `slipcache export` reads it too: the tables of the 2-process run equal the 1-process run's
    for got, want in zip(export.load_tables(tmp_path / "two"), export.load_tables(tmp_path / "one"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_int8_cache_run_on_two_processes_resumes_exactly(data_dir: Path, tmp_path: Path) -> None:
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
    a, b = dckpt.latest_sharded(tmp_path / "full"), dckpt.latest_sharded(tmp_path / "part")
    for rank in range(2):
        saved, again = (
            dckpt.load_rank_state(a, rank)["embeddings"],
            dckpt.load_rank_state(b, rank)["embeddings"],
        )
        for name, tensor in saved.items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, again[name]), (rank, name)


@pytest.mark.slow
def test_runs_resume_on_another_number_of_processes(
    data_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """2 -> 1 and 1 -> 2 processes: the tables are re-sharded (fp32: exactly), the run continues as the
    uninterrupted one does, and the resume says what it did."""
    settings = {"precision": "fp32", "cache_size": 0.25, "samples": 640}
    full = trainer.train(make_config({}, _settings(str(data_dir), str(tmp_path / "full"), settings)))
    resume = {"samples": 640, "allow_changes": True, "progress": False}
    # 2 processes, then 1
    run_ranks(_train_rank, _settings(str(data_dir), str(tmp_path / "two"), {**settings, "samples": 320}))
    capfd.readouterr()
    one = trainer.train(make_config({}, {**resume, "resume": str(tmp_path / "two")}))
    assert "written by 2 processes, into 1: each rank copied" in capfd.readouterr().out
    # 1 process, then 2
    trainer.train(make_config({}, _settings(str(data_dir), str(tmp_path / "one"), {**settings, "samples": 320})))
    capfd.readouterr()
    run_ranks(_train_rank, {**resume, "resume": str(tmp_path / "one")})
    assert "written by 1 process, over 2 processes" in capfd.readouterr().out
    two = json.loads((tmp_path / "one" / "summary.json").read_text())
    for resumed in (one, two):
        assert resumed["train_samples"] == full["train_samples"]
        assert resumed["auc"] == pytest.approx(full["auc"], abs=1e-5)
        assert resumed["logloss"] == pytest.approx(full["logloss"], abs=1e-5)


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
    assert "another rank stopped (Read error" in message or "another rank stopped (Connection" in message
    assert "--resume" in message and "\n" not in message
