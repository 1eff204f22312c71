"""`KeyedCachedEmbeddingCollection` where TorchRec's `EmbeddingCollection` goes: sequence features, unpooled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor  # noqa: E402

from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import KeyedCachedEmbeddingCollection  # noqa: E402

TABLES = [
    EmbeddingConfig(name="catalog", embedding_dim=4, num_embeddings=40, feature_names=["clicked", "viewed"]),
    EmbeddingConfig(name="shops", embedding_dim=4, num_embeddings=9, feature_names=["shop"]),
]
FEATURES = [("clicked", 40), ("viewed", 40), ("shop", 9)]


def _kjt(gen: torch.Generator, batch: int = 6, longest: int = 5) -> KeyedJaggedTensor:
    lengths = torch.randint(0, longest, (len(FEATURES), batch), generator=gen)
    values = torch.cat([torch.randint(0, n, (int(lengths[i].sum()),), generator=gen)
                        for i, (_, n) in enumerate(FEATURES)])
    return KeyedJaggedTensor.from_lengths_sync(keys=[f for f, _ in FEATURES], values=values,
                                               lengths=lengths.reshape(-1))


@pytest.mark.parametrize("cache_size", [0.0, 0.5])
def test_fp32_sequences_train_as_torchrecs_collection(cache_size: float) -> None:
    """3 SGD steps on the same KJTs (a table two features read, rows read twice in a batch): equal rows out,
    equal lengths, equal tables after, within 1e-6."""
    ours = KeyedCachedEmbeddingCollection(TABLES, precision="fp32", cache_size=cache_size, lr=0.2, seed=1)
    theirs = EmbeddingCollection(tables=TABLES, device=torch.device("cpu"))
    with torch.no_grad():
        for name, weight in zip(("catalog", "shops"), ours.export_tables(), strict=True):
            theirs.embeddings[name].weight.copy_(weight)
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        kjt = _kjt(gen)
        out, expected = ours(kjt), theirs(kjt)
        assert list(out) == list(expected) == ["clicked", "viewed", "shop"]
        loss_ours = loss_theirs = torch.zeros(())
        for name in out:
            torch.testing.assert_close(out[name].values(), expected[name].values(), rtol=0, atol=1e-6)
            assert torch.equal(out[name].lengths(), expected[name].lengths())
            grad = torch.randn(expected[name].values().shape, generator=gen)
            loss_ours = loss_ours + (out[name].values() * grad).sum()
            loss_theirs = loss_theirs + (expected[name].values() * grad).sum()
        loss_ours.backward()
        optimizer.zero_grad()
        loss_theirs.backward()
        optimizer.step()
    for name, weight in zip(("catalog", "shops"), ours.export_tables(), strict=True):
        torch.testing.assert_close(weight, theirs.embeddings[name].weight.detach(), rtol=0, atol=1e-6)
    assert ours.stats()["lookups"] > 0


def test_int8_sequences_learn_and_torchrecs_weights_load() -> None:
    """INT8 behind a cache learns a target per id; TorchRec's `embeddings.<table>.weight` load (rounded to
    INT8); indices come back as TorchRec's need_indices gives them; bag configs and empty input are refused."""
    ours = KeyedCachedEmbeddingCollection(TABLES, precision="int8", cache_size=0.1, lr=0.2, seed=0,
                                          need_indices=True)
    assert ours.embedding_dim() == 4 and ours.embedding_names_by_table() == [["clicked", "viewed"], ["shop"]]
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(40, 4, generator=gen)
    errors = []
    for _ in range(60):
        kjt = _kjt(gen)
        clicked = ours(kjt)["clicked"]
        assert torch.equal(clicked.weights(), kjt["clicked"].values())  # the ids, as need_indices asks
        squared = (clicked.values() - target[clicked.weights()]) ** 2
        (0.5 * squared.sum()).backward()  # each row read steps lr x (row - target)
        errors.append(float(squared.detach().mean()))
    assert sum(errors[-10:]) < 0.1 * sum(errors[:10])
    theirs = EmbeddingCollection(tables=TABLES, device=torch.device("cpu"))
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours.export_tables()[0], theirs.embeddings["catalog"].weight.detach(),
                               rtol=0, atol=float(theirs.embeddings["catalog"].weight.detach().abs().max()) / 100)
    with pytest.raises(SlipcacheError, match="'t' is an EmbeddingBagConfig"):
        KeyedCachedEmbeddingCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3,
                                                           feature_names=["f"])])
    with pytest.raises(SlipcacheError, match="no tables"):
        KeyedCachedEmbeddingCollection([])
    with pytest.raises(SlipcacheError, match="per-id weights are not supported for sequence features"):
        KeyedCachedEmbeddingCollection(TABLES, is_weighted=True)
