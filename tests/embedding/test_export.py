"""Inference under torch.export and torch.compile: a DLRM holding the collection exports (cache over storage
read in torch operations, no compiled loop), the exported program scores exactly as the eager model does, and
dynamo traces it in one graph without a break."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from slipcache.embedding.inputs import SparseFeatures
from slipcache.model import DLRM, ModelConfig, build_embeddings

SIZES = [50, 30, 20]
TABLES = [
    {"precision": "int8", "cache_size": 0.3},  # the cache holds trained fp32 rows, the rest INT8
    {"precision": "int4", "cache_size": 0.0},
    {"precision": "fp16", "cache_size": 1.0},
    {"precision": ["int8", "fp32", "int4"], "cache_size": 0.2},  # a precision per table
]


def _trained(options: dict[str, object]) -> DLRM:
    torch.manual_seed(0)
    model = DLRM(ModelConfig(SIZES, 4, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]),
                 build_embeddings(SIZES, 8, **options))
    dense_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        logits = model(torch.randn(16, 4), torch.randint(0, 20, (16, 3))).reshape(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(16)).backward()
        dense_opt.step()
        dense_opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("options", TABLES, ids=lambda o: f"{o['precision']}-{o['cache_size']}")
def test_an_exported_dlrm_scores_as_the_eager_model(options: dict[str, object]) -> None:
    model = _trained(options)
    if model.embeddings.cache.capacity:
        assert model.embeddings.cache.cached()[0].numel() > 0  # the cache holds rows: the overlay is tested
    dense, ids = torch.randn(7, 4), torch.randint(0, 20, (7, 3))
    with torch.no_grad():
        expected = model(dense, ids)
    exported = torch.export.export(model, (dense, ids))
    torch.testing.assert_close(exported.module()(dense, ids), expected, rtol=0, atol=0)
    other = torch.randint(0, 20, (7, 3))  # the ids are an input, not a constant of the program
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(dense, other), model(dense, other), rtol=0, atol=0)


def test_dynamo_traces_inference_in_one_graph() -> None:
    model = _trained(TABLES[0])
    explanation = torch._dynamo.explain(model)(torch.randn(7, 4), torch.randint(0, 20, (7, 3)))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_multi_hot_bags_export_too(pooling: str) -> None:
    coll = build_embeddings(SIZES, 8, precision="int8", cache_size=0.3, pooling=pooling)
    coll(SparseFeatures.from_lengths(torch.arange(6), torch.tensor([[2, 0], [1, 1], [1, 1]]))).sum().backward()
    coll.eval()
    bags = SparseFeatures.from_lengths(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([[2, 0], [1, 1], [0, 2]]))
    with torch.no_grad():
        expected = coll(bags)  # an empty bag pools to zeros
    exported = torch.export.export(coll, (bags,))
    torch.testing.assert_close(exported.module()(bags), expected, rtol=1e-6, atol=1e-7)
    assert torch._dynamo.explain(coll)(bags).graph_break_count == 0
