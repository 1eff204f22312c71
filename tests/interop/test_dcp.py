"""A run under DistributedModelParallel resumed from a torch.distributed.checkpoint of its rows and its fused
optimizer's state (Adagrad, row-wise Adagrad, Adam) continues exactly as the uninterrupted run: N steps,
save, load into fresh tables, M steps equals N + M steps, on the same 2 gloo processes and on 1 process
(every shard on one rank). fp32 storage makes the comparison exact."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from tests.interop import torchrec_shards as shards  # noqa: E402
from tests.interop.torchrec_shards import BATCH, OPTIONS  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

SAVED_AT, TOTAL = 2, 4  # steps before the checkpoint, steps in all
OPTIMIZERS = ("adagrad", "rowwise_adagrad", "adam")


def _sharded(
    optimizer: str, seed: int, kind: str = "mixed", env: object = None, **extra: object
) -> torch.nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollection,
        KeyedCachedEmbeddingBagCollectionSharder,
    )

    options = {**OPTIONS, "lr": 0.05, "optimizer": optimizer, "seed": seed, **extra}
    model = shards.TablesModel(KeyedCachedEmbeddingBagCollection(shards.tables(), **options))
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    plan = shards.plan(model.tables, sharder, kind)
    return DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan, env=env)


def _train(model: torch.nn.Module, steps: range, rank: int | None, world_size: int) -> None:
    """Steps on rank `rank`'s slice of each global batch (`None`: one process on the whole batch, its
    loss divided as TorchRec's gradient division divides the sharded gradients)."""
    weights = torch.randn(BATCH * world_size, 36, generator=torch.Generator().manual_seed(7))
    for step in steps:
        batches = [shards.batch(step, r) for r in range(world_size)]
        if rank is None:
            ((model(shards.concat(*batches)) * weights).sum() / world_size).backward()
        else:
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            (model(batches[rank]) * weights[mine]).sum().backward()


def _shard_rows(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    module = model.module.tables
    return {
        name: rows
        for lookup in module.lookups
        for c in lookup.collections
        for name, rows in zip(c.table_names, c.export_tables(), strict=True)
    }


def _checkpoint(model: torch.nn.Module) -> dict[str, object]:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _load(model: torch.nn.Module, directory: str, group: object = None) -> None:
    import torch.distributed.checkpoint as dcp

    state = _checkpoint(model)
    dcp.load(state, checkpoint_id=directory, process_group=group)
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])


def _resumes_exactly(rank: int, world_size: int, directory: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.types import ShardingEnv

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    alone = dist.new_group([0])  # every rank takes part in making it
    for optimizer in OPTIMIZERS:
        path = str(Path(directory) / optimizer)
        uninterrupted = _sharded(optimizer, seed=5)
        _train(uninterrupted, range(TOTAL), rank, world_size)
        first = _sharded(optimizer, seed=5)
        _train(first, range(SAVED_AT), rank, world_size)
        state = _checkpoint(first)
        assert state["optim"]["state"], "the optimizer's state is in the checkpoint"
        dcp.save(state, checkpoint_id=path)
        resumed = _sharded(optimizer, seed=9)  # other rows and a zero state until loaded
        _load(resumed, path)
        _train(resumed, range(SAVED_AT, TOTAL), rank, world_size)
        expected = _shard_rows(uninterrupted)
        for name, rows in _shard_rows(resumed).items():
            torch.testing.assert_close(rows, expected[name], rtol=1e-5, atol=1e-6, msg=f"{optimizer} {name}")
        # one process: every shard on rank 0, trained on the whole batch
        gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
        dist.all_gather_object(gathered, expected)
        if rank == 0:
            single = _sharded(optimizer, seed=11, kind="one_rank", env=ShardingEnv.from_process_group(alone))
            _load(single, path, alone)
            _train(single, range(SAVED_AT, TOTAL), None, world_size)
            everything = {name: rows for part in gathered for name, rows in part.items()}
            rows_of_single = _shard_rows(single)
            assert sorted(rows_of_single) == sorted(everything)
            for name, rows in rows_of_single.items():
                torch.testing.assert_close(
                    rows, everything[name], rtol=1e-5, atol=1e-6, msg=f"{optimizer} {name}"
                )
        dist.barrier()


@pytest.mark.slow
def test_a_resume_from_dcp_continues_as_the_uninterrupted_run_on_two_processes_and_on_one(
    tmp_path: Path,
) -> None:
    run_ranks(_resumes_exactly, str(tmp_path))


def _refuses_a_state_of_another_shape(rank: int, world_size: int) -> None:
    """Row-wise Adagrad's state ([rows, cuts]) given to Adagrad's ([rows, dim]), under the same keys."""
    from slipcache.errors import InvalidInputError

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    state = _sharded("rowwise_adagrad", seed=5, kind="one_rank").fused_optimizer.state_dict()
    model = _sharded("adagrad", seed=5, kind="one_rank")
    with pytest.raises(InvalidInputError, match="optimizer state .* another optimizer"):
        model.fused_optimizer.load_state_dict(state)


@pytest.mark.slow
def test_an_optimizer_state_of_another_shape_is_refused_in_one_line() -> None:
    run_ranks(_refuses_a_state_of_another_shape, world_size=1)


INT8 = {"precision": "int8", "cache_size": 0.0, "rounding": "nearest"}


def _stored(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every INT8 shard's stored bytes on this rank (codes, biases, scale codes)."""
    module = model.module.tables
    return {
        name: list(c.stored_int8(i))
        for lookup in module.lookups
        for c in lookup.collections
        for i, name in enumerate(c.table_names)
    }


def _assert_same_bytes(ours: dict, expected: dict, what: str) -> None:
    assert sorted(ours) == sorted(expected)
    for name, parts in ours.items():
        for part, value, other in zip(("codes", "bias", "scale"), parts, expected[name], strict=True):
            assert value.dtype == other.dtype and torch.equal(value, other), f"{what}: {name} {part}"


def _int8_resumes_bit_for_bit(rank: int, world_size: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    path = str(Path(directory) / "int8")
    uninterrupted = _sharded("adagrad", seed=5, **INT8)
    _train(uninterrupted, range(TOTAL), rank, world_size)
    first = _sharded("adagrad", seed=5, **INT8)
    _train(first, range(SAVED_AT), rank, world_size)
    state = _checkpoint(first)
    payload = state["model"]["tables.embedding_bags.t0.weight_payload"]
    assert isinstance(payload, ShardedTensor) and payload.dtype == torch.uint8
    assert "tables.embedding_bags.t0.weight" not in state["model"]
    dcp.save(state, checkpoint_id=path)
    resumed = _sharded("adagrad", seed=9, **INT8)  # other rows until loaded
    _load(resumed, path)
    _assert_same_bytes(_stored(resumed), _stored(first), "loaded")
    _train(resumed, range(SAVED_AT, TOTAL), rank, world_size)
    _assert_same_bytes(_stored(resumed), _stored(uninterrupted), "resumed")
    # with a cache and stochastic rounding, the rank state (caches, generators) beside: bit for bit too
    from slipcache.interop.torchrec_checkpoint import load_rank_state, rank_state

    options = {"precision": "int8", "cache_size": 0.5}
    uninterrupted = _sharded("adagrad", seed=5, **options)
    _train(uninterrupted, range(TOTAL), rank, world_size)
    first = _sharded("adagrad", seed=5, **options)
    _train(first, range(SAVED_AT), rank, world_size)
    assert any(c.cache.cached()[0].numel() for c in first.module.tables.local_collections())
    dcp.save({**_checkpoint(first), **rank_state(first.module.tables)}, checkpoint_id=path + "_exact")
    resumed = _sharded("adagrad", seed=9, **options)
    state = {**_checkpoint(resumed), **rank_state(resumed.module.tables)}
    dcp.load(state, checkpoint_id=path + "_exact")
    resumed.load_state_dict(state["model"])
    resumed.fused_optimizer.load_state_dict(state["optim"])
    load_rank_state(resumed.module.tables, state)
    _train(resumed, range(SAVED_AT, TOTAL), rank, world_size)
    _assert_same_bytes(_stored(resumed), _stored(uninterrupted), "resumed with a cache")
    for ours, theirs in zip(_shard_rows(resumed).values(), _shard_rows(uninterrupted).values(), strict=True):
        assert torch.equal(ours, theirs)
    # a cache, stochastic rounding, row-wise, data-parallel and table-column-wise shards: a save and a load
    # give back the bytes saved (the cached rows rounded to nearest into them), bit for bit
    options = {"precision": "int8", "cache_size": 0.5}
    cached = _sharded("rowwise_adagrad", seed=5, kind="every_type", **options)
    _train(cached, range(SAVED_AT), rank, world_size)
    saved = _stored(cached)
    dcp.save(_checkpoint(cached), checkpoint_id=path + "_cached")
    other = _sharded("rowwise_adagrad", seed=9, kind="every_type", **options)
    _load(other, path + "_cached")
    _assert_same_bytes(_stored(other), saved, "loaded with a cache")
    # fp32 rows under TorchRec's keys (e.g. TorchRec's own tables) still load into INT8 tables, rounded
    rows = {name: torch.rand(t.num_embeddings, t.embedding_dim) - 0.5 for name, t in _configs().items()}
    other.load_state_dict({f"tables.embedding_bags.{name}.weight": value for name, value in rows.items()})
    module = other.module.tables
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        for table, loaded in zip(tables, lookup.export_tables() if tables else [], strict=True):
            (first, start), (count, width) = (
                ((0, 0), rows[table.name].shape)
                if table.local_metadata is None
                else (table.local_metadata.shard_offsets, table.local_metadata.shard_sizes)
            )
            expected = rows[table.name][first : first + count, start : start + width]
            torch.testing.assert_close(loaded, expected, rtol=0, atol=5e-3)


def _configs() -> dict[str, object]:
    return {str(t.name): t for t in shards.tables()}


@pytest.mark.slow
def test_int8_tables_checkpoint_their_stored_bytes_and_resume_bit_for_bit(tmp_path: Path) -> None:
    run_ranks(_int8_resumes_bit_for_bit, str(tmp_path))
