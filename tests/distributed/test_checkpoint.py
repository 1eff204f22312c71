"""Multi-rank checkpoints: the manifest is the commit mark; another world size re-shards exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipcache.distributed import checkpoint as dckpt
from slipcache.distributed.planner import TableSpec, plan_sharding
from slipcache.distributed.sharded import ShardedEmbeddingCollection
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.replicas import allow_independent_replicas as independent
from slipcache.errors import SlipcacheError
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
