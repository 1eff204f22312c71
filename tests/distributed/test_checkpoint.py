"""Multi-rank checkpoints: the manifest is the commit mark; another world size re-shards exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slipcache.distributed import checkpoint as dckpt
from slipcache.distributed.planner import TableSpec, plan_sharding
from slipcache.distributed.sharded import ShardedEmbeddingCollection
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.replicas import allow_independent_replicas as independent
from slipcache.errors import SlipcacheError
from slipcache.training import trainer
from slipcache.training.config import make_config
from slipcache.training.saved_run import find_checkpoint
from slipcache.training.trainer import train
from tests.helpers import checkpoint_events, make_dataset
from tests.ranks import run_ranks

SIZES = [30, 7, 120, 11]
# fp32 storage: flushing the cache is exact, so a re-sharded run must continue exactly
CONFIG = EmbeddingConfig(
    table_sizes=SIZES, dim=4, precision="fp32", cache_rows=8, ways=2, optimizer="adagrad", lr=0.1
)


def _plan(world_size: int):  # noqa: ANN202 - a ShardingPlan
    return plan_sharding([TableSpec(f"t{i}", n, 4, 16.0) for i, n in enumerate(SIZES)], world_size)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.stack([torch.randint(0, n, (12,), generator=generator) for n in SIZES], 1) for _ in range(3)
    ]


def _my_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return batch.tensor_split(world_size)[rank]


def _train_and_save(rank: int, world_size: int, directory: str) -> None:
    plan = _plan(world_size)
    sharded = ShardedEmbeddingCollection(CONFIG, plan, rank)
    for batch in _batches()[:2]:
        sharded(_my_slice(batch, rank, world_size)).pow(2).sum().backward()
    state = {"embeddings": sharded.state_dict()}
    dckpt.save_sharded(Path(directory), 24, rank, world_size, state, {"plan": plan.to_dict()})
    # a later checkpoint whose writers died before the manifest: it must not count
    dckpt.ckpt.save_checkpoint(dckpt.rank_file(Path(directory) / f"step-{36:012d}", rank), state)


def _resume_and_continue(rank: int, world_size: int, directory: str) -> None:
    step_dir = dckpt.latest_sharded(Path(directory))
    assert step_dir is not None and step_dir.name == f"step-{24:012d}"
    manifest = dckpt.read_manifest(step_dir)
    assert manifest["world_size"] == 2
    sharded = ShardedEmbeddingCollection(CONFIG, _plan(world_size), rank)
    dckpt.reshard_into(sharded, step_dir, manifest)  # how a resumed run's backend loads it: re-shard
    reference = independent(CachedEmbeddingBagCollection(CONFIG))
    for batch in _batches():
        reference(batch).pow(2).sum().backward()
    sharded(_my_slice(_batches()[2], rank, world_size)).pow(2).sum().backward()
    for got, want in zip(sharded.export_tables(), reference.export_tables(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("new_world_size", [1, 3])
@pytest.mark.slow
def test_a_checkpoint_of_2_ranks_resumes_on_another_world_size(tmp_path: Path, new_world_size: int) -> None:
    run_ranks(_train_and_save, str(tmp_path))
    run_ranks(_resume_and_continue, str(tmp_path), world_size=new_world_size)


def test_a_rank_file_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    step = tmp_path / "step-000000000001"
    step.mkdir()
    (step / "rank-0.pt").write_bytes(b"x" * 10)
    (step / dckpt.MANIFEST).write_text(
        '{"format": "slipcache-sharded-checkpoint", "world_size": 1, "files": {"rank-0.pt": 99}}'
    )
    assert dckpt.latest_sharded(tmp_path) == step
    with pytest.raises(SlipcacheError, match="not the size the manifest records"):
        dckpt.read_manifest(step)


@pytest.mark.usefixtures("private_cache_dir")
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
    assert checkpoint_events(run) == [320, 640, 960, 1280]
    history = json.loads((run / "config.json").read_text())["changed_on_resume"]
    assert [c["samples"] for c in history] == [320, 640, 960]
    assert find_checkpoint(run).path.name == "step-000000001280"


@pytest.mark.usefixtures("private_cache_dir")
@pytest.mark.slow
@pytest.mark.parametrize("storage", [False, True])
def test_resume_matrix_with_tables_above_the_streaming_threshold(
    storage: bool, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """1 -> 2 -> 2 -> 1 processes on a table of 38 MB (its storage is streamed: past 16 MiB), with and without
    --storage-path: every resume re-shards (or keeps) the streamed tensors and goes on from the newest."""
    import json

    from slipcache.training import checkpoint as ckpt
    from slipcache.training.saved_run import find_checkpoint
    from tests.distributed.test_training import _settings, _train_rank
    from tests.ranks import run_ranks

    sizes = [1_200_000] + [5] * 25
    assert sizes[0] * 8 * 4 > ckpt.RAW_MIN_BYTES
    data, run = make_dataset(tmp_path / "data", n=1500, sizes=sizes), tmp_path / "run"
    extra = {"storage_path": str(tmp_path / "rows")} if storage else {}
    settings = _settings(str(data), str(run), {"precision": "fp32", "cache_size": 0.01, "samples": 320, **extra})
    trainer.train(make_config({}, settings))  # one process
    capfd.readouterr()

    def more(samples: int) -> dict:
        return {"resume": str(run), "samples": samples, "allow_changes": True, "progress": False}

    run_ranks(_train_rank, more(640))  # 1 -> 2: "expected torch.Tensor ... but received RawTensor" before
    assert "written by 1 process, over 2 processes" in capfd.readouterr().out
    run_ranks(_train_rank, more(960))  # 2 -> 2
    trainer.train(make_config({}, more(1280)))  # 2 -> 1
    assert "written by 2 processes, into 1" in capfd.readouterr().out
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["samples"] for e in events if e["event"] == "checkpoint"] == [320, 640, 960, 1280]
    assert ckpt.load_checkpoint(find_checkpoint(run).path)["progress"]["samples"] == 1280

