"""Per-table precision and cache size: storage, cache parts, statistics, memory report, config files."""

import copy

import pytest
import torch

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.quant import RowStorage
from slipcache.errors import SlipcacheError
from slipcache.training.config import load_config_file, make_config

SIZES = [40, 7, 300, 3]
MIXED = ["fp32", "int8", "fp16", "int4"]


def ids(seed: int, batch: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (batch,), generator=g) for n in SIZES], dim=1)


def test_each_table_is_stored_in_its_own_precision() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, precision=MIXED, seed=5))
    fp32 = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, precision="fp32", seed=5)).export_tables()
    for table, start, precision in zip(coll.export_tables(), fp32, MIXED, strict=True):
        rounded = RowStorage(start.shape[0], 4, precision)
        rounded.write_range(0, start, "nearest", None)
        assert torch.equal(table, rounded.read(torch.arange(start.shape[0]), torch.device("cpu"))), precision
    stats_bytes = {"fp32": 16, "int8": 4 + 3, "fp16": 8, "int4": 2 + 3}
    for _ in range(3):
        coll(ids(_)).sum().backward()
    for entry, precision in zip(coll.stats()["per_table"], MIXED, strict=True):
        assert entry["bytes_in"] == entry["rows_in"] * stats_bytes[precision]


def test_mixed_precision_trains_like_each_precision_alone() -> None:
    """A mixed collection with no cache gives each table the rows a one-precision collection gives it."""
    common = dict(dim=4, cache_size=0.0, policy="none", rounding="nearest", lr=0.05, seed=2)
    mixed = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, precision=MIXED, **common))
    alone = [CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, precision=p, **common)) for p in MIXED]
    for step in range(4):
        batch = ids(step)
        mixed(batch).pow(2).sum().backward()
        for coll in alone:
            coll(batch).pow(2).sum().backward()
    tables = mixed.export_tables()
    for t, coll in enumerate(alone):
        assert torch.equal(tables[t], coll.export_tables()[t]), MIXED[t]


def test_per_table_cache_parts() -> None:
    config = EmbeddingConfig(SIZES, dim=4, precision="int8", cache_size=[0.5, 0.0, 0.05, 1.0], ways=4)
    coll = CachedEmbeddingBagCollection(config)
    assert config.cache_capacities == [20, 0, 15, 3]
    assert coll.cache.part_slots == [20, 0, 16, 4]  # whole sets of 4 ways
    for step in range(20):
        coll(ids(step)).sum().backward()
    per_table = coll.stats()["per_table"]
    assert per_table[1]["hits"] == 0 and per_table[1]["overflow_rows"] > 0  # no slots for table 1
    assert per_table[3]["rows_in"] == 3  # every row of table 3 came in once and stayed
    _, rows = coll.cache.cached()
    assert not bool(((rows >= 40) & (rows < 47)).any())
    assert int(((rows >= 47) & (rows < 347)).sum()) <= 16  # table 2 never takes another table's slots
    counts = EmbeddingConfig(SIZES, dim=4, cache_rows=[5, 7, 1000, 0])
    assert counts.cache_capacities == [5, 7, 300, 0]
    with pytest.raises(ValueError, match="one value or one per table"):
        EmbeddingConfig(SIZES, cache_size=[0.1, 0.1])


def test_memory_report_per_table_is_exact() -> None:
    config = EmbeddingConfig(
        [1000, 500], dim=16, precision=["int8", "fp16"], cache_size=[0.05, 0.1], policy="lfu",
        optimizer="rowwise_adagrad",
    )
    coll = CachedEmbeddingBagCollection(config)
    report = coll.memory_report()
    assert report["total_bytes"] == sum(b.numel() * b.element_size() for b in coll.buffers()) + (
        coll.writer.generator.get_state().numel()
    )
    int8, fp16 = report["per_table"]
    assert (int8["storage_payload"], int8["quantization_params"]) == (1000 * 16, 1000 * 3)
    assert (fp16["storage_payload"], fp16["quantization_params"]) == (500 * 32, 0)
    assert int8["optimizer_state"] == 1000 * 4 and fp16["optimizer_state"] == 500 * 4
    slots = coll.cache.part_slots
    assert int8["cache_rows"] == slots[0] * 16 * 4 and fp16["cache_rows"] == slots[1] * 16 * 4
    assert int8["cache_bookkeeping"] == slots[0] * (4 + 4 + 4)  # resident row, last use, use count
    parts = report["components"]
    for name in ("storage_payload", "quantization_params", "cache_rows", "optimizer_state"):
        assert parts[name] == int8[name] + fp16[name], name
    assert report["shared_bytes"] == report["total_bytes"] - int8["total_bytes"] - fp16["total_bytes"] > 0
    assert CachedEmbeddingBagCollection.estimate_memory(config) == report
    shared = CachedEmbeddingBagCollection(EmbeddingConfig([1000, 500], dim=16, cache_size=0.05)).memory_report()
    assert shared["per_table"][0]["cache_rows"] is None  # one cache for both tables: not split


def test_mixed_configuration_resumes_bit_identically() -> None:
    config = EmbeddingConfig(SIZES, dim=4, precision=MIXED, cache_size=[0.2, 0.5, 0.05, 0.0], ways=2)
    a = CachedEmbeddingBagCollection(config)
    for step in range(3):
        a(ids(step)).sum().backward()
    saved = copy.deepcopy(a.state_dict())
    b = CachedEmbeddingBagCollection(EmbeddingConfig(**{**config.__dict__, "seed": 9}))
    b.load_state_dict(saved)
    outs = []
    for coll in (a, b):
        out = coll(ids(7))
        out.sum().backward()
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(x, y) for x, y in zip(a.export_tables(), b.export_tables(), strict=True))
    other = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, precision="int8", cache_size=0.1))
    with pytest.raises(ValueError, match="precision"):
        other.load_state_dict(saved)


def test_config_file_takes_per_table_lists(tmp_path) -> None:
    from slipcache.training.backend import build_model

    path = tmp_path / "plan.toml"
    path.write_text('precision = ["int8", "fp32"]\ncache_size = [0.05, 1]\npolicy = "lfu"\n')
    model = build_model(make_config(load_config_file(path)), [200, 30], num_dense=13)
    assert model.embeddings.config.precisions == ["int8", "fp32"]
    assert model.embeddings.config.cache_capacities == [10, 30]
    path.write_text("cache_rows = [100, 0]\n")
    assert build_model(make_config(load_config_file(path)), [200, 30], 13).embeddings.cache.part_slots[1] == 0
    path.write_text('precision = ["int8", "int3"]\n')
    with pytest.raises(SlipcacheError, match="precision must be one of"):
        make_config(load_config_file(path))
    path.write_text("cache_size = [0.1, 0.1, 0.1]\n")
    with pytest.raises(SlipcacheError, match="one value or one per table"):
        build_model(make_config(load_config_file(path)), [200, 30], 13)
