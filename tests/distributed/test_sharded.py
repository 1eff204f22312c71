"""The sharded collection over 2 gloo processes equals one `CachedEmbeddingBagCollection`.

Each test starts 2 processes on 127.0.0.1 (a free port, a bounded join); the workers assert themselves,
and a failing assertion comes back as the test's error with the worker's traceback.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipcache.distributed.planner import Shard, ShardingPlan, TableSpec
from slipcache.distributed.sharded import ShardedEmbeddingCollection
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig, SparseFeatures
from slipcache.embedding.replicas import allow_independent_replicas as independent
from slipcache.errors import InvalidInputError
from tests.ranks import run_ranks

SIZES = [30, 7, 120, 11]


def _split_plan(world_size: int) -> ShardingPlan:
    """Tables 0 and 1 whole on rank 0; tables 2 and 3 cut by rows, rank 1 holding only their ends."""
    tables = [TableSpec(f"t{i}", n, 4, 16.0) for i, n in enumerate(SIZES)]
    shards = [Shard(0, 0, 0, 30), Shard(1, 0, 0, 7), Shard(2, 0, 0, 50), Shard(2, 1, 50, 120)]
    shards += [Shard(3, 0, 0, 6), Shard(3, 1, 6, 11)]
    return ShardingPlan(world_size, tables, shards)


def _steps(generator: torch.Generator) -> list[tuple[torch.Tensor, list[int]]]:
    """(global ids, slice sizes): uneven slices, an empty slice, and a batch rank 1 owns no row of."""

    def ids(batch: int, high: list[int] | None = None) -> torch.Tensor:
        return torch.stack([torch.randint(0, h, (batch,), generator=generator) for h in high or SIZES], 1)

    return [
        (ids(8), [4, 4]),
        (ids(9), [7, 2]),
        (ids(5), [0, 5]),
        (ids(6, [30, 7, 50, 6]), [3, 3]),  # only rank 0's rows: rank 1 receives nothing
        (ids(6), [6, 0]),
    ]


def _check_against_one_process(rank: int, world_size: int, config: EmbeddingConfig, plan_kind: str) -> None:
    plan = _split_plan(world_size) if plan_kind == "split" else _all_on_rank_0(world_size)
    reference = independent(CachedEmbeddingBagCollection(config))
    sharded = ShardedEmbeddingCollection(dataclasses.replace(config), plan, rank)
    for got, want in zip(sharded.export_tables(), reference.export_tables(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same initial rows
    generator = torch.Generator().manual_seed(1)
    for ids, slices in _steps(generator):
        weights = torch.randn(ids.shape[0], len(SIZES), config.dim, generator=generator)
        start = sum(slices[:rank])
        mine = slice(start, start + slices[rank])
        want = reference(ids)
        (want * weights).sum().backward()
        got = sharded(ids[mine])
        assert got.shape == (slices[rank], len(SIZES), config.dim)
        torch.testing.assert_close(got, want[mine].detach(), rtol=0, atol=1e-6)
        (got * weights[mine]).sum().backward()
    for got, want in zip(sharded.export_tables(), reference.export_tables(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    sharded.eval()
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 60, 3], [29, 6, 119, 10]])
        torch.testing.assert_close(sharded(ids[rank : rank + 1]), reference.eval()(ids)[rank : rank + 1])


def _bags(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-hot bags (0 to 3 ids, some empty): values and lengths [tables, batch]."""
    lengths = torch.randint(0, 4, (len(SIZES), batch), generator=generator)
    values = [torch.randint(0, n, (int(lengths[t].sum()),), generator=generator) for t, n in enumerate(SIZES)]
    return torch.cat(values), lengths


def _slice_bags(values: torch.Tensor, lengths: torch.Tensor, start: int, end: int) -> SparseFeatures:
    """The bags of samples [start, end) of every table."""
    per_table = torch.split(values, lengths.sum(dim=1).tolist())
    mine = []
    for t, table_values in enumerate(per_table):
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[t].cumsum(0)])
        mine.append(table_values[int(offsets[start]) : int(offsets[end])])
    return SparseFeatures.from_lengths(torch.cat(mine), lengths[:, start:end])


def _check_multi_hot_against_one_process(rank: int, world_size: int, pooling: str) -> None:
    config = EmbeddingConfig(table_sizes=SIZES, dim=4, precision="fp32", cache_size=0.25, lr=0.1, pooling=pooling)
    reference = independent(CachedEmbeddingBagCollection(config))
    sharded = ShardedEmbeddingCollection(dataclasses.replace(config), _split_plan(world_size), rank)
    generator = torch.Generator().manual_seed(2)
    for batch, slices in ((9, [4, 5]), (6, [6, 0]), (5, [0, 5])):
        values, lengths = _bags(generator, batch)
        weights = torch.randn(batch, len(SIZES), config.dim, generator=generator)
        start = sum(slices[:rank])
        want = reference(SparseFeatures.from_lengths(values, lengths))
        (want * weights).sum().backward()
        got = sharded(_slice_bags(values, lengths, start, start + slices[rank]))
        assert got.shape == (slices[rank], len(SIZES), config.dim)
        torch.testing.assert_close(got, want[start : start + slices[rank]].detach(), rtol=0, atol=1e-6)
        (got * weights[start : start + slices[rank]]).sum().backward()
    for got, want in zip(sharded.export_tables(), reference.export_tables(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.slow
def test_multi_hot_bags_equal_one_process(pooling: str) -> None:
    """Bags of several ids, empty bags, bags cut over two owners (row-wise split tables)."""
    run_ranks(_check_multi_hot_against_one_process, pooling)


def _all_on_rank_0(world_size: int) -> ShardingPlan:
    tables = [TableSpec(f"t{i}", n, 4, 16.0) for i, n in enumerate(SIZES)]
    return ShardingPlan(world_size, tables, [Shard(t, 0, 0, n) for t, n in enumerate(SIZES)])


@pytest.mark.parametrize(
    ("optimizer", "cache_size", "plan_kind"),
    [("sgd", 0, "split"), ("rowwise_adagrad", None, "split"), ("adagrad", 0.5, "all_on_rank_0")],
)
@pytest.mark.slow
def test_sharded_forward_backward_equals_one_process(
    optimizer: str, cache_size: float | None, plan_kind: str
) -> None:
    """fp32 storage, so the cache (small: evictions; none; half) changes no value: results must agree."""
    config = EmbeddingConfig(
        table_sizes=SIZES,
        dim=4,
        precision="fp32",
        cache_size=cache_size or 0,
        cache_rows=8 if cache_size is None else None,
        optimizer=optimizer,
        lr=0.1,
        ways=2,
    )
    run_ranks(_check_against_one_process, config, plan_kind)


def _owner(plan: ShardingPlan, table: int, row: int) -> int:
    return next(s.rank for s in plan.shards if s.table == table and s.row_start <= row < s.row_end)


def _check_int8_initial_rows_and_traffic(rank: int, world_size: int) -> None:
    config = EmbeddingConfig(table_sizes=SIZES, dim=4, precision="int8", cache_size=0.1)
    plan = _split_plan(world_size)
    sharded = ShardedEmbeddingCollection(config, plan, rank)
    reference = independent(CachedEmbeddingBagCollection(config))
    for got, want in zip(sharded.export_tables(), reference.export_tables(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ids = torch.stack([torch.arange(3, 13) % n * 7 % n for n in SIZES], 1)
    mine = ids[rank * 4 : rank * 4 + 4 + 2 * rank]  # 4 and 6 samples
    owners = [[_owner(plan, t, i) for t, i in enumerate(row)] for row in ids.tolist()]
    remote_sent = sum(o != rank for row in owners[rank * 4 : rank * 4 + 4 + 2 * rank] for o in row)
    other = slice(0, 4) if rank else slice(4, 10)
    remote_received = sum(o == rank for row in owners[other] for o in row)
    sharded(mine).sum().backward()
    assert sharded.traffic["id_bytes"] == (remote_sent + 2) * 8
    assert sharded.traffic["embedding_bytes"] == remote_received * 4 * 4
    assert sharded.traffic["gradient_bytes"] == remote_sent * 4 * 4
    assert sharded.traffic["samples"] == mine.shape[0]
    with pytest.raises(InvalidInputError, match="outside"):
        sharded(torch.tensor([[0, 0, 500, 0]]))
    _check_half_precision_wire(rank, world_size, ids[rank * 4 : rank * 4 + 4 + 2 * rank])


def _check_half_precision_wire(rank: int, world_size: int, mine: torch.Tensor) -> None:
    """Rows and gradients sent as fp16 / bf16: half the bytes; rows arrive rounded to the wire's precision
    and the owners' updates use the rounded gradients (close to the fp32 wire's)."""
    config = EmbeddingConfig(table_sizes=SIZES, dim=4, precision="fp32", lr=0.5)
    plan = _split_plan(world_size)
    full = ShardedEmbeddingCollection(config, plan, rank)
    weights = torch.randn(mine.shape[0], len(SIZES), 4, generator=torch.Generator().manual_seed(rank)) * 1e-2
    want = full(mine)
    (want * weights).sum().backward()
    for wire, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        half = ShardedEmbeddingCollection(dataclasses.replace(config), plan, rank, wire_precision=wire)
        got = half(mine)
        # every row is rounded, the ones served locally too: results do not depend on the placement
        torch.testing.assert_close(got, want.detach().to(dtype).float(), rtol=0, atol=0)
        (got * weights).sum().backward()
        for name in ("embedding_bytes", "gradient_bytes"):
            assert half.traffic[name] * 2 == full.traffic[name]
        # lr x the largest gradient a row can sum (over both ranks' lookups) x the wire's relative rounding
        tolerance = 0.5 * 2 * float(weights.abs().sum(0).max()) * (2**-8 if wire == "bf16" else 2**-11)
        for a, b in zip(half.export_tables(), full.export_tables(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)
    with pytest.raises(InvalidInputError, match="wire precision"):
        ShardedEmbeddingCollection(config, plan, rank, wire_precision="int8")


@pytest.mark.slow
def test_int8_shards_start_from_the_single_process_rows_and_count_their_traffic() -> None:
    run_ranks(_check_int8_initial_rows_and_traffic)


def _check_stale_flags_agree(rank: int, world_size: int) -> None:
    """Snapshots read through the sharded tables are identical on every rank and equal one process's
    snapshots, so the detector's fitted threshold and stale flags are one global decision."""
    import numpy as np

    from slipcache.staleness.config import StalenessConfig
    from slipcache.staleness.detector import StaleInputDetector

    config = EmbeddingConfig(table_sizes=SIZES, dim=4, precision="fp32", cache_size=0.25, lr=0.01)
    sharded = ShardedEmbeddingCollection(config, _split_plan(world_size), rank)
    reference = independent(CachedEmbeddingBagCollection(config))
    generator = torch.Generator().manual_seed(5)
    inputs = torch.stack([torch.randint(0, n // 2 + 1, (64,), generator=generator) for n in SIZES], 1)
    detectors = [
        StaleInputDetector.from_collection(
            coll, StalenessConfig(target_drop=0.3, seed=0, rule="paper", count_share=1.0)
        )
        for coll in (sharded, reference)
    ]
    for detector, coll in zip(detectors, (sharded, reference), strict=True):
        detector.profile(inputs.numpy())
        detector.begin_window(coll)
    for step in range(3):
        batch = inputs[step * 16 : step * 16 + 16]
        reference(batch).pow(2).sum().backward()
        sharded(batch[rank * 8 : rank * 8 + 8]).pow(2).sum().backward()
    for detector, coll in zip(detectors, (sharded, reference), strict=True):
        detector.end_window(coll)
        detector.fit_threshold(inputs.numpy())
    mine, single = detectors
    torch.testing.assert_close(mine.row_change(), single.row_change(), rtol=0, atol=1e-6)
    flags = torch.from_numpy(mine.is_stale_row(np.arange(sum(SIZES))).astype(np.uint8))
    everyone = [torch.empty_like(flags) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, flags)
    assert all(torch.equal(f, everyone[0]) for f in everyone)  # one decision on every rank
    assert 0 < int(flags.sum()) < len(mine.hot)
    assert mine.threshold is not None and mine.threshold == single.threshold


@pytest.mark.slow
def test_stale_skipping_takes_one_decision_on_every_rank() -> None:
    run_ranks(_check_stale_flags_agree)
