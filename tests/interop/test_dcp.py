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


def _sharded(optimizer: str, seed: int, kind: str = "mixed", env: object = None) -> torch.nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollection,
        KeyedCachedEmbeddingBagCollectionSharder,
    )

    options = {**OPTIONS, "lr": 0.05, "optimizer": optimizer, "seed": seed}
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
