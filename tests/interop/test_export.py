"""torch.export of TorchRec's DLRM holding our keyed collection: the KeyedJaggedTensor path traces (the
per-feature split of its lengths becomes symbolic sizes), and the program, exported with a dynamic number of
ids, scores other batches exactly as the eager model does."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")


def _kjt(values: list[int], lengths: list[int]) -> object:
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.tensor(values), lengths=torch.tensor(lengths)
    )


def test_torchrecs_dlrm_with_our_tables_exports_and_scores_as_eager() -> None:
    from torchrec import EmbeddingBagConfig, PoolingType
    from torchrec.models.dlrm import DLRM

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection

    warnings.simplefilter("ignore")
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0", "f2"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=30, feature_names=["f1"],
                           pooling=PoolingType.MEAN),
    ]  # fmt: skip
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=KeyedCachedEmbeddingBagCollection(tables, precision="int8", cache_size=0.2),
                 dense_in_features=4, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 1])  # fmt: skip
    dense = torch.randn(2, 4)
    model(dense, _kjt([1, 2, 3, 4, 5, 6, 7], [2, 1, 1, 1, 0, 2])).sum().backward()  # the cache now holds rows
    model.eval()
    kjt = _kjt([1, 2, 3, 4, 5, 6, 7], [2, 1, 1, 1, 0, 2])
    shapes = torch.export.ShapesCollection()
    shapes[kjt.values()] = {0: torch.export.Dim("ids", min=1)}  # any number of ids; the rest as given
    exported = torch.export.export(model, (dense, kjt), dynamic_shapes=shapes.dynamic_shapes(model, (dense, kjt)))
    for other in (kjt, _kjt([9, 8, 7, 6, 5], [1, 1, 0, 2, 1, 0]), _kjt([3, 1, 4, 1, 5, 9, 2, 6], [4, 0, 1, 1, 0, 2])):
        with torch.no_grad():
            expected = model(dense, other)
        torch.testing.assert_close(exported.module()(dense, other), expected, rtol=0, atol=0)
