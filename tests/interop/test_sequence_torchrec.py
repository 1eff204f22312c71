"""Our sequence collection beside TorchRec's own sharded `EmbeddingCollection`, under DMP on 2 gloo processes:
the checkpoint keys are TorchRec's (`embeddings.<table>.weight`), so each sharded module loads the other's
state_dict by key; with row-wise Adagrad (TorchRec's fused in backward, ours set by the sharder's
`fused_params`) a step reads and writes the same rows and leaves the same optimizer state, and each
optimizer loads the other's state."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from tests.interop import torchrec_shards as shards  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

LR = 0.1
FEATURES = ("f0", "f1", "f2", "f3", "f4")


class _Rows(torch.nn.Module):
    """Every feature's rows, one after the other in a fixed order (a dict of JaggedTensors in the module)."""

    def __init__(self, tables: torch.nn.Module) -> None:
        super().__init__()
        self.tables = tables

    def forward(self, kjt: object) -> torch.Tensor:
        rows = dict(self.tables(kjt).items())
        return torch.cat([rows[f].values() for f in FEATURES])


def _pair() -> list[torch.nn.Module]:
    """TorchRec's EmbeddingCollection and ours under DMP with one plan (table-wise, column-wise, row-wise),
    row-wise Adagrad on both; ours then loads TorchRec's rows from its sharded state_dict."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from slipcache.interop.torchrec import KeyedCachedEmbeddingCollection, KeyedCachedEmbeddingCollectionSharder

    torch.manual_seed(0)
    theirs = EmbeddingCollection(tables=shards.sequence_tables(), device=torch.device("cpu"))
    ours = KeyedCachedEmbeddingCollection(shards.sequence_tables(), precision="fp32", cache_size=1.0)
    apply_optimizer_in_backward(RowWiseAdagrad, theirs.parameters(), {"lr": LR, "eps": 1e-8})
    fused = "fused"
    per_table = {"t0": row_wise(compute_kernel=fused), "t1": table_wise(rank=0, compute_kernel=fused),
                 "t2": column_wise(ranks=[1, 0], compute_kernel=fused),
                 "t3": table_wise(rank=1, compute_kernel=fused)}  # fmt: skip
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
    sharders = (EmbeddingCollectionSharder(), KeyedCachedEmbeddingCollectionSharder(fused_params=fused_params))
    sharded = []
    for tables, sharder in zip((theirs, ours), sharders, strict=True):
        plan = construct_module_sharding_plan(tables, per_table, sharder=sharder, device_type="cpu")
        sharded.append(DistributedModelParallel(_Rows(tables), device=torch.device("cpu"), sharders=[sharder],
                                                plan=ShardingPlan({"tables": plan})))
    sharded[1].load_state_dict(sharded[0].state_dict())  # TorchRec's sharding drew its rows again
    return sharded


def _rows(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """This rank's local shards of each table, by TorchRec's key."""
    out = {}
    for key, value in model.state_dict().items():
        shards_here = value.local_shards() if hasattr(value, "local_shards") else []
        out[key] = [s.tensor.detach().clone() for s in shards_here]
    return out


def _states(model: torch.nn.Module) -> dict[str, object]:
    return {key: value for state in model.fused_optimizer.state_dict()["state"].values()
            for key, value in state.items()}  # fmt: skip


def _same_rows_keys_and_state(rank: int, world_size: int) -> None:
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    theirs, ours = _pair()
    keys = [f"tables.embeddings.t{i}.weight" for i in range(4)]
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == keys
    before = _rows(ours)
    outputs = []
    for model in (theirs, ours):
        out = model(shards.sequence_batch(0, rank))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        (out * weights).sum().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-6)  # the same rows read
    after_theirs, after_ours = _rows(theirs), _rows(ours)
    for key in keys:
        for a, b, old in zip(after_ours[key], after_theirs[key], before[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)  # the same rows written
            assert not torch.equal(a, old) or a.numel() == 0, key  # the step reached the shard
    expected, got = _states(theirs), _states(ours)
    assert sorted(got) == sorted(expected) and expected
    for key, value in expected.items():
        mine = got[key]
        assert mine.size() == value.size(), key
        for a, b in zip(mine.local_shards(), value.local_shards(), strict=True):
            assert a.metadata.shard_offsets == b.metadata.shard_offsets, key
            torch.testing.assert_close(a.tensor, b.tensor, rtol=1e-5, atol=1e-7, msg=key)
    # Each loads the other's rows and optimizer state: ours into TorchRec's, and TorchRec's into ours.
    fresh_theirs, fresh_ours = _pair()
    fresh_theirs.load_state_dict(ours.state_dict())
    fresh_ours.load_state_dict(theirs.state_dict())
    fresh_theirs.fused_optimizer.load_state_dict(ours.fused_optimizer.state_dict())
    fresh_ours.fused_optimizer.load_state_dict(theirs.fused_optimizer.state_dict())
    for model in (fresh_theirs, fresh_ours):
        for key, shards_now in _rows(model).items():
            for a, b in zip(shards_now, after_theirs[key], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)
        states = _states(model)
        assert sorted(states) == sorted(expected)
        for key, value in states.items():
            for a, b in zip(value.local_shards(), expected[key].local_shards(), strict=True):
                torch.testing.assert_close(a.tensor, b.tensor, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_sequence_tables_share_torchrecs_keys_rows_and_optimizer_state() -> None:
    run_ranks(_same_rows_keys_and_state)
