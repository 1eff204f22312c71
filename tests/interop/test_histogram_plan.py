"""TorchRec's planner with its perf estimate weighted by the tables' row histograms (`SlipcachePerfEstimator`):
each shard's compute against TorchRec's even estimate, placements that the histograms and lookups per sample
change, lookups made from an id profile and the refusals, in one process (planning needs no process group)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from torchrec import EmbeddingBagConfig, EmbeddingConfig  # noqa: E402
from torchrec.distributed.planner import ParameterConstraints, Topology  # noqa: E402
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator  # noqa: E402
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator  # noqa: E402
from torchrec.distributed.planner.types import Perf  # noqa: E402

from slipcache.data.dataset import SplitArrays  # noqa: E402
from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import (  # noqa: E402
    KeyedCachedEmbeddingBagCollection,
    KeyedCachedEmbeddingBagCollectionSharder,
    KeyedCachedEmbeddingCollection,
    KeyedCachedEmbeddingCollectionSharder,
    SlipcachePerfEstimator,
    TableLookups,
    lookups_from_profile,
    slipcache_planner,
)
from slipcache.planning.profile import profile_split  # noqa: E402

FIRST_HALF = [1.0] * 32 + [0.0] * 32  # 64 buckets: every lookup in the first half of the rows


def _configs(kind: type, tables: dict[str, int], dim: int) -> list[Any]:
    return [kind(name=n, embedding_dim=dim, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r in tables.items()]


def _bags(tables: dict[str, int], dim: int = 8) -> KeyedCachedEmbeddingBagCollection:
    return KeyedCachedEmbeddingBagCollection(_configs(EmbeddingBagConfig, tables, dim))


def _collection(sequence: bool, tables: dict[str, int]) -> tuple[torch.nn.Module, Any]:
    if sequence:
        return KeyedCachedEmbeddingCollection(
            _configs(EmbeddingConfig, tables, 8)
        ), KeyedCachedEmbeddingCollectionSharder()
    return _bags(tables), KeyedCachedEmbeddingBagCollectionSharder()


def _perfs(
    module: torch.nn.Module,
    sharder: Any,
    constraints: dict[str, ParameterConstraints],
    lookups: dict[str, TableLookups] | None = None,
    world_size: int = 2,
) -> dict[str, list[Perf]]:
    """Each table's shard perfs (the constraints give each table one sharding type): TorchRec's estimate
    without `lookups`, ours with them."""
    topology = Topology(world_size=world_size, compute_device="cpu")
    estimator = (
        EmbeddingPerfEstimator(topology, constraints)
        if lookups is None
        else SlipcachePerfEstimator(topology, constraints, lookups)
    )
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints, estimator=[estimator])
    return {o.name: [s.perf for s in o.shards] for o in enumerator.enumerate(module, [sharder])}


def _only(sharding_type: str, *names: str, **fields: Any) -> dict[str, ParameterConstraints]:
    return {n: ParameterConstraints(sharding_types=[sharding_type], **fields) for n in names}


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("sequence", [False, True], ids=["bags", "sequences"])
def test_a_row_wise_shard_costs_its_share_of_the_lookups(sequence: bool) -> None:
    """640 rows over 2 ranks, every lookup in rows 0..319: shard 0 computes twice TorchRec's even estimate,
    shard 1 nothing; their comms stay TorchRec's."""
    module, sharder = _collection(sequence, {"hot": 640})
    constraints = _only("row_wise", "hot")
    even = _perfs(module, sharder, constraints)["hot"]
    weighted = _perfs(module, sharder, constraints, {"hot": TableLookups(FIRST_HALF)})["hot"]
    assert even[0] == even[1] and even[0].fwd_compute > 0  # TorchRec: the same cost on both shards
    assert weighted[0].fwd_compute == pytest.approx(2 * even[0].fwd_compute, rel=1e-12)
    assert weighted[0].bwd_compute == pytest.approx(2 * even[0].bwd_compute, rel=1e-12)
    assert weighted[1].fwd_compute == weighted[1].bwd_compute == 0.0
    for ours, theirs in zip(weighted, even, strict=True):
        assert (ours.fwd_comms, ours.bwd_comms, ours.input_dist_comms, ours.prefetch_compute) == (
            theirs.fwd_comms,
            theirs.bwd_comms,
            theirs.input_dist_comms,
            theirs.prefetch_compute,
        )


def test_a_bucket_split_by_a_shard_boundary_is_spread_over_its_rows() -> None:
    """600 rows over 3 ranks, two buckets (rows 0..299 with 3/4 of the lookups, 300..599 with 1/4): the middle
    shard (rows 200..399) takes a third of each bucket, 1/4 + 1/12 of the lookups for 1/3 of the rows.
    Column-wise shards and a table without a histogram keep TorchRec's estimate."""
    module = _bags({"split": 600, "wide": 600, "plain": 600}, dim=24)
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    constraints = {**_only("row_wise", "split", "plain"), **_only("column_wise", "wide", min_partition=8)}
    even = _perfs(module, sharder, constraints, world_size=3)
    lookups = {"split": TableLookups([3.0, 1.0]), "wide": TableLookups(FIRST_HALF)}
    weighted = _perfs(module, sharder, constraints, lookups, world_size=3)
    # shares 1/2, 1/3 and 1/6 of the lookups (3/4 * 2/3, 3/4 * 1/3 + 1/4 * 1/3, 1/4 * 2/3), each over 1/3
    for shard, expected in zip(weighted["split"], (1.5, 1.0, 0.5), strict=True):
        assert shard.fwd_compute == pytest.approx(expected * even["split"][0].fwd_compute, rel=1e-12)
        assert shard.bwd_compute == pytest.approx(expected * even["split"][0].bwd_compute, rel=1e-12)
    assert len(weighted["wide"]) == 3 and weighted["wide"] == even["wide"]
    assert weighted["plain"] == even["plain"]


def test_lookups_per_sample_are_the_pooling_factor_unless_the_constraints_give_one() -> None:
    """A table read 3 times a sample costs what TorchRec's estimate with pooling factor 3 does; one whose
    constraints say 2 keeps 2."""
    module, sharder = _bags({"many": 640, "told": 640}), KeyedCachedEmbeddingBagCollectionSharder()
    constraints = {**_only("table_wise", "many"), **_only("table_wise", "told", pooling_factors=[2.0])}
    lookups = {name: TableLookups([1.0], lookups_per_sample=3.0) for name in ("many", "told")}
    weighted = _perfs(module, sharder, constraints, lookups)
    pooled = {
        **_only("table_wise", "many", pooling_factors=[3.0]),
        **_only("table_wise", "told", pooling_factors=[2.0]),
    }
    assert weighted == _perfs(module, sharder, pooled)
    assert weighted["many"] != _perfs(module, sharder, constraints)["many"]


def _ranks(lookups: dict[str, TableLookups] | None, module: torch.nn.Module, constraints: dict) -> dict[str, list]:
    planner = slipcache_planner(Topology(world_size=2, compute_device="cpu"), constraints=constraints, lookups=lookups)
    plan = planner.plan(torch.nn.ModuleDict({"tables": module}), [KeyedCachedEmbeddingBagCollectionSharder()])
    return {name: sharding.ranks for name, sharding in plan.plan["tables"].items()}


def test_tables_hot_by_their_lookups_land_on_different_ranks() -> None:
    """Four equal table-wise tables, a and c read four times a sample: TorchRec's estimate (one lookup each)
    places a and c on one rank; weighted, each rank takes one of them."""
    module = _bags({name: 640 for name in "abcd"})
    constraints = _only("table_wise", *"abcd")
    default = _ranks(None, module, constraints)
    assert default["a"] == default["c"] and default["b"] == default["d"] != default["a"]
    hot = {name: TableLookups([1.0], lookups_per_sample=4.0) for name in "ac"}
    weighted = _ranks(hot, module, constraints)
    assert weighted["a"] != weighted["c"] and weighted["b"] != weighted["d"]


def test_a_skewed_row_wise_table_moves_the_other_tables_off_its_busy_rank() -> None:
    """A row-wise table read 8 times a sample, all in its first rows, and two table-wise tables: TorchRec's
    even estimate (and the same lookups spread evenly) puts one of the two on each rank; weighted by the
    histogram, both go to the rank whose shard takes none of the row-wise table's lookups."""
    module = _bags({"skewed": 640, "x": 640, "y": 640})
    constraints = {**_only("row_wise", "skewed"), **_only("table_wise", "x", "y")}
    for lookups in (None, {"skewed": TableLookups([1.0] * 64, lookups_per_sample=8.0)}):
        even = _ranks(lookups, module, constraints)
        assert sorted(even["x"] + even["y"]) == [0, 1]
    skewed = _ranks({"skewed": TableLookups(FIRST_HALF, lookups_per_sample=8.0)}, module, constraints)
    assert skewed["skewed"] == [0, 1] and skewed["x"] == skewed["y"] == [1]  # rank 1 holds rows 320..639


def test_lookups_from_an_id_profile_weight_its_tables() -> None:
    """A profile's histograms and lookups per sample, by table name: ids 0..19 of 640 rows leave the second
    row-wise shard without lookups."""
    ids = np.stack([np.arange(400) % 20, np.arange(400) % 640], axis=1).astype(np.int32)
    split = SplitArrays(np.zeros(400, np.float32), np.zeros((400, 13), np.float32), ids)
    profile = profile_split(split, [640, 640])
    lookups = lookups_from_profile(profile, ["low", "spread"])
    assert lookups["low"].histogram == tuple(profile.tables[0].histogram.tolist())
    assert lookups["low"].lookups_per_sample == 1.0
    module, sharder = _bags({"low": 640, "spread": 640}), KeyedCachedEmbeddingBagCollectionSharder()
    constraints = _only("row_wise", "low", "spread")
    weighted, even = _perfs(module, sharder, constraints, lookups), _perfs(module, sharder, constraints)
    assert weighted["low"][1].fwd_compute == 0 and weighted["low"][0].fwd_compute == pytest.approx(
        2 * even["low"][0].fwd_compute, rel=1e-12
    )
    # ids 320..399 of 0..399: 1/5 of the lookups in half the rows
    assert weighted["spread"][1].fwd_compute == pytest.approx(0.4 * even["spread"][1].fwd_compute, rel=1e-12)
    with pytest.raises(SlipcacheError) as error:
        lookups_from_profile(profile, ["low"])
    assert "1 table names for a profile of 2 tables" in _one_line(error)


@pytest.mark.parametrize(
    ("lookups", "expected"),
    [
        ({"a": TableLookups([1.0, -1.0])}, "table 'a': histogram bucket 1 holds -1.0"),
        ({"a": TableLookups([1.0, float("nan")])}, "table 'a': histogram bucket 1 holds nan"),
        ({"a": TableLookups([float("inf")])}, "table 'a': histogram bucket 0 holds inf"),
        ({"a": TableLookups([0, 0, 0])}, "table 'a': the histogram holds no lookups (all zero)"),
        ({"a": TableLookups([])}, "table 'a': the histogram must be a non-empty 1-D sequence of numbers, got list"),
        ({"a": TableLookups("123")}, "table 'a': the histogram must be a non-empty 1-D sequence of numbers, got str"),
        ({"a": TableLookups([[1.0, 2.0]])}, "table 'a': the histogram must be a non-empty 1-D sequence"),
        ({"a": TableLookups([[1.0], [1.0, 2.0]])}, "table 'a': the histogram must be a non-empty 1-D sequence"),
        ({"a": TableLookups([1.0], 0.0)}, "table 'a': lookups_per_sample must be a number > 0, got 0.0"),
        ({"a": TableLookups([1.0], float("inf"))}, "table 'a': lookups_per_sample must be a number > 0, got inf"),
        ({"a": TableLookups([1.0], "2")}, "table 'a': lookups_per_sample must be a number > 0, got '2'"),
        ({"a": [1.0, 2.0]}, "table 'a': lookups must be a TableLookups, got list"),
        ({3: TableLookups([1.0])}, "lookups are keyed by table name, got int 3"),
        ([TableLookups([1.0])], "lookups must map table names to TableLookups, got list"),
    ],
)
def test_bad_lookups_are_refused_in_one_line(lookups: Any, expected: str) -> None:
    with pytest.raises(SlipcacheError) as error:
        slipcache_planner(Topology(world_size=2, compute_device="cpu"), lookups=lookups)
    assert expected in _one_line(error)


def test_lookups_for_a_table_the_model_lacks_are_refused_before_planning() -> None:
    planner = slipcache_planner(Topology(world_size=2, compute_device="cpu"), lookups={"nope": TableLookups([1.0])})
    with pytest.raises(SlipcacheError) as error:
        planner.plan(
            torch.nn.ModuleDict({"tables": _bags({"a": 64, "b": 64})}), [KeyedCachedEmbeddingBagCollectionSharder()]
        )
    assert "lookups for table 'nope', which no slipcache collection of this model has (its tables: a, b)" in _one_line(
        error
    )
