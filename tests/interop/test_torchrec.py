"""TorchRec interop: KJT in / KeyedTensor out, built from EmbeddingBagConfigs, inside TorchRec's DLRM."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "torchrec", reason="torchrec not installed (the torchrec extra; README: Using slipcache with TorchRec)"
)

from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType  # noqa: E402

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig, SparseFeatures  # noqa: E402
from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection  # noqa: E402

SIZES = [30, 7, 200]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrec_dlrm.py"


def _tables(pooling: PoolingType = PoolingType.SUM, dim: int = 8) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{t}"], pooling=pooling
        )
        for t, n in enumerate(SIZES)
    ]


def _bags(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-hot bags (some empty): values and lengths [tables, batch]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(SIZES), batch), generator=gen)
    values = torch.cat(
        [torch.randint(0, SIZES[t], (int(lengths[t].sum()),), generator=gen) for t in range(len(SIZES))]
    )
    return values, lengths


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_kjt_training_equals_sparse_features(pooling: PoolingType) -> None:
    options = dict(precision="int8", cache_size=0.3, lr=0.5, seed=3)
    keyed = KeyedCachedEmbeddingBagCollection(_tables(pooling), **options)
    plain = CachedEmbeddingBagCollection(
        EmbeddingConfig(
            table_sizes=SIZES, dim=8, pooling=pooling.value.lower(), table_names=["t0", "t1", "t2"], **options
        )
    )
    for step in range(4):
        values, lengths = _bags(16, step)
        # The KJT lists its features in another order than the tables: the collection follows the keys.
        order = [2, 0, 1]
        per_feature = list(torch.split(values, lengths.sum(1).tolist()))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in order],
            values=torch.cat([per_feature[t] for t in order]),
            lengths=lengths[order].reshape(-1),
        )
        out = keyed(kjt)
        expected = plain(SparseFeatures.from_lengths(values, lengths))
        assert out.keys() == ["f0", "f1", "f2"]
        torch.testing.assert_close(out.values().view(16, 3, 8), expected, rtol=0, atol=0)
        (out.values() * torch.arange(24.0)).sum().backward()
        (expected.reshape(16, 24) * torch.arange(24.0)).sum().backward()
    for a, b in zip(keyed.export_tables(), plain.export_tables(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert keyed.stats()["hits"] == plain.stats()["hits"] > 0


def test_built_from_configs_and_plain_inputs_still_work() -> None:
    keyed = KeyedCachedEmbeddingBagCollection(_tables(), precision="fp16", cache_size=0)
    assert keyed.table_sizes == SIZES and keyed.table_names == ["t0", "t1", "t2"]
    assert [c.name for c in keyed.embedding_bag_configs()] == ["t0", "t1", "t2"]
    assert keyed(torch.zeros(5, 3, dtype=torch.int64)).shape == (5, 3, 8)
    mixed = KeyedCachedEmbeddingBagCollection(
        [*_tables(), EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=3, feature_names=["x"])]
    )
    assert len(mixed.collections) == 2  # one per dim
    with pytest.raises(ValueError, match="several dims"):
        mixed(torch.zeros(5, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="no feature 'f1'"):
        keyed(
            KeyedJaggedTensor.from_lengths_sync(
                keys=["f0", "f2"],
                values=torch.zeros(2, dtype=torch.int64),
                lengths=torch.ones(2, dtype=torch.int64),
            )
        )


def test_torchrec_dlrm_trains_with_our_tables() -> None:
    """The example's model and loop: TorchRec's DLRM, our INT8 tables, loss goes down."""
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    sizes = [200, 50] + [10] * 24
    model = example.build(sizes, 8, precision="int8", cache_size=0.05, lr=0.5)
    assert type(model.sparse_arch.embedding_bag_collection) is KeyedCachedEmbeddingBagCollection
    losses = example.train(model, example.synthetic_batches(sizes, 128, 150))
    assert sum(losses[-15:]) / 15 < sum(losses[:15]) / 15 - 0.02
    assert model.sparse_arch.embedding_bag_collection.stats()["hits"] > 0


@pytest.mark.parametrize("cache_size", [0.0, 0.5])
def test_shared_table_trains_as_torchrecs_collection(cache_size: float) -> None:
    """Table t0 serves features f0 and g0: lookups pool per feature, and one SGD step sums their gradients."""
    from torchrec import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=30, feature_names=["f0", "g0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=7, feature_names=["f1"]),
    ]
    ours = KeyedCachedEmbeddingBagCollection(tables, precision="fp32", cache_size=cache_size, lr=0.2, seed=1)
    theirs = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    with torch.no_grad():
        for name, weight in zip(("t0", "t1"), ours.export_tables(), strict=True):
            theirs.embedding_bags[name].weight.copy_(weight)
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        lengths = torch.randint(0, 3, (3, 8), generator=gen)
        sizes = [30, 30, 7]  # f0, g0 (both t0), f1
        values = torch.cat(
            [torch.randint(0, sizes[i], (int(lengths[i].sum()),), generator=gen) for i in range(3)]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "g0", "f1"], values=values, lengths=lengths.reshape(-1)
        )
        weights = torch.randn(8, 12, generator=gen)
        out, expected = ours(kjt), theirs(kjt)
        assert out.keys() == expected.keys() == ["f0", "g0", "f1"]
        torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=1e-6)
        (out.values() * weights).sum().backward()
        optimizer.zero_grad()
        (expected.values() * weights).sum().backward()
        optimizer.step()
    for name, weight in zip(("t0", "t1"), ours.export_tables(), strict=True):
        torch.testing.assert_close(weight, theirs.embedding_bags[name].weight.detach(), rtol=0, atol=1e-6)


def _train_against_torchrec(tables: list[EmbeddingBagConfig], weighted: bool, cache_size: float) -> None:
    """3 SGD steps of ours and TorchRec's collection on the same KJTs: equal outputs and equal tables."""
    from torchrec import EmbeddingBagCollection

    ours = KeyedCachedEmbeddingBagCollection(
        tables, is_weighted=weighted, precision="fp32", cache_size=cache_size, lr=0.2, seed=1
    )
    theirs = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))
    assert ours.is_weighted() == theirs.is_weighted() == weighted
    with torch.no_grad():
        for config, weight in zip(tables, ours.export_tables(), strict=True):
            theirs.embedding_bags[config.name].weight.copy_(weight)
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.2)
    features = [(f, t.num_embeddings) for t in tables for f in t.feature_names]
    width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        lengths = torch.randint(0, 4, (len(features), 8), generator=gen)
        values = torch.cat(
            [torch.randint(0, n, (int(lengths[i].sum()),), generator=gen) for i, (_, n) in enumerate(features)]
        )
        weights = torch.rand(values.numel(), generator=gen) if weighted else None
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f for f, _ in features], values=values, lengths=lengths.reshape(-1), weights=weights
        )
        grad = torch.randn(8, width, generator=gen)
        out, expected = ours(kjt), theirs(kjt)
        assert out.keys() == expected.keys() and out.length_per_key() == expected.length_per_key()
        torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=1e-6)
        (out.values() * grad).sum().backward()
        optimizer.zero_grad()
        (expected.values() * grad).sum().backward()
        optimizer.step()
    for config, weight in zip(tables, ours.export_tables(), strict=True):
        torch.testing.assert_close(weight, theirs.embedding_bags[config.name].weight.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cache_size", [0.0, 0.5])
def test_per_table_dims_and_poolings_train_as_torchrecs_collection(cache_size: float) -> None:
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=30, feature_names=["fa", "ga"]),
        EmbeddingBagConfig(
            name="b", embedding_dim=8, num_embeddings=7, feature_names=["fb"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(
            name="c", embedding_dim=4, num_embeddings=11, feature_names=["fc"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="d", embedding_dim=4, num_embeddings=5, feature_names=["fd"]),
    ]
    _train_against_torchrec(tables, weighted=False, cache_size=cache_size)


def test_weighted_kjt_trains_as_torchrecs_weighted_collection() -> None:
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=30, feature_names=["fa", "ga"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=7, feature_names=["fb"]),
    ]
    _train_against_torchrec(tables, weighted=True, cache_size=0.3)
    with pytest.raises(SlipcacheError, match="sum pooling"):
        KeyedCachedEmbeddingBagCollection(_tables(PoolingType.MEAN), is_weighted=True)
    unweighted = KeyedCachedEmbeddingBagCollection(_tables())
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.zeros(3, dtype=torch.int64), lengths=torch.ones(3, dtype=torch.int64),
        weights=torch.ones(3),
    )
    with pytest.raises(ValueError, match="is_weighted=True"):
        unweighted(kjt)


def test_an_extra_kjt_key_warns_once() -> None:
    keyed = KeyedCachedEmbeddingBagCollection(_tables())
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "extra", "f1", "f2"],
        values=torch.tensor([1, 99, 2, 3]),
        lengths=torch.ones(4, dtype=torch.int64),
    )
    with pytest.warns(UserWarning, match=r"\['extra'\] are read by no table"):
        first = keyed(kjt)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second batch with the same key says nothing
        second = keyed(kjt)
    assert first.keys() == ["f0", "f1", "f2"]
    torch.testing.assert_close(first.values(), second.values())


def test_torchrec_fx_traces_a_dlrm_holding_our_tables() -> None:
    from torchrec.fx import symbolic_trace
    from torchrec.models.dlrm import DLRM

    tables = _tables()
    model = DLRM(
        embedding_bag_collection=KeyedCachedEmbeddingBagCollection(tables, precision="int8"),
        dense_in_features=4,
        dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1],
    )
    traced = symbolic_trace(model)
    values, lengths = _bags(6, 0)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=values, lengths=lengths.reshape(-1))
    dense = torch.randn(6, 4)
    model.eval()
    traced.eval()
    with torch.no_grad():
        torch.testing.assert_close(traced(dense, kjt), model(dense, kjt), rtol=0, atol=0)
    assert "_keyed_lookup" in str(traced.graph)  # the lookup is one node, not unrolled
