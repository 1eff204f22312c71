"""Our tables sharded by TorchRec's DistributedModelParallel on 2 gloo processes: against the same tables
unsharded (table-wise and column-wise shards, two of them on one rank, ranks of unequal output widths, sum
and mean pooling, a table two features read), against TorchRec's own sharded collection, under TorchRec's
training pipeline, and in the example's train, checkpoint (torch.distributed.checkpoint) and resume on
another number of processes. fp32 storage and a cache holding every row make the comparisons exact."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from tests.interop import torchrec_shards as shards  # noqa: E402
from tests.interop.torchrec_shards import BATCH, HELD, OPTIONS, STEPS  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402


def _sharded_training_equals_unsharded(rank: int, world_size: int, directory: str) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.embedding.replicas import allow_independent_replicas
    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollection,
        KeyedCachedEmbeddingBagCollectionSharder,
    )

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    # the reference: every rank trains the same unsharded copy on the global batch
    reference = allow_independent_replicas(KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS))
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    model = shards.TablesModel(KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS))
    sharded = DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=[sharder], plan=shards.plan(model.tables, sharder)
    )
    weights = torch.randn(BATCH * world_size, 36, generator=torch.Generator().manual_seed(7))
    # a learning-rate schedule reaches the tables through DMP's fused optimizer (a CombinedOptimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(sharded.fused_optimizer, step_size=1, gamma=0.5)
    for step in range(STEPS):
        batches = [shards.batch(step, r) for r in range(world_size)]
        out = sharded(batches[rank])
        expected = reference(shards.concat(*batches))
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        torch.testing.assert_close(out, expected.values()[mine], rtol=0, atol=1e-6)
        (out * weights[mine]).sum().backward()
        # the global batch, its gradient divided by the ranks: TorchRec's pooled all-to-all divides the
        # gradients it returns by the world size (as DDP averages), and the sharded tables step by them
        ((expected.values() * weights).sum() / world_size).backward()
        sharded.fused_optimizer.step()
        scheduler.step()
        reference.lr = OPTIONS["lr"] * 0.5 ** (step + 1)
    _check_shards(sharded, reference, HELD["mixed"][rank])
    shards.check_rows_read_from_every_rank(sharded.module.tables, reference)
    _checkpoint_reloads(sharded, reference, rank, directory)


def _checkpoint_reloads(sharded: torch.nn.Module, reference: object, rank: int, directory: str) -> None:
    """torch.distributed.checkpoint saves the 2 ranks' shards; they load into another plan on 2 ranks and
    into the unsharded collection in one process."""
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollection,
        KeyedCachedEmbeddingBagCollectionSharder,
    )
    from slipcache.interop.torchrec_weights import load_torchrec_state_dict, torchrec_state_dict

    dcp.save(sharded.state_dict(), checkpoint_id=directory)
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    model = shards.TablesModel(
        KeyedCachedEmbeddingBagCollection(shards.tables(), **{**OPTIONS, "seed": 9})
    )  # other rows
    resharded = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=shards.plan(model.tables, sharder, "table_wise"),
    )
    state = resharded.state_dict()
    dcp.load(state, checkpoint_id=directory)
    resharded.load_state_dict(state)
    _check_shards(resharded, reference, HELD["table_wise"][rank])
    torch.distributed.barrier()
    if rank == 0:
        single = KeyedCachedEmbeddingBagCollection(shards.tables(), **{**OPTIONS, "seed": 11})
        state = {f"tables.{key}": value for key, value in torchrec_state_dict(single).items()}
        dcp.load(state, checkpoint_id=directory, no_dist=True)
        load_torchrec_state_dict(single, state)
        for ours, expected in zip(single.export_tables(), reference.export_tables(), strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def _check_shards(sharded: torch.nn.Module, reference: object, held: list[str]) -> None:
    """This rank holds the shards `held`, each equal to its columns of the reference table."""
    module = sharded.module.tables
    names = reference.table_names
    full = reference.export_tables()
    shards = [name for lookup in module.lookups for c in lookup.collections for name in c.table_names]
    assert sorted(shards) == sorted(held)
    for lookup in module.lookups:
        for collection in lookup.collections:
            for name, rows in zip(collection.table_names, collection.export_tables(), strict=True):
                table, _, start = name.partition("@")
                first = int(start or 0)
                table_rows = full[names.index(table)]
                torch.testing.assert_close(
                    rows, table_rows[:, first : first + rows.shape[1]], rtol=0, atol=1e-6
                )


@pytest.mark.slow
def test_sharded_training_equals_the_unsharded_collection_and_checkpoints_through_dcp(tmp_path: Path) -> None:
    run_ranks(_sharded_training_equals_unsharded, str(tmp_path / "dcp"))


KINDS = {
    "every_type": ["data_parallel", "row_wise", "row_wise", "table_column_wise"],
    "table_row_wise": ["data_parallel", "table_row_wise", "table_row_wise", "table_wise"],
    "two_hosts": ["data_parallel", "table_row_wise", "table_row_wise", "table_wise"],
}


def _every_sharding_type_equals_unsharded(
    rank: int, world_size: int, directory: str, optimizer: str, kind: str
) -> None:
    """Row-wise (sum and mean pooling; 40 and 20 rows over 2 ranks), data-parallel (a table two features
    read) and table-column-wise shards train as one process on the global batch: outputs each step, then
    every shard's rows (and the data-parallel replicas, identical) within 1e-6; a DCP checkpoint of them
    loads into table-wise shards on 2 ranks and into one process."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.embedding.replicas import allow_independent_replicas
    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollection,
        KeyedCachedEmbeddingBagCollectionSharder,
    )

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    if kind == "two_hosts":
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # TorchRec's hosts: one rank each
    options = {**OPTIONS, "optimizer": optimizer}
    reference = allow_independent_replicas(KeyedCachedEmbeddingBagCollection(shards.tables(), **options))
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    model = shards.TablesModel(KeyedCachedEmbeddingBagCollection(shards.tables(), **options))
    plan = shards.plan(model.tables, sharder, kind)
    kinds = {name: p.sharding_type for name, p in plan.plan["tables"].items()}
    assert sorted(kinds.values()) == KINDS[kind]
    sharded = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    weights = torch.randn(BATCH * world_size, 36, generator=torch.Generator().manual_seed(7))
    for step in range(STEPS + 1):
        batches = [shards.batch(step, r) for r in range(world_size)]
        out = sharded(batches[rank])
        expected = reference(shards.concat(*batches))
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        torch.testing.assert_close(out, expected.values()[mine], rtol=0, atol=1e-6)
        loss = (out * weights[mine]).sum()
        reference_loss = (expected.values() * weights).sum()
        losses = [torch.zeros(()) for _ in range(world_size)]
        torch.distributed.all_gather(losses, loss.detach())
        torch.testing.assert_close(sum(losses), reference_loss.detach(), rtol=0, atol=1e-5)
        loss.backward()
        (reference_loss / world_size).backward()
    shards.check_row_shards(sharded, reference)
    _checkpoint_reloads(sharded, reference, rank, directory)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_row_wise_data_parallel_and_table_column_wise_train_as_one_process(
    tmp_path: Path, optimizer: str
) -> None:
    run_ranks(_every_sharding_type_equals_unsharded, str(tmp_path / "dcp"), optimizer, "every_type")


@pytest.mark.slow
@pytest.mark.parametrize("hosts", ["table_row_wise", "two_hosts"])
def test_table_row_wise_trains_as_one_process(tmp_path: Path, hosts: str) -> None:
    """Table-row-wise on one host of 2 ranks, and on 2 hosts of one rank (its all-to-all across hosts)."""
    run_ranks(_every_sharding_type_equals_unsharded, str(tmp_path / "dcp"), "adagrad", hosts)


def _dlrm(tables: torch.nn.Module) -> torch.nn.Module:
    from torchrec.models.dlrm import DLRM

    return DLRM(
        embedding_bag_collection=tables,
        dense_in_features=3,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[4, 1],
    )


def _dlrm_under_dmp_equals_torchrec(rank: int, world_size: int) -> None:
    """The same DLRM, its tables TorchRec's fused collection or ours (fp32, every row cached, SGD), both
    under DMP with the same plan: equal outputs step by step. Ours loads TorchRec's sharded state_dict
    (its ShardedTensors) after sharding."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    from slipcache.interop.torchrec_weights import from_torchrec

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    lr = 0.1
    torch.manual_seed(0)
    tables = [t for t in shards.tables() if t.embedding_dim == 8]  # DLRM's interaction: one dim
    theirs = _dlrm(EmbeddingBagCollection(tables=tables, device=torch.device("cpu")))
    ours = _dlrm(
        from_torchrec(theirs.sparse_arch.embedding_bag_collection, precision="fp32", cache_size=1.0, lr=lr)
    )
    per_table = {
        "t0": table_wise(rank=1, compute_kernel="fused"),
        "t2": column_wise(ranks=[0, 1], compute_kernel="fused"),
        "t3": table_wise(rank=0, compute_kernel="fused"),
    }
    models = shards.shard_pair(theirs, ours, per_table, lr, lambda params: torch.optim.SGD(params, lr=lr))
    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        kjt = shards.batch(step, rank)
        dense_features = torch.randn(BATCH, 3, generator=generator)
        outputs = []
        for sharded, optimizer in models:
            out = sharded(dense_features, kjt)
            torch.nn.functional.binary_cross_entropy_with_logits(out.squeeze(1), torch.ones(BATCH)).backward()
            optimizer.step()
            optimizer.zero_grad()
            outputs.append(out.detach())
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_dlrm_under_dmp_trains_as_with_torchrecs_own_collection() -> None:
    run_ranks(_dlrm_under_dmp_equals_torchrec)


@pytest.mark.slow
def test_the_example_trains_under_dmp_on_two_processes_and_resumes_on_one(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "torchrec_dlrm.py"
    checkpoint = tmp_path / "ckpt"
    common = ["--dmp", "--batch-size", "32"]
    two = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(example),
    ]
    first = subprocess.run(
        [*two, *common, "--steps", "3", "--checkpoint-dir", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert re.search(r"^step 3 loss \d+\.\d+$", first.stdout, re.M), first.stdout
    resumed = subprocess.run(
        [sys.executable, str(example), *common, "--steps", "5", "--resume", str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(r"^step 5 loss \d+\.\d+$", resumed.stdout, re.M), resumed.stdout


def _pipeline_trains(rank: int, world_size: int) -> None:
    """TorchRec's TrainPipelineSparseDist (input distribution of the next batch overlapped with this one's
    step) trains a DLRM whose tables are ours."""
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRMTrain

    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollection,
        KeyedCachedEmbeddingBagCollectionSharder,
    )

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    tables = [t for t in shards.tables() if t.embedding_dim == 8]
    ebc = KeyedCachedEmbeddingBagCollection(tables, **OPTIONS)
    model = DistributedModelParallel(
        DLRMTrain(_dlrm(ebc)),
        device=torch.device("cpu"),
        sharders=[KeyedCachedEmbeddingBagCollectionSharder()],
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    generator = torch.Generator().manual_seed(rank)
    batches = [
        Batch(
            dense_features=torch.randn(BATCH, 3, generator=generator),
            sparse_features=shards.batch(step, rank),
            labels=torch.ones(BATCH),
        )
        for step in range(STEPS)
    ]
    before = torch.cat(
        [
            c.export_tables()[0].flatten()
            for c in model.module.model.sparse_arch.embedding_bag_collection.local_collections()
        ]
    )
    iterator = iter(batches)
    for _ in range(STEPS):
        pipeline.progress(iterator)
    after = torch.cat(
        [
            c.export_tables()[0].flatten()
            for c in model.module.model.sparse_arch.embedding_bag_collection.local_collections()
        ]
    )
    assert not torch.equal(before, after)


@pytest.mark.slow
def test_torchrecs_train_pipeline_trains_our_tables() -> None:
    run_ranks(_pipeline_trains)
