"""A trained collection (and a model holding it) survives `torch.save(model)` / `copy.deepcopy`: the copy
continues training exactly as the original does (saved with a prefetch in flight), and a forward in
flight does not stop the save."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

SIZES = [40, 25, 60]


def _ids(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (16,), generator=generator) for n in SIZES], 1)


def _step(collection: CachedEmbeddingBagCollection, seed: int) -> None:
    collection.set_lookahead([_ids(seed + 1)], prefetch=True)
    collection(_ids(seed)).pow(2).sum().backward()


def _saved_and_loaded(module: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_trained_collection_copies_and_trains_on_like_the_original(how: str) -> None:
    config = EmbeddingConfig(SIZES, 4, precision="int8", cache_size=0.2, rounding="stochastic", lr=0.1)
    original = CachedEmbeddingBagCollection(config)
    for seed in range(3):
        _step(original, seed)  # each leaves a prefetch of the next batch's rows in flight
    copied = _saved_and_loaded(original) if how == "torch.save" else copy.deepcopy(original)
    for seed in range(3, 6):
        _step(original, seed)
        _step(copied, seed)
    for a, b in zip(original.export_tables(), copied.export_tables(), strict=True):
        assert torch.equal(a, b)


def test_a_collection_is_saved_with_a_forward_in_flight() -> None:
    """The graph of a forward whose backward has not run is not saved; the copy trains on its own."""
    original = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, 4, precision="int8", cache_size=0.2))
    _step(original, 0)
    in_flight = original(_ids(1))
    copied = _saved_and_loaded(original)
    in_flight.pow(2).sum().backward()
    before = [t.clone() for t in copied.export_tables()]
    _step(copied, 2)
    after = copied.export_tables()
    assert all(torch.isfinite(t).all() for t in after)
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_torchrec_dlrm_holding_our_tables_is_saved_whole() -> None:
    pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=4, num_embeddings=n, feature_names=[f"f{t}"])
        for t, n in enumerate(SIZES)
    ]
    ebc = KeyedCachedEmbeddingBagCollection(tables, precision="int8", cache_size=0.2)
    model = DLRM(
        embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[4, 4], over_arch_layer_sizes=[4, 1]
    )
    ids = _ids(0)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(len(SIZES))], values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int64),
    )
    dense = torch.randn(16, 3)
    model(dense, kjt).sum().backward()
    logged = model(dense, kjt).mean().item()  # a forward for logging, in training mode: its graph lives on
    loaded = _saved_and_loaded(model)
    assert logged == pytest.approx(loaded(dense, kjt).mean().item())
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(dense, kjt), model(dense, kjt))
