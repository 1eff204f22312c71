import pytest
import torch

from slipcache.errors import InvalidInputError, SlipcacheError
from slipcache.model import DLRM, ModelConfig, TorchEmbeddingBagCollection, build_embeddings

CRITEO_SIZES = [50] * 26


def test_criteo_interaction_size_is_367() -> None:
    config = ModelConfig(table_sizes=CRITEO_SIZES)
    assert config.interaction_dim == 367
    model = DLRM(config, build_embeddings(CRITEO_SIZES, 16, embeddings="torch"))
    assert model.top[0].in_features == 367
    assert [m.out_features for m in model.bottom if isinstance(m, torch.nn.Linear)] == [512, 256, 64, 16]
    assert [m.out_features for m in model.top if isinstance(m, torch.nn.Linear)] == [512, 256, 1]
    assert not isinstance(model.top[-1], torch.nn.ReLU)


def test_forward_shapes_and_backward() -> None:
    sizes = [7, 3, 11]
    config = ModelConfig(table_sizes=sizes, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[5, 1])
    emb = TorchEmbeddingBagCollection(sizes, 4, seed=1)
    model = DLRM(config, emb)
    dense = torch.randn(6, 13)
    ids = torch.stack([torch.randint(0, n, (6,)) for n in sizes], dim=1)
    assert emb(ids).shape == (6, 3, 4)
    inter = model.interact(model.bottom(dense), emb(ids))
    assert inter.shape == (6, 4 + 4 * 3 // 2)
    logits = model(dense, ids)
    assert logits.shape == (6,)
    logits.sum().backward()
    assert emb.bags[0].weight.grad is not None and emb.bags[0].weight.grad.is_sparse


def test_interaction_values() -> None:
    sizes = [2, 2]
    config = ModelConfig(table_sizes=sizes, embedding_dim=2, bottom_mlp=[2], top_mlp=[1])
    model = DLRM(config, TorchEmbeddingBagCollection(sizes, 2))
    x = torch.tensor([[1.0, 2.0]])
    e = torch.tensor([[[3.0, 0.0], [0.0, 5.0]]])
    # pairs (x,e1)=3, (x,e2)=10, (e1,e2)=0
    assert model.interact(x, e).tolist() == [[1.0, 2.0, 3.0, 10.0, 0.0]]


def test_baseline_init_read_rows_stats_memory() -> None:
    sizes = [100, 4]
    emb = TorchEmbeddingBagCollection(sizes, 8, seed=0)
    assert emb.bags[0].weight.abs().max() <= 0.1 + 1e-6
    assert emb.bags[1].weight.abs().max() <= 0.5 + 1e-6
    assert emb.table_offsets.tolist() == [0, 100, 104]
    rows = emb.read_rows(torch.tensor([101, 5]))
    assert torch.equal(rows[0], emb.bags[1].weight[1]) and torch.equal(rows[1], emb.bags[0].weight[5])
    emb(torch.tensor([[1, 2], [3, 0]]))
    stats = emb.stats()
    assert stats["lookups"] == 4 and stats["hit_rate"] is None and stats["hits"] == 0
    mem = emb.memory_report()
    assert mem["total_bytes"] == mem["fp32_bytes"] == 104 * 8 * 4 and mem["memory_ratio"] == 1.0
    assert emb.fused_update is False
    same = TorchEmbeddingBagCollection(sizes, 8, seed=0)
    assert torch.equal(same.bags[0].weight, emb.bags[0].weight)


def test_bad_ids_and_config() -> None:
    emb = TorchEmbeddingBagCollection([3, 3], 4)
    with pytest.raises(InvalidInputError):
        emb(torch.tensor([[0, 3]]))
    with pytest.raises(InvalidInputError):
        emb(torch.tensor([[0, 1, 2]]))
    with pytest.raises(SlipcacheError):
        ModelConfig(table_sizes=[3], embedding_dim=8, bottom_mlp=[16])
    with pytest.raises(SlipcacheError):
        DLRM(ModelConfig(table_sizes=[3, 4], embedding_dim=4, bottom_mlp=[4]), emb)
    with pytest.raises(SlipcacheError):
        build_embeddings([3], 4, embeddings="magic")


def test_sparse_sgd_updates_only_touched_rows() -> None:
    sizes = [10]
    emb = TorchEmbeddingBagCollection(sizes, 4)
    before = emb.bags[0].weight.detach().clone()
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    emb(torch.tensor([[2], [2], [7]])).sum().backward()
    opt.step()
    changed = (emb.bags[0].weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2, 7]
