"""Weights between our tables and TorchRec's `EmbeddingBagCollection`: the state_dict key mapping, loading
TorchRec-trained weights into any precision, and serving through TorchRec's own quantization."""

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402

from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection  # noqa: E402
from slipcache.interop.torchrec_weights import (  # noqa: E402
    from_torchrec,
    load_torchrec_state_dict,
    to_torchrec,
    torchrec_state_dict,
)

SIZES = [40, 9, 120]


def _tables(dim: int = 8) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{t}"])
        for t, n in enumerate(SIZES)
    ]


def _kjt(batch: int, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(SIZES), batch), generator=gen)
    values = torch.cat([torch.randint(0, n, (int(lengths[t].sum()),), generator=gen) for t, n in enumerate(SIZES)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(len(SIZES))], values=values, lengths=lengths.reshape(-1)
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_torchrec_trained_weights_load_into_any_precision(precision: str) -> None:
    torch.manual_seed(0)
    theirs = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    ours = from_torchrec(theirs, precision=precision, cache_size=0.2)
    assert [c.name for c in ours.embedding_bag_configs()] == ["t0", "t1", "t2"] and not ours.is_weighted()
    for table, weight in zip(ours.export_tables(), theirs.state_dict().values(), strict=True):
        span = (weight.amax(1) - weight.amin(1))[:, None]
        levels = {"fp32": None, "fp16": None, "int8": 255, "int4": 15}[precision]
        bound = 1e-3 * weight.abs() + 1e-7 if levels is None else span / levels * 1.1  # a step of its grid
        assert bool(((table - weight).abs() <= bound).all())
        if precision == "fp32":
            assert torch.equal(table, weight)
    ours.eval()
    with torch.no_grad():
        kjt = _kjt(16, 1)
        got, want = ours(kjt).values(), theirs(kjt).values()
    tolerance = 1e-6 if precision == "fp32" else 0.25 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


def test_state_dict_keys_map_to_torchrecs() -> None:
    ours = KeyedCachedEmbeddingBagCollection(_tables(), precision="fp32", seed=3)
    mapped = torchrec_state_dict(ours)
    theirs = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    assert list(mapped) == list(theirs.state_dict()) == [f"embedding_bags.t{t}.weight" for t in range(3)]
    theirs.load_state_dict(mapped)
    # a whole model's state_dict loads by the keys' suffix
    model = DLRM(embedding_bag_collection=theirs, dense_in_features=2, dense_arch_layer_sizes=[8, 8],
                 over_arch_layer_sizes=[8, 1])
    other = KeyedCachedEmbeddingBagCollection(_tables(), precision="fp32", seed=4)
    load_torchrec_state_dict(other, model.state_dict())
    for a, b in zip(other.export_tables(), ours.export_tables(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(SlipcacheError, match="no weight for table 't2'"):
        load_torchrec_state_dict(other, {k: v for k, v in mapped.items() if "t2" not in k})
    with pytest.raises(SlipcacheError, match="matches no table"):
        load_torchrec_state_dict(other, {**mapped, "embedding_bags.zz.weight": torch.zeros(1, 8)})


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
def test_serving_through_torchrecs_quantization() -> None:
    """Train our INT8 tables in TorchRec's DLRM, hand the rows to a TorchRec EBC, quantize it with
    torchrec.inference.modules.quantize_embeddings: the served model scores as ours does."""
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    torch.manual_seed(0)
    arch = dict(dense_in_features=2, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    ours = KeyedCachedEmbeddingBagCollection(_tables(), precision="int8", cache_size=0.2, lr=0.5)
    trained = DLRM(embedding_bag_collection=ours, **arch)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    for step in range(5):
        loss = trained(torch.randn(32, 2), _kjt(32, step)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    served = DLRM(embedding_bag_collection=to_torchrec(ours), **arch)
    dense_state = {k: v for k, v in trained.state_dict().items() if not k.startswith("sparse_arch.")}
    missing, unexpected = served.load_state_dict(dense_state, strict=False)
    assert not unexpected and all(k.startswith("sparse_arch.embedding_bag_collection.embedding_bags.") for k in missing)
    quantize_embeddings(served, dtype=torch.qint8, inplace=True)
    assert isinstance(served.sparse_arch.embedding_bag_collection, QuantEmbeddingBagCollection)
    trained.eval()
    dense, kjt = torch.randn(64, 2), _kjt(64, 99)
    with torch.no_grad():
        want, got = trained(dense, kjt), served(dense, kjt)
    assert float(want.std()) > 1e-3  # the scores differ between samples: the comparison means something
    assert float((got - want).abs().max()) < 0.1 * float(want.std())  # measured: 8.8e-5 against std 0.012


def test_a_plain_load_state_dict_of_torchrec_weights_loads_them() -> None:
    """TorchRec's keys load through `load_state_dict` itself (strict), alone or inside a whole model's
    state_dict; our own state_dict still loads exactly; a missing or unknown table is named."""
    torch.manual_seed(0)
    theirs = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    ours = KeyedCachedEmbeddingBagCollection(_tables(), precision="fp32", cache_size=0.2)
    assert not ours.load_state_dict(theirs.state_dict()).missing_keys
    assert all(torch.equal(a, b) for a, b in zip(ours.export_tables(), theirs.state_dict().values(), strict=True))
    their_model = DLRM(embedding_bag_collection=theirs, dense_in_features=3, dense_arch_layer_sizes=[8],
                       over_arch_layer_sizes=[4, 1])  # fmt: skip
    int8 = KeyedCachedEmbeddingBagCollection(_tables(), precision="int8", cache_size=0.2, seed=3)
    our_model = DLRM(embedding_bag_collection=int8, dense_in_features=3, dense_arch_layer_sizes=[8],
                     over_arch_layer_sizes=[4, 1])  # fmt: skip
    our_model.load_state_dict(their_model.state_dict())
    for table, weight in zip(int8.export_tables(), theirs.state_dict().values(), strict=True):
        span = (weight.amax(1) - weight.amin(1))[:, None]
        assert bool(((table - weight).abs() <= span / 255 * 1.1).all())  # rounded to nearest on its grid
    partial = theirs.state_dict()
    partial.pop("embedding_bags.t1.weight")
    partial["embedding_bags.t9.weight"] = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "embedding_bags.t1.weight"'):
        ours.load_state_dict(partial)
    assert ours.load_state_dict(partial, strict=False).unexpected_keys == ["embedding_bags.t9.weight"]
    same = KeyedCachedEmbeddingBagCollection(_tables(), precision="fp32", cache_size=0.2, seed=9)
    same.load_state_dict(ours.state_dict())  # our own keys: exact
    assert all(torch.equal(a, b) for a, b in zip(same.export_tables(), ours.export_tables(), strict=True))
