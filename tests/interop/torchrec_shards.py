"""Tables, batches and plans the DMP tests share: four tables (dims 8 and 4, sum and mean pooling, one read
by two features), multi-hot batches, and plans of table-wise, column-wise, table-column-wise, row-wise and
data-parallel shards; the same for sequence tables (one width, unpooled); checks of the shards' rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BATCH = 3  # per rank
STEPS = 3
OPTIONS = dict(precision="fp32", cache_size=1.0, lr=0.5, seed=5)


def tables() -> list:
    from torchrec import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=40, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=30, feature_names=["f2", "f3"]),
        EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=25, feature_names=["f4"]),
    ]


# the shards each rank holds under each plan (a column shard is named by its first column)
HELD = {
    "mixed": {0: ["t1", "t2@0"], 1: ["t0", "t2@4", "t3@0", "t3@4"]},
    "table_wise": {0: ["t0", "t3"], 1: ["t1", "t2"]},
}


def plan(module: torch.nn.Module, sharder: object, kind: str = "mixed") -> object:
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    per_table = {
        "t0": table_wise(rank=1),
        "t1": table_wise(rank=0),
        "t2": column_wise(ranks=[0, 1]),
        "t3": column_wise(ranks=[1, 1]),  # two column shards on one rank
    }
    if kind == "one_rank":  # the mixed plan's cuts, every shard on rank 0 of a group of one
        per_table = {
            "t0": table_wise(rank=0),
            "t1": table_wise(rank=0),
            "t2": column_wise(ranks=[0, 0]),
            "t3": column_wise(ranks=[0, 0]),
        }
    if kind == "table_wise":
        per_table = {
            "t0": table_wise(rank=0),
            "t1": table_wise(rank=1),
            "t2": table_wise(rank=1),
            "t3": table_wise(rank=0),
        }
    if kind == "every_type":  # row-wise (sum and mean), data-parallel, table-column-wise
        per_table = {
            "t0": row_wise(),
            "t1": row_wise(),
            "t2": data_parallel(),
            "t3": column_wise(ranks=[1, 0]),
        }
    if kind == "table_row_wise":  # rows cut over the ranks of host 0 (the one host)
        per_table = {
            "t0": table_row_wise(host_index=0),
            "t1": table_row_wise(host_index=0),
            "t2": data_parallel(),
            "t3": table_wise(rank=1),
        }
    if kind == "two_hosts":  # one rank per host (LOCAL_WORLD_SIZE=1): rows cut within each host
        per_table = {
            "t0": table_row_wise(host_index=0),
            "t1": table_row_wise(host_index=1),
            "t2": data_parallel(),
            "t3": table_wise(rank=1),
        }
    world_size = 1 if kind == "one_rank" else None
    local_size = 1 if kind == "two_hosts" else None
    plan = construct_module_sharding_plan(
        module, per_table, sharder=sharder, device_type="cpu", world_size=world_size, local_size=local_size
    )
    if kind == "every_type":
        plan["t3"].sharding_type = "table_column_wise"  # placed as column-wise, within the one host
    return ShardingPlan({"tables": plan})


class TablesModel(torch.nn.Module):
    def __init__(self, tables: torch.nn.Module) -> None:
        super().__init__()
        self.tables = tables

    def forward(self, kjt: object) -> torch.Tensor:
        return self.tables(kjt).values()


def batch(step: int, rank: int) -> object:
    """Multi-hot bags, some empty; features listed in another order than the tables'."""
    from torchrec import KeyedJaggedTensor

    sizes = {"f3": 30, "f0": 40, "f4": 25, "f1": 20, "f2": 30}
    generator = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (len(sizes), BATCH), generator=generator)
    values = [
        torch.randint(0, n, (int(lengths[i].sum()),), generator=generator)
        for i, n in enumerate(sizes.values())
    ]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(sizes), values=torch.cat(values), lengths=lengths.reshape(-1)
    )


def concat(a: object, b: object) -> object:
    """Two KJTs of the same keys as one batch (b's samples after a's)."""
    from torchrec import KeyedJaggedTensor

    keys = list(a.keys())
    values, lengths = [], []
    for key in keys:
        values += [a[key].values(), b[key].values()]
        lengths += [a[key].lengths(), b[key].lengths()]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def shard_pair(
    theirs: torch.nn.Module,
    ours: torch.nn.Module,
    per_table: dict,
    table_lr: float,
    dense_optimizer: Callable[..., Any],
) -> list[tuple[torch.nn.Module, Any]]:
    """A DLRM with TorchRec's tables (SGD at `table_lr`, fused in backward) and the same DLRM with ours
    (their dense layers copied), each under DMP with the same plan (`per_table`) and `dense_optimizer(params)`
    over its dense layers. TorchRec's sharding draws its rows again, so ours then load them (its
    ShardedTensors)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder

    ours.dense_arch.load_state_dict(theirs.dense_arch.state_dict())
    ours.over_arch.load_state_dict(theirs.over_arch.state_dict())
    apply_optimizer_in_backward(
        torch.optim.SGD, theirs.sparse_arch.embedding_bag_collection.parameters(), {"lr": table_lr}
    )
    models = []
    for model, sharder in (
        (theirs, EmbeddingBagCollectionSharder()),
        (ours, KeyedCachedEmbeddingBagCollectionSharder()),
    ):
        ebc = model.sparse_arch.embedding_bag_collection
        plan = construct_module_sharding_plan(ebc, per_table, sharder=sharder, device_type="cpu")
        sharded = DistributedModelParallel(
            model,
            device=torch.device("cpu"),
            sharders=[sharder],
            plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        )
        dense = dict(in_backward_optimizer_filter(sharded.named_parameters()))
        models.append((sharded, dense_optimizer(dense.values())))
    models[1][0].load_state_dict(models[0][0].state_dict())
    return models


def check_row_shards(sharded: torch.nn.Module, reference: object) -> None:
    """Every shard this rank holds (any sharding type) equals its rows and columns of the reference."""
    module = sharded.module.tables
    names = reference.table_names
    full = reference.export_tables()
    checked = set()
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        if not tables:
            continue
        for table, rows in zip(tables, lookup.export_tables(), strict=True):
            whole = full[names.index(table.name)]
            if table.local_metadata is None:  # data-parallel: the whole table on every rank
                expected = whole
            else:
                (first, start), (count, width) = (
                    table.local_metadata.shard_offsets,
                    table.local_metadata.shard_sizes,
                )
                expected = whole[first : first + count, start : start + width]
            torch.testing.assert_close(rows, expected, rtol=0, atol=1e-6)
            checked.add(table.name)
    held: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, sorted(checked))
    assert set().union(*held) == {"t0", "t1", "t2", "t3"}  # every table checked on some rank
    check_rows_read_from_every_rank(module, reference)


def check_rows_read_from_every_rank(module: object, reference: object) -> None:
    """Rows asked of every rank at once (`held_rows`, what the staleness detector reads across processes):
    the parts the ranks' shards hold, summed over the ranks, are every row whole, a data-parallel table's
    counted once; some rows are asked twice."""
    for name, whole in zip(reference.table_names, reference.export_tables(), strict=True):
        rows = torch.cat([torch.arange(whole.shape[0]).flip(0), torch.tensor([0, whole.shape[0] - 1])])
        values = torch.zeros(rows.numel(), whole.shape[1])
        for positions, start, part in module.held_rows(name, rows):
            values[positions, start : start + part.shape[1]] = part
        torch.distributed.all_reduce(values)
        torch.testing.assert_close(values, whole[rows], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- sequence tables (unpooled)
SEQUENCE_KINDS = ("table_wise", "column_wise", "row_wise", "data_parallel", "mixed")


def sequence_tables() -> list:
    """Four tables of one width (a sequence sharding type sends one), one read by two features."""
    from torchrec import EmbeddingConfig

    return [
        EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=40, feature_names=["f0"]),
        EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=20, feature_names=["f1"]),
        EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=30, feature_names=["f2", "f3"]),
        EmbeddingConfig(name="t3", embedding_dim=8, num_embeddings=25, feature_names=["f4"]),
    ]


def sequence_plan(module: torch.nn.Module, sharder: object, kind: str) -> object:
    """Every table of one sharding type (column-wise: shards in reversed rank order, two on one rank), or
    "mixed": the four types in one collection."""
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    per_table = {
        "table_wise": {"t0": table_wise(rank=1), "t1": table_wise(rank=0), "t2": table_wise(rank=1),
                       "t3": table_wise(rank=0)},
        "column_wise": {"t0": column_wise(ranks=[0, 1]), "t1": column_wise(ranks=[1, 0]),
                        "t2": column_wise(ranks=[1, 0]), "t3": column_wise(ranks=[1, 1])},
        "row_wise": {name: row_wise() for name in ("t0", "t1", "t2", "t3")},
        "data_parallel": {name: data_parallel() for name in ("t0", "t1", "t2", "t3")},
        "mixed": {"t0": row_wise(), "t1": data_parallel(), "t2": column_wise(ranks=[1, 0]),
                  "t3": table_wise(rank=1)},
    }[kind]
    plan = construct_module_sharding_plan(module, per_table, sharder=sharder, device_type="cpu")
    return ShardingPlan({"tables": plan})


class SequenceModel(torch.nn.Module):
    def __init__(self, tables: torch.nn.Module) -> None:
        super().__init__()
        self.tables = tables

    def forward(self, kjt: object) -> dict:
        return self.tables(kjt)


def sequence_batch(step: int, rank: int) -> object:
    """Sequences of 0 to 4 ids, features listed in another order than the tables'; every rank's first
    sample of each feature repeats one id (the same on every rank), so rows are read several times."""
    from torchrec import KeyedJaggedTensor

    sizes = {"f3": 30, "f0": 40, "f4": 25, "f1": 20, "f2": 30}
    generator = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 5, (len(sizes), BATCH), generator=generator)
    lengths[:, 0] = 3
    values = []
    for i, n in enumerate(sizes.values()):
        ids = torch.randint(0, n, (int(lengths[i].sum()),), generator=generator)
        ids[:2] = (7 * step + i) % n
        values.append(ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(sizes), values=torch.cat(values), lengths=lengths.reshape(-1)
    )
