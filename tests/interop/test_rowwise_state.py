"""Row-wise Adagrad's state in TorchRec's layout: after the same step on the same rows, TorchRec's fused
collection and ours show `<table>.momentum1` as the same ShardedTensor (one dimension; a table cut into column
shards keeps one block of rows per cut), with the same values, and each loads the other's."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from tests.interop import torchrec_shards as shards  # noqa: E402
from tests.interop.torchrec_shards import BATCH  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

LR = 0.1
FEATURES = ("f0", "f1", "f2", "f3", "f4")


class _ByFeature(torch.nn.Module):
    """The pooled features in one fixed order (a sharded collection's KeyedTensor may list them in another)."""

    def __init__(self, tables: torch.nn.Module) -> None:
        super().__init__()
        self.tables = tables

    def forward(self, kjt: object) -> torch.Tensor:
        pooled = self.tables(kjt).to_dict()
        return torch.cat([pooled[f] for f in FEATURES], dim=1)


def _pair() -> list[torch.nn.Module]:
    """TorchRec's EBC and ours on the same rows, row-wise Adagrad fused in backward, under DMP with one
    plan: a table-wise table, one cut over both ranks, one cut twice on one rank."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder
    from slipcache.interop.torchrec_weights import from_torchrec

    torch.manual_seed(0)
    theirs = EmbeddingBagCollection(tables=shards.tables(), device=torch.device("cpu"))
    ours = from_torchrec(theirs, precision="fp32", cache_size=1.0, lr=LR, optimizer="rowwise_adagrad")
    apply_optimizer_in_backward(RowWiseAdagrad, theirs.parameters(), {"lr": LR, "eps": 1e-8})
    fused = "fused"  # TorchRec's kernel with the optimizer in backward, as ours always is
    per_table = {"t0": table_wise(rank=1, compute_kernel=fused), "t1": table_wise(rank=0, compute_kernel=fused),
                 "t2": column_wise(ranks=[0, 1], compute_kernel=fused),
                 "t3": column_wise(ranks=[1, 1], compute_kernel=fused)}  # fmt: skip
    sharded = []
    pairs = ((theirs, EmbeddingBagCollectionSharder()), (ours, KeyedCachedEmbeddingBagCollectionSharder()))
    for tables, sharder in pairs:
        model = _ByFeature(tables)
        plan = construct_module_sharding_plan(tables, per_table, sharder=sharder, device_type="cpu")
        sharded.append(DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder],
                                                plan=ShardingPlan({"tables": plan})))
    sharded[1].load_state_dict(sharded[0].state_dict())  # TorchRec's sharding drew its rows again
    return sharded


def _states(model: torch.nn.Module) -> dict[str, object]:
    return {key: value for state in model.fused_optimizer.state_dict()["state"].values()
            for key, value in state.items()}  # fmt: skip


def _same_layout_and_values(rank: int, world_size: int) -> None:
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    theirs, ours = _pair()
    weights = torch.randn(BATCH, 36, generator=torch.Generator().manual_seed(rank))
    outputs = []
    for model in (theirs, ours):
        out = model(shards.batch(0, rank))
        (out * weights).sum().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[1], outputs[0])  # the same rows
    expected, got = _states(theirs), _states(ours)
    held = {0: ["t1", "t2"], 1: ["t0", "t2", "t3"]}[rank]  # the tables this rank holds a shard of
    assert sorted(got) == sorted(expected) == [f"{t}.momentum1" for t in held]
    for key, value in expected.items():
        mine = got[key]
        assert mine.size() == value.size() and mine.dim() == 1, key  # t3: two cuts, twice the rows
        placed = sorted((m.shard_offsets, m.shard_sizes, m.placement.rank()) for m in mine.metadata().shards_metadata)
        assert placed == sorted((m.shard_offsets, m.shard_sizes, m.placement.rank())
                                for m in value.metadata().shards_metadata), key  # fmt: skip
        for a, b in zip(mine.local_shards(), value.local_shards(), strict=True):
            assert a.metadata.shard_offsets == b.metadata.shard_offsets
            torch.testing.assert_close(a.tensor, b.tensor, rtol=1e-5, atol=1e-7, msg=key)
            assert float(a.tensor.abs().max()) > 0 or key == "t1.momentum1"  # the step reached the state
    # Each loads the other's state: TorchRec's into ours, and ours back into TorchRec's.
    before = {k: [s.tensor.clone() for s in v.local_shards()] for k, v in expected.items()}
    fresh_ours, fresh_theirs = _pair()
    fresh_ours.fused_optimizer.load_state_dict(theirs.fused_optimizer.state_dict())
    fresh_theirs.fused_optimizer.load_state_dict(ours.fused_optimizer.state_dict())
    for model in (fresh_ours, fresh_theirs):
        for key, value in _states(model).items():
            for shard, old in zip(value.local_shards(), before[key], strict=True):
                torch.testing.assert_close(shard.tensor, old, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_rowwise_adagrad_state_is_torchrecs_and_moves_both_ways() -> None:
    run_ranks(_same_layout_and_values)
