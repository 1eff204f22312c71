"""The scaling model (docs/scaling.md) against what the sharded collection counts in a run."""

from __future__ import annotations

import pytest
import torch

from slipcache.distributed import scaling
from slipcache.distributed.planner import TableSpec, plan_sharding
from slipcache.distributed.sharded import ID_BYTES, ShardedEmbeddingCollection
from slipcache.embedding.collection import EmbeddingConfig
from tests.ranks import run_ranks

SIZES = [60, 60, 60, 60]  # two tables per rank, whole: every lookup of a table crosses but its owner's
DIM = 4
BATCH, STEPS = 16, 3


def _measure(rank: int, world_size: int) -> None:
    plan = plan_sharding([TableSpec(f"t{i}", n, DIM, 16.0) for i, n in enumerate(SIZES)], world_size)
    assert all(shard.rows == SIZES[shard.table] for shard in plan.shards)  # table-wise
    sharded = ShardedEmbeddingCollection(EmbeddingConfig(table_sizes=SIZES, dim=DIM, precision="fp32"), plan, rank)
    for step in range(STEPS):
        # distinct ids per table within a batch, so every lookup travels on its own
        ids = torch.stack([(torch.arange(BATCH) * 3 + step + t) % n for t, n in enumerate(SIZES)], 1)
        mine = ids.tensor_split(world_size)[rank]
        sharded(mine).pow(2).sum().backward()
    measured = sharded.combined_traffic()
    model = scaling.traffic_per_sample(len(SIZES), DIM, world_size)
    # the model leaves out each step's metadata: 2 ids per ordered pair of ranks
    metadata = STEPS * world_size * 2 * (world_size - 1) * ID_BYTES / measured["samples"]
    assert measured["samples"] == BATCH * STEPS
    assert measured["id_bytes_per_sample"] == pytest.approx(model.ids + metadata)
    assert measured["embedding_bytes_per_sample"] == pytest.approx(model.embeddings)
    assert measured["gradient_bytes_per_sample"] == pytest.approx(model.gradients)


@pytest.mark.slow
def test_traffic_model_matches_the_counted_bytes_of_a_run() -> None:
    run_ranks(_measure)


@pytest.mark.slow
def test_memory_per_rank_falls_with_the_world_and_the_tables_print(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = scaling.KAGGLE_CARDINALITIES
    per_rank = [scaling.max_rank_gib(sizes, 16, "int8", 0.05, n) for n in (1, 8, 64)]
    assert per_rank[0] > per_rank[1] > per_rank[2] > 0
    assert per_rank[0] / per_rank[1] == pytest.approx(8, rel=0.3)  # the biggest table caps the split
    assert scaling.inter_node_share(8) == 0.0 and scaling.inter_node_share(16) == pytest.approx(8 / 15)
    assert scaling.traffic_per_sample(26, 16, 1).total == 0.0
    scaling.main()
    out = capsys.readouterr().out
    assert "### Criteo Kaggle" in out and "### Criteo 1TB" in out and "| INT8 + 5 % cache |" in out
