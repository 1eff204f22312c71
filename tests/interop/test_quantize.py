"""TorchRec's `quantize_embeddings` on a model holding our tables: refused in one line unless our class is
named in the call, then every table is stored at the dtype asked for; never a silent no-op. A plain
`quantize_dynamic` of the dense layers leaves the tables alone."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection  # noqa: E402
from tests.interop import torchrec_shards as shards  # noqa: E402

NAMED = {
    "additional_qconfig_spec_keys": [KeyedCachedEmbeddingBagCollection],
    "additional_mapping": {KeyedCachedEmbeddingBagCollection: KeyedCachedEmbeddingBagCollection},
}


def _model() -> torch.nn.Module:
    from torchrec.models.dlrm import DLRM

    tables = [t for t in shards.tables() if t.embedding_dim == 8]
    ebc = KeyedCachedEmbeddingBagCollection(tables, precision="fp32", cache_size=0.5, lr=0.1, seed=2)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[8],
                over_arch_layer_sizes=[4, 1])  # fmt: skip


def _quantize(model: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
    from torchrec.inference.modules import quantize_embeddings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_embeddings(model, **{"dtype": torch.qint8, "inplace": False, **kwargs})


def _kjt() -> object:
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f2", "f3", "f4"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
        lengths=torch.ones(8, dtype=torch.int64),
    )  # fmt: skip


def test_quantize_embeddings_without_our_class_named_is_refused_in_one_line() -> None:
    model = _model()
    before = model.sparse_arch.embedding_bag_collection.export_tables()
    message = "quantize_embeddings does not reach slipcache's tables unless named"
    with pytest.raises(SlipcacheError, match=message) as info:
        _quantize(model)
    assert "\n" not in str(info.value)
    ebc = model.sparse_arch.embedding_bag_collection
    assert [c.config.precisions for c in ebc.collections] == [["fp32"] * 3]
    assert all(torch.equal(a, b) for a, b in zip(before, ebc.export_tables(), strict=True))


def test_quantize_embeddings_naming_our_class_stores_the_tables_at_the_dtype_asked_for() -> None:
    from torchrec.modules.embedding_configs import DataType

    model = _model()
    ebc = model.sparse_arch.embedding_bag_collection
    quantized = _quantize(model, per_table_weight_dtype={"t3": torch.quint4x2}, **NAMED)
    theirs = quantized.sparse_arch.embedding_bag_collection
    assert isinstance(theirs, KeyedCachedEmbeddingBagCollection) and theirs is not ebc  # inplace=False: a copy
    assert [c.config.precisions for c in theirs.collections] == [["int8", "int8", "int4"]]
    assert [t.data_type for t in theirs.embedding_bag_configs()] == [DataType.INT8, DataType.INT8, DataType.INT4]
    assert [c.config.precisions for c in ebc.collections] == [["fp32"] * 3]  # the original is left as it was
    for mine, rounded, precision in zip(
        ebc.export_tables(), theirs.export_tables(), ["int8", "int8", "int4"], strict=True
    ):
        span = (mine.amax(dim=1) - mine.amin(dim=1))[:, None]
        steps = 255 if precision == "int8" else 15
        assert ((rounded - mine).abs() <= span / steps * 1.1 + 1e-3).all()  # rounded to nearest on its grid
    theirs.eval()
    dense = torch.randn(2, 3)
    assert quantized(dense, _kjt()).shape == (2, 1)
    with pytest.raises(SlipcacheError, match="output_dtype=torch.float16"):
        _quantize(_model(), output_dtype=torch.float16, **NAMED)
    with pytest.raises(SlipcacheError, match="quantization dtype torch.quint2x4 has no storage precision"):
        _quantize(_model(), dtype=torch.quint2x4, **NAMED)


def test_dynamic_quantization_of_the_dense_layers_leaves_the_tables_alone() -> None:
    model = _model()
    quantized = torch.ao.quantization.quantize_dynamic(model, inplace=False)
    ebc = quantized.sparse_arch.embedding_bag_collection
    assert [c.config.precisions for c in ebc.collections] == [["fp32"] * 3]
    assert isinstance(ebc, KeyedCachedEmbeddingBagCollection) and not hasattr(ebc, "qconfig")
