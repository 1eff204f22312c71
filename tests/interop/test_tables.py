"""How our TorchRec-facing tables honour TorchRec's table configs (or refuse them in one line), and what
the sharder's planner, refusals and fused Adam / weight decay do, in one process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from torchrec import DataType, EmbeddingBagConfig, EmbeddingConfig  # noqa: E402

from slipcache.embedding.collection import CachedEmbeddingBagCollection, SparseFeatures  # noqa: E402
from slipcache.embedding.config import EmbeddingConfig as OurConfig  # noqa: E402
from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection  # noqa: E402


def _table(name: str, rows: int = 30, dim: int = 8, **fields: object) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{name}"], **fields
    )


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_data_type_sets_the_precision_and_per_table_options_are_dicts() -> None:
    tables = [_table("a", data_type=DataType.FP16), _table("b"), _table("c", data_type=DataType.INT4)]
    module = KeyedCachedEmbeddingBagCollection(tables, cache_size={"a": 0.5, "b": 0.0, "c": 0.1})
    assert module.collections[0].config.precisions == ["fp16", "int8", "int4"]  # FP32 (the default): int8
    assert module.collections[0].config.cache_capacities == [15, 0, 3]
    explicit = KeyedCachedEmbeddingBagCollection(
        [_table("a"), _table("b")], precision={"a": "fp32", "b": "int4"}
    )
    assert explicit.collections[0].config.precisions == ["fp32", "int4"]
    with pytest.raises(SlipcacheError) as error:
        KeyedCachedEmbeddingBagCollection([_table("a", data_type=DataType.FP16)], precision="int8")
    assert "contradicts its data_type FP16" in _one_line(error)
    with pytest.raises(SlipcacheError) as error:
        KeyedCachedEmbeddingBagCollection([_table("a", data_type=DataType.INT2)])
    assert "data_type INT2" in _one_line(error)
    with pytest.raises(SlipcacheError) as error:
        KeyedCachedEmbeddingBagCollection([_table("a")], cache_size={"z": 0.5})
    assert "names no table here: 'z'" in _one_line(error)


def test_init_fields_draw_the_first_rows() -> None:
    def ones(weight: torch.Tensor) -> None:
        weight.fill_(1.0)

    tables = [
        _table("a", rows=500, weight_init_min=0.5, weight_init_max=0.75),
        _table("b", init_fn=ones),
        _table("c", rows=400),
    ]
    module = KeyedCachedEmbeddingBagCollection(tables, precision="fp32")
    a, b, c = module.export_tables()
    assert float(a.min()) >= 0.5 and float(a.max()) <= 0.75 and float(a.std()) > 0.05
    assert torch.equal(b, torch.ones_like(b))
    assert float(c.abs().max()) <= 400**-0.5  # the default: uniform in +-1/sqrt(rows), as TorchRec's


def test_unpooled_configs_scripting_and_bad_devices_are_refused_in_one_line() -> None:
    sequence = EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=10, feature_names=["s"])
    with pytest.raises(SlipcacheError) as error:
        KeyedCachedEmbeddingBagCollection([sequence])
    assert "sequence (unpooled) EmbeddingConfig" in _one_line(error)
    module = KeyedCachedEmbeddingBagCollection([_table("a")])
    with pytest.raises(SlipcacheError) as error:
        torch.jit.script(module)
    assert "torch.fx.symbolic_trace" in _one_line(error)
    with pytest.raises(SlipcacheError) as error:
        KeyedCachedEmbeddingBagCollection([_table("a")], device="nowhere")
    assert "device must name a torch device" in _one_line(error)


def test_device_places_the_cache_and_meta_allocates_nothing() -> None:
    module = KeyedCachedEmbeddingBagCollection([_table("a")], device="cpu")
    assert module.collections[0].device == torch.device("cpu")
    meta = KeyedCachedEmbeddingBagCollection([_table("a", rows=10**9)], device=torch.device("meta"))
    assert meta.collections[0].storage_device.type == "meta"
    assert meta.memory_report()["total_bytes"] > 10**9  # accounted as built, nothing allocated


def test_adam_matches_torch_sparse_adam() -> None:
    """Lazy Adam (moments of the rows a step touches), in the cache and on rows served from storage."""
    sizes, dim, lr = [12, 9], 4, 0.05
    for cache_size in (1.0, 0.0):
        ours = CachedEmbeddingBagCollection(
            OurConfig(
                table_sizes=sizes, dim=dim, precision="fp32", cache_size=cache_size, optimizer="adam", lr=lr
            )
        )
        reference = torch.nn.EmbeddingBag(sum(sizes), dim, mode="sum", sparse=True)
        with torch.no_grad():
            reference.weight.copy_(torch.cat(ours.export_tables()))
        optimizer = torch.optim.SparseAdam(reference.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            lengths = torch.randint(0, 3, (2, 5), generator=generator)
            values = torch.cat(
                [
                    torch.randint(0, n, (int(lengths[t].sum()),), generator=generator)
                    for t, n in enumerate(sizes)
                ]
            )
            weights = torch.randn(5, 2, dim, generator=generator)
            (ours(SparseFeatures.from_lengths(values, lengths)) * weights).sum().backward()
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)[:-1]])
            rows = values + torch.repeat_interleave(torch.tensor([0, sizes[0]]), lengths.sum(1))
            pooled = reference(rows, offsets).view(2, 5, dim).transpose(0, 1)
            optimizer.zero_grad()
            (pooled * weights).sum().backward()
            optimizer.step()
        torch.testing.assert_close(
            torch.cat(ours.export_tables()), reference.weight.detach(), rtol=1e-5, atol=1e-6
        )
        assert ours.memory_report()["components"]["optimizer_state"] == sum(sizes) * dim * 2 * 4


def test_weight_decay_adds_to_the_gradient_of_the_rows_a_step_touches() -> None:
    config = OurConfig(table_sizes=[6], dim=2, precision="fp32", cache_size=0.5, lr=0.1, weight_decay=0.2)
    ours = CachedEmbeddingBagCollection(config)
    before = ours.export_tables()[0].clone()
    ours(torch.tensor([[1], [4], [4]])).sum().backward()
    after = ours.export_tables()[0]
    expected = before.clone()
    for row, count in ((1, 1), (4, 2)):
        expected[row] -= 0.1 * (count + 0.2 * before[row])
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)


def test_every_sharding_type_torchrecs_planner_proposes_is_offered_and_grid_is_refused() -> None:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.types import ParameterSharding, ShardingEnv

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder, slipcache_planner

    module = KeyedCachedEmbeddingBagCollection([_table(name) for name in "abcd"])
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    offered = sharder.sharding_types("cpu")
    assert offered == [
        "table_wise",
        "column_wise",
        "table_column_wise",
        "row_wise",
        "table_row_wise",
        "data_parallel",
    ]
    assert sharder.compute_kernels("data_parallel", "cpu") == [EmbeddingComputeKernel.DENSE.value]
    # TorchRec's planner places tables row-wise and data-parallel for our sharder on CPU
    constraints = {
        "a": ParameterConstraints(sharding_types=["row_wise"]),
        "b": ParameterConstraints(sharding_types=["data_parallel"]),
        "c": ParameterConstraints(sharding_types=["table_column_wise"]),
        "d": ParameterConstraints(sharding_types=["table_row_wise"]),
    }
    planner = slipcache_planner(Topology(world_size=2, compute_device="cpu"), constraints=constraints)
    placed = planner.plan(torch.nn.ModuleDict({"tables": module}), [sharder]).plan["tables"]
    assert {name: placed[name].sharding_type for name in "abcd"} == {
        "a": "row_wise",
        "b": "data_parallel",
        "c": "table_column_wise",
        "d": "table_row_wise",
    }
    plan = {"a": ParameterSharding(sharding_type="grid_shard", compute_kernel="fused", ranks=[0, 1])}
    with pytest.raises(SlipcacheError) as error:
        sharder.shard(module, plan, ShardingEnv(world_size=2, rank=0, pg=None))
    assert "grid_shard sharding is not offered" in _one_line(error)


def test_the_planner_costs_each_shard_by_what_it_holds() -> None:
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import CacheParams

    from slipcache.interop.torchrec import (
        KeyedCachedEmbeddingBagCollectionSharder,
        SlipcacheStorageEstimator,
        slipcache_planner,
    )

    tables = [
        _table("big", rows=4000, dim=16),
        _table("small", rows=100, dim=16),
        _table("wide", rows=50, dim=32),
    ]
    module = KeyedCachedEmbeddingBagCollection(
        tables, precision={"big": "int4"}, cache_size=0.05, optimizer="adam"
    )
    constraints = {
        "wide": ParameterConstraints(
            sharding_types=["column_wise"], cache_params=CacheParams(load_factor=0.5)
        )
    }
    topology = Topology(world_size=2, compute_device="cpu")
    sharder = KeyedCachedEmbeddingBagCollectionSharder()
    planner = slipcache_planner(topology, constraints=constraints)
    plan = planner.plan(torch.nn.ModuleDict({"tables": module}), [sharder])
    placed = plan.plan["tables"]
    assert sorted(placed) == ["big", "small", "wide"]
    assert placed["wide"].sharding_type == "column_wise"
    # each shard costs what a collection of that shard alone reports (TorchRec's estimate: fp32 rows)
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=512,
        constraints=constraints,
        estimator=[SlipcacheStorageEstimator(topology, constraints)],
    )
    options = enumerator.enumerate(module, [sharder])
    checked = 0
    for option in options:
        share = 0.5 if option.name == "wide" else 0.05
        precision = "int4" if option.name == "big" else "int8"
        assert option.cache_load_factor == (0.5 if option.name == "wide" else None)
        for shard in option.shards:
            rows, columns = int(shard.size[0]), int(shard.size[1])
            expected = CachedEmbeddingBagCollection.estimate_memory(
                OurConfig(
                    table_sizes=[rows], dim=columns, precision=precision, cache_size=share, optimizer="adam"
                )
            )["total_bytes"]
            assert (shard.storage.ddr, shard.storage.hbm) == (expected, 0)
            checked += 1
    assert checked >= 4


def test_a_table_of_fewer_rows_than_ranks_is_never_cut_into_an_empty_shard() -> None:
    """Kaggle's 3- and 4-row tables on 4 ranks: TorchRec's row-wise option gives a rank a shard without rows,
    which our sharder cannot build; it is priced beyond any machine, so the planner places those tables
    otherwise, and the big table is still cut row-wise."""
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder, slipcache_planner

    module = KeyedCachedEmbeddingBagCollection(
        [_table("big", rows=40_000, dim=8), _table("three", rows=3, dim=8), _table("four", rows=4, dim=8)]
    )
    constraints = {"big": ParameterConstraints(sharding_types=["row_wise"])}
    planner = slipcache_planner(Topology(world_size=4, compute_device="cpu"), constraints=constraints)
    placed = planner.plan(torch.nn.ModuleDict({"tables": module}), [KeyedCachedEmbeddingBagCollectionSharder()])
    tables = placed.plan["tables"]
    assert tables["big"].sharding_type == "row_wise"
    for parameter in tables.values():
        shards = parameter.sharding_spec.shards if parameter.sharding_spec is not None else []
        assert all(min(shard.shard_sizes) > 0 for shard in shards)


def test_a_table_of_fewer_rows_than_ranks_constrained_to_row_wise_is_refused_in_one_line() -> None:
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder, slipcache_planner

    module = KeyedCachedEmbeddingBagCollection([_table("big", rows=400, dim=8), _table("three", rows=3, dim=8)])
    constraints = {"three": ParameterConstraints(sharding_types=["row_wise"])}
    planner = slipcache_planner(Topology(world_size=4, compute_device="cpu"), constraints=constraints)
    refusal = r"^table 'three' has 3 rows, fewer than the ranks .*data_parallel for it$"
    with pytest.raises(SlipcacheError, match=refusal):
        planner.plan(torch.nn.ModuleDict({"tables": module}), [KeyedCachedEmbeddingBagCollectionSharder()])
