"""The sharding plan: every row placed once, bytes balanced within the stated tolerance."""

import json
import random

import pytest

from slipcache.distributed.planner import Shard, ShardingPlan, TableSpec, plan_sharding, table_specs
from slipcache.errors import InvalidInputError

KAGGLE_SIZES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194]
KAGGLE_SIZES += [27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def _bound(plan: ShardingPlan, rank: int) -> float:
    """The planner's guarantee: (1 + tolerance) * mean bytes, plus one row of rounding per shard."""
    mean = sum(t.bytes for t in plan.tables) / plan.world_size
    rounding = sum(plan.tables[s.table].bytes_per_row for s in plan.shards_of(rank))
    return mean * (1 + plan.tolerance) + rounding + 1e-6 * mean


@pytest.mark.parametrize("seed", range(30))
def test_random_tables_are_covered_once_and_balanced_within_tolerance(seed: int) -> None:
    rng = random.Random(seed)
    tables = [
        TableSpec(
            f"t{i}", rng.choice([1, 3, 50, 10 ** rng.randint(2, 7)]), 16, rng.choice([19.0, 25.5, 80.0])
        )
        for i in range(rng.randint(1, 30))
    ]
    world_size = rng.randint(1, 9)
    plan = plan_sharding(tables, world_size, tolerance=rng.choice([0.0, 0.05, 0.2]))
    plan.validate()  # contiguous, non-overlapping, complete (also checked on construction)
    assert sum(s.rows for s in plan.shards) == sum(t.rows for t in tables)
    for rank, size in enumerate(plan.bytes_per_rank()):
        assert size <= _bound(plan, rank)


def test_criteo_kaggle_tables_on_8_ranks_within_5_percent() -> None:
    plan = plan_sharding(table_specs(KAGGLE_SIZES, 16, precision="int8", cache_size=0.05), 8)
    assert plan.imbalance() <= 1.05
    lookups = plan.lookups_per_rank()
    assert sum(lookups) == pytest.approx(26.0)
    # the largest table (10 M rows, a third of all bytes) cannot live on one rank of 8: it is cut by rows
    assert len([s for s in plan.shards if s.table == 2]) >= 2


def test_small_tables_stay_whole_and_one_rank_holds_everything() -> None:
    tables = [TableSpec(f"t{i}", 100, 8, 32.0) for i in range(4)]
    plan = plan_sharding(tables, 2)
    assert all(s.rows == 100 for s in plan.shards)
    assert plan.bytes_per_rank() == [6400.0, 6400.0]
    single = plan_sharding(tables, 1)
    assert [s.rank for s in single.shards] == [0, 0, 0, 0]


def test_a_table_larger_than_a_share_is_cut_into_contiguous_ranges() -> None:
    plan = plan_sharding([TableSpec("big", 1000, 8, 10.0), TableSpec("small", 10, 8, 10.0)], 3)
    big = [s for s in plan.shards if s.table == 0]
    assert [s.row_start for s in big] == [0, *[s.row_end for s in big[:-1]]] and big[-1].row_end == 1000
    assert plan.imbalance() <= 1.05


def test_row_histogram_sets_the_lookups_of_row_wise_shards() -> None:
    # 90 % of lookups in the first tenth of the rows (a frequency-ordered vocabulary)
    histogram = (90.0, *[10.0 / 9] * 9)
    plan = plan_sharding([TableSpec("hot", 1000, 8, 10.0, 1.0, histogram)], 2)
    first, second = sorted(plan.shards, key=lambda s: s.row_start)
    assert (first.row_start, first.row_end, second.row_end) == (0, 500, 1000)
    assert plan.shard_lookups(first) == pytest.approx((90 + 4 * 10 / 9) / 100)
    assert plan.shard_lookups(first) + plan.shard_lookups(second) == pytest.approx(1.0)


def test_plan_round_trips_through_json_and_prints() -> None:
    plan = plan_sharding(table_specs([50, 2000, 7], 8, precision="fp32", cache_size=0), 2)
    again = ShardingPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.shards == plan.shards and again.world_size == 2
    text = plan.format_table()
    assert "table 1" in text and "max/mean" in text


def test_bad_plans_and_inputs_are_one_line_errors() -> None:
    tables = [TableSpec("a", 10, 4, 16.0)]
    with pytest.raises(InvalidInputError, match="covers 5 of the 10 rows"):
        ShardingPlan(1, tables, [Shard(0, 0, 0, 5)])
    with pytest.raises(InvalidInputError, match="contiguous"):
        ShardingPlan(2, tables, [Shard(0, 0, 0, 5), Shard(0, 1, 6, 10)])
    with pytest.raises(InvalidInputError, match="rank outside"):
        ShardingPlan(1, tables, [Shard(0, 1, 0, 10)])
    with pytest.raises(InvalidInputError, match="world size"):
        plan_sharding(tables, 0)
    with pytest.raises(InvalidInputError, match="positive"):
        TableSpec("b", 0, 4, 16.0)
    with pytest.raises(InvalidInputError, match="not a slipcache sharding plan"):
        ShardingPlan.from_dict({"world_size": 1})
