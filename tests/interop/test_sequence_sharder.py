"""`KeyedCachedEmbeddingCollection` (sequence features) sharded by TorchRec's DistributedModelParallel on 2
gloo processes, against the same tables unsharded on the global batch: each sharding type offered (and the
four in one collection) at fp32 with every row cached and with no cache, INT8 behind a cache, a DCP
checkpoint of the shards into another plan and into one process, and the inputs refused."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from slipcache.errors import SlipcacheError  # noqa: E402
from tests.interop import torchrec_shards as shards  # noqa: E402
from tests.interop.torchrec_shards import BATCH, OPTIONS, SEQUENCE_KINDS, STEPS  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402


def _own_ids(jagged: object, rank: int) -> slice:
    """The ids of `rank`'s samples in a JaggedTensor of the global batch (rank 0's samples first)."""
    ids = jagged.lengths().split(BATCH)
    start = int(sum(int(part.sum()) for part in ids[:rank]))
    return slice(start, start + int(ids[rank].sum()))


def _train_and_compare(sharded: torch.nn.Module, reference: object, rank: int, world_size: int) -> None:
    """STEPS steps of the sharded module on this rank's batch and of the reference on the global batch:
    equal rows out, lengths and ids (need_indices) each step."""
    for step in range(STEPS):
        batches = [shards.sequence_batch(step, r) for r in range(world_size)]
        out = dict(sharded(batches[rank]).items())  # the module answers a LazyAwaitable of the dict
        expected = reference(shards.concat(*batches))
        assert list(out) == list(expected) == reference.feature_names
        generator = torch.Generator().manual_seed(step)
        loss, reference_loss = torch.zeros(()), torch.zeros(())
        for name, rows in out.items():
            mine = _own_ids(expected[name], rank)
            weights = torch.randn(expected[name].values().shape, generator=generator)
            torch.testing.assert_close(rows.values(), expected[name].values()[mine], rtol=0, atol=1e-6)
            assert torch.equal(rows.lengths(), expected[name].lengths()[rank * BATCH : (rank + 1) * BATCH])
            assert torch.equal(rows.weights(), batches[rank][name].values())
            loss = loss + (rows.values() * weights[mine]).sum()
            reference_loss = reference_loss + (expected[name].values() * weights).sum()
        loss.backward()
        # TorchRec's sequence all-to-all divides the gradients it returns by the world size
        (reference_loss / world_size).backward()


def _every_sharding_type_equals_unsharded(rank: int, world_size: int, directory: str) -> None:
    """Each sharding type, then the four in one collection, at fp32 with every row cached and with none:
    rows out each step and every shard after within 1e-6 of one process; a DCP checkpoint of the mixed plan
    loads into table-wise shards on 2 ranks and into one process; a KJT missing a feature and tables of two
    widths under one sharding type are refused in one line."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.embedding.replicas import allow_independent_replicas
    from slipcache.interop.torchrec import KeyedCachedEmbeddingCollection, KeyedCachedEmbeddingCollectionSharder

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    sharder = KeyedCachedEmbeddingCollectionSharder()
    for cache_size in (1.0, 0.0):
        options = {**OPTIONS, "cache_size": cache_size}
        for kind in SEQUENCE_KINDS:
            reference = allow_independent_replicas(
                KeyedCachedEmbeddingCollection(shards.sequence_tables(), need_indices=True, **options)
            )
            model = shards.SequenceModel(
                KeyedCachedEmbeddingCollection(shards.sequence_tables(), need_indices=True, **options)
            )
            plan = shards.sequence_plan(model.tables, sharder, kind)
            sharded = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
            _train_and_compare(sharded, reference, rank, world_size)
            shards.check_row_shards(sharded, reference)
    _checkpoint_reloads(sharded, reference, rank, directory)
    with pytest.raises(SlipcacheError, match="KeyedJaggedTensor has no feature 'f4'"):
        batch = shards.sequence_batch(0, rank)
        sharded(batch.permute([i for i, key in enumerate(batch.keys()) if key != "f4"]))
    tables = shards.sequence_tables()
    tables[1].embedding_dim = 4  # t1 and t3 both on rank 0, table-wise: two widths in one sharding type
    model = shards.SequenceModel(KeyedCachedEmbeddingCollection(tables, **OPTIONS))
    two_widths = r"^features .* are both table_wise with rows (8 and 4|4 and 8) wide: [^\n]*$"
    with pytest.raises(SlipcacheError, match=two_widths):
        DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder],
                                 plan=shards.sequence_plan(model.tables, sharder, "table_wise"))


def _checkpoint_reloads(sharded: torch.nn.Module, reference: object, rank: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.interop.torchrec import KeyedCachedEmbeddingCollection, KeyedCachedEmbeddingCollectionSharder
    from slipcache.interop.torchrec_weights import load_torchrec_state_dict, torchrec_state_dict

    dcp.save(sharded.state_dict(), checkpoint_id=directory)
    sharder = KeyedCachedEmbeddingCollectionSharder()
    model = shards.SequenceModel(
        KeyedCachedEmbeddingCollection(shards.sequence_tables(), **{**OPTIONS, "seed": 9})
    )  # other rows
    resharded = DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=[sharder],
        plan=shards.sequence_plan(model.tables, sharder, "table_wise"),
    )
    state = resharded.state_dict()
    dcp.load(state, checkpoint_id=directory)
    resharded.load_state_dict(state)
    shards.check_row_shards(resharded, reference)
    torch.distributed.barrier()
    if rank == 0:
        single = KeyedCachedEmbeddingCollection(shards.sequence_tables(), **{**OPTIONS, "seed": 11})
        state = {f"tables.{key}": value for key, value in torchrec_state_dict(single).items()}
        dcp.load(state, checkpoint_id=directory, no_dist=True)
        load_torchrec_state_dict(single, state)
        for ours, expected in zip(single.export_tables(), reference.export_tables(), strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_every_sharding_type_trains_as_one_process_and_checkpoints_through_dcp(tmp_path: Path) -> None:
    run_ranks(_every_sharding_type_equals_unsharded, str(tmp_path / "dcp"))


def _int8_learns(rank: int, world_size: int, directory: str) -> None:
    """INT8 tables behind a cache of a quarter of the rows, the four sharding types in one collection: every
    row read steps towards a target per id, and the error falls as on one process; the INT8 bytes go
    through a DCP checkpoint and back unchanged; built on meta and planned by TorchRec's planner, it trains."""
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.interop.torchrec import KeyedCachedEmbeddingCollection, KeyedCachedEmbeddingCollectionSharder

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    options = {**OPTIONS, "precision": "int8", "cache_size": 0.25, "lr": 0.2, "seed": 0}
    sharder = KeyedCachedEmbeddingCollectionSharder()
    model = shards.SequenceModel(KeyedCachedEmbeddingCollection(shards.sequence_tables(), **options))
    sharded = DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=[sharder],
        plan=shards.sequence_plan(model.tables, sharder, "mixed"),
    )
    targets = {f: torch.randn(n, 8, generator=torch.Generator().manual_seed(1)) for f, n in
               {"f0": 40, "f1": 20, "f2": 30, "f3": 30, "f4": 25}.items()}
    errors = []
    for step in range(30):
        batch = shards.sequence_batch(step, rank)
        out = dict(sharded(batch).items())
        loss, count = torch.zeros(()), 0
        for name, rows in out.items():
            squared = (rows.values() - targets[name][batch[name].values()]) ** 2
            loss, count = loss + squared.sum(), count + squared.numel()
        (0.5 * loss).backward()
        errors.append(float(loss.detach()) / max(count, 1))
    assert sum(errors[-5:]) < 0.5 * sum(errors[:5]), errors
    dcp.save(sharded.state_dict(), checkpoint_id=directory)
    saved = _local_values(sharded.state_dict())
    assert any(key.endswith("weight_payload") for key in saved)  # INT8 tables saved as their bytes
    for lookup in sharded.module.tables.lookups:
        if lookup.collections:
            lookup.load_tables([torch.zeros_like(t) for t in lookup.export_tables()])
    state = sharded.state_dict()
    dcp.load(state, checkpoint_id=directory)
    sharded.load_state_dict(state)
    loaded = _local_values(sharded.state_dict())
    assert sorted(loaded) == sorted(saved)
    for key, values in saved.items():
        for before, after in zip(values, loaded[key], strict=True):
            assert torch.equal(before, after), key
    # built on meta (each shard draws its own rows) and planned by TorchRec's planner: it trains
    planned = DistributedModelParallel(
        shards.SequenceModel(KeyedCachedEmbeddingCollection(shards.sequence_tables(), device="meta", **options)),
        device=torch.device("cpu"), sharders=[sharder],
    )
    before_step = [t.clone() for c in planned.module.tables.local_collections() for t in c.export_tables()]
    out = planned(shards.sequence_batch(0, rank))
    sum(rows.values().sum() for rows in dict(out.items()).values()).backward()
    after_step = [t for c in planned.module.tables.local_collections() for t in c.export_tables()]
    assert any(not torch.equal(a, b) for a, b in zip(before_step, after_step, strict=True))


def _local_values(state: dict) -> dict[str, list[torch.Tensor]]:
    """Copies of this rank's values in a state_dict (a ShardedTensor's local shards)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return {
        key: [s.tensor.clone() for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value.clone()]
        for key, value in state.items()
    }


@pytest.mark.slow
def test_int8_sequence_tables_learn_under_dmp_and_round_trip_dcp(tmp_path: Path) -> None:
    run_ranks(_int8_learns, str(tmp_path / "dcp"))


def test_a_sharding_type_not_offered_is_refused_in_one_line() -> None:
    """Refused before any communication: table-row-wise (TorchRec has no sequence sharding of it)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv

    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollectionSharder,
        KeyedCachedEmbeddingCollection,
        KeyedCachedEmbeddingCollectionSharder,
    )

    sharder = KeyedCachedEmbeddingCollectionSharder()
    assert sharder.sharding_types("cpu") == ["table_wise", "column_wise", "row_wise", "data_parallel"]
    module = KeyedCachedEmbeddingCollection(shards.sequence_tables(), **OPTIONS)
    # planned as the bag sharder offers it (TorchRec's planning helpers check the types a sharder offers)
    plan = construct_module_sharding_plan(
        module,
        {"t0": table_row_wise(host_index=0), **{name: table_wise(rank=0) for name in ("t1", "t2", "t3")}},
        sharder=KeyedCachedEmbeddingBagCollectionSharder(),
        device_type="cpu", world_size=2, local_size=2,
    )
    with pytest.raises(SlipcacheError) as refused:
        sharder.shard(module, plan, ShardingEnv(world_size=2, rank=0, pg=None))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("table 't0': table_row_wise sharding is not offered for sequence tables")
