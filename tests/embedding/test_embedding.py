import copy

import pytest
import torch
from torch import nn

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig, SparseFeatures

SIZES = [40, 7, 300, 3]


def random_ids(batch: int, seed: int, sizes: list[int] = SIZES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (batch,), generator=g) for n in sizes], dim=1)


def torch_bags(coll: CachedEmbeddingBagCollection, mode: str = "sum") -> nn.ModuleList:
    bags = nn.ModuleList(nn.EmbeddingBag(n, coll.dim, mode=mode, sparse=True) for n in coll.table_sizes)
    with torch.no_grad():
        for bag, table in zip(bags, coll.export_tables(), strict=True):
            bag.weight.copy_(table)
    return bags


@pytest.mark.parametrize(
    "policy,cache", [("lru", {"cache_size": 0.05}), ("lfu", {"cache_size": 0.05}), ("none", {"cache_size": 0}),
                     ("lru", {"cache_rows": 1000}), ("lru", {"cache_size": 1.0})]
)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_fp32_matches_torch_embedding_bag(policy: str, cache: dict, optimizer: str) -> None:
    """fp32 storage trains exactly like nn.EmbeddingBag + the torch optimizer, whatever the cache does."""
    config = EmbeddingConfig(
        SIZES,
        dim=8,
        precision="fp32",
        policy=policy,
        **cache,
        optimizer=optimizer,
        lr=0.01,
        eps=1e-10,
    )
    coll = CachedEmbeddingBagCollection(config)
    bags = torch_bags(coll)
    params = [b.weight for b in bags]
    opt = (
        torch.optim.SGD(params, lr=0.01)
        if optimizer == "sgd"
        else torch.optim.Adagrad(params, lr=0.01, eps=1e-10)
    )
    target = torch.randn(64, len(SIZES), 8)
    for step in range(12):
        ids = random_ids(64, step)
        ours = coll(ids)
        ((ours - target) ** 2).sum().backward()
        opt.zero_grad()
        ref = torch.stack([bag(ids[:, t : t + 1]) for t, bag in enumerate(bags)], dim=1)
        assert torch.allclose(ours, ref, atol=1e-6)
        ((ref - target) ** 2).sum().backward()
        opt.step()
    for table, bag in zip(coll.export_tables(), bags, strict=True):
        assert torch.allclose(table, bag.weight, atol=1e-5)


def test_rowwise_adagrad_matches_reference() -> None:
    config = EmbeddingConfig(
        SIZES, dim=4, precision="fp32", cache_rows=20, optimizer="rowwise_adagrad", lr=0.1
    )
    coll = CachedEmbeddingBagCollection(config)
    weights = torch.cat(coll.export_tables())
    state = torch.zeros(weights.shape[0])
    offsets = torch.tensor([0, 40, 47, 347])
    for step in range(6):
        ids = random_ids(32, step)
        out = coll(ids)
        out.pow(2).sum().backward()
        rows = (ids + offsets).reshape(-1)
        grad = torch.zeros_like(weights).index_add_(0, rows, 2 * weights[rows])
        touched = torch.unique(rows)
        state[touched] += grad[touched].pow(2).mean(1)
        weights[touched] -= 0.1 * grad[touched] / (state[touched].sqrt() + 1e-8)[:, None]
    assert torch.allclose(torch.cat(coll.export_tables()), weights, atol=1e-5)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_multi_hot_matches_torch(pooling: str) -> None:
    config = EmbeddingConfig(SIZES, dim=6, precision="fp32", cache_rows=30, pooling=pooling, lr=0.1)
    coll = CachedEmbeddingBagCollection(config)
    bags = torch_bags(coll, pooling)
    opt = torch.optim.SGD([b.weight for b in bags], lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        lengths = torch.randint(0, 4, (len(SIZES), 16), generator=g)
        values = torch.cat(
            [torch.randint(0, SIZES[t], (int(lengths[t].sum()),), generator=g) for t in range(len(SIZES))]
        )
        features = SparseFeatures.from_lengths(values, lengths)
        ours = coll(features)
        ours.pow(2).sum().backward()
        refs, start = [], 0
        for t, bag in enumerate(bags):
            n = int(lengths[t].sum())
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[t].cumsum(0)[:-1]])
            refs.append(bag(values[start : start + n], offsets))
            start += n
        ref = torch.stack(refs, dim=1)
        assert torch.allclose(ours, ref, atol=1e-6)
        opt.zero_grad()
        ref.pow(2).sum().backward()
        opt.step()
    for table, bag in zip(coll.export_tables(), bags, strict=True):
        assert torch.allclose(table, bag.weight, atol=1e-5)


@pytest.mark.parametrize(
    "precision,cache_size", [("int8", 0.05), ("int4", 0.01), ("int8", 0), ("fp16", 0.05)]
)
def test_small_model_loss_falls(precision: str, cache_size: float) -> None:
    """A linear classifier over embeddings learns a planted signal with low-precision storage."""
    torch.manual_seed(0)
    sizes = [400, 100, 20]
    config = EmbeddingConfig(
        sizes,
        dim=8,
        precision=precision,
        cache_size=cache_size,
        lr=1.0,
        policy="lru" if cache_size else "none",
    )
    coll = CachedEmbeddingBagCollection(config)
    head = nn.Linear(8 * len(sizes), 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    truth = [torch.randn(n) for n in sizes]
    losses = []
    for _step in range(300):
        ids = torch.stack([torch.randint(0, n, (256,)) for n in sizes], dim=1)
        ids[:, 0] = (torch.rand(256) ** 3 * sizes[0]).long()  # skewed: some rows hot
        logit = sum(truth[t][ids[:, t]] for t in range(len(sizes)))
        labels = (logit > 0).float()
        loss = nn.functional.binary_cross_entropy_with_logits(head(coll(ids).flatten(1)).squeeze(1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    # fp32 tables reach about 0.32 on this task
    assert first > 0.6 and last < 0.4, (first, last)


def train_steps(coll: CachedEmbeddingBagCollection, seeds: range) -> torch.Tensor:
    outs = []
    for seed in seeds:
        out = coll(random_ids(128, seed))
        (out - 1).pow(2).sum().backward()
        outs.append(out.detach())
    return torch.cat(outs)


@pytest.mark.parametrize(
    "precision,policy,optimizer",
    [("int8", "lru", "sgd"), ("int4", "lfu", "rowwise_adagrad"), ("fp16", "none", "adagrad")],
)
def test_state_dict_resumes_bit_identically(precision: str, policy: str, optimizer: str) -> None:
    config = EmbeddingConfig(
        SIZES,
        dim=8,
        precision=precision,
        cache_rows=0 if policy == "none" else 12,
        policy=policy,
        optimizer=optimizer,
        ways=4,
        lr=0.01,
    )
    a = CachedEmbeddingBagCollection(config)
    train_steps(a, range(5))
    saved = copy.deepcopy(a.state_dict())
    continued = train_steps(a, range(5, 10))
    b = CachedEmbeddingBagCollection(EmbeddingConfig(**{**config.__dict__, "seed": 99}))
    b.load_state_dict(saved)
    resumed = train_steps(b, range(5, 10))
    assert torch.equal(continued, resumed)
    for name, tensor in a.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, b.state_dict()[name]), name
    assert a.stats() == b.stats()


def test_state_dict_rejects_other_tables() -> None:
    a = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=8))
    b = CachedEmbeddingBagCollection(EmbeddingConfig([41, 7, 300, 3], dim=8))
    with pytest.raises(ValueError, match="table_sizes"):
        b.load_state_dict(a.state_dict())


def test_bad_input_names_the_table() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, table_names=["C1", "C2", "C3", "C4"]))
    ids = random_ids(8, 0)
    ids[3, 1] = 7
    with pytest.raises(ValueError, match=r"C2 \(size 7\): id 7 is outside \[0, 7\)"):
        coll(ids)
    ids[3, 1] = 0
    ids[5, 2] = -1
    with pytest.raises(ValueError, match=r"C3 .*id -1"):
        coll(ids)
    with pytest.raises(ValueError, match="integer"):
        coll(ids.float())
    with pytest.raises(ValueError, match=r"shape \[batch, 4\]"):
        coll(ids[:, :3])
    with pytest.raises(ValueError, match="offsets"):
        coll(SparseFeatures(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3, 5]), 4))
    with pytest.raises(ValueError, match="k \\* 4 \\+ 1"):
        coll(SparseFeatures(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), 4))
    with pytest.raises(ValueError, match="C4 .*id 3"):
        coll(SparseFeatures(torch.tensor([0, 0, 0, 3]), torch.tensor([0, 1, 2, 3, 4]), 4))
    # nothing was changed by the rejected batches
    assert coll.step == 0 and coll.stats()["lookups"] == 0


def test_config_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        EmbeddingConfig(SIZES, precision="int3")
    with pytest.raises(ValueError, match="positive row counts"):
        EmbeddingConfig([10, 0])


def test_stats_add_up() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, cache_size=0.1, ways=4))
    train_steps(coll, range(20))
    stats = coll.stats()
    assert stats["lookups"] == 20 * 128 * len(SIZES)
    assert stats["hits"] + stats["misses"] == stats["lookups"]
    assert stats["per_table"][1]["lookups"] == 20 * 128
    assert 0 < stats["hit_rate"] < 1
    assert stats["rows_in"] >= stats["evictions"] > 0
    assert stats["bytes_in"] == stats["rows_in"] * coll.storage.bytes_per_row
    # eval lookups are read-only and uncounted
    coll.eval()
    with torch.no_grad():
        coll(random_ids(128, 99))
    assert coll.stats() == stats


def test_memory_report_counts_every_buffer() -> None:
    config = EmbeddingConfig(
        [10_000, 5_000], dim=16, precision="int8", cache_size=0.05, policy="lfu", optimizer="rowwise_adagrad"
    )
    coll = CachedEmbeddingBagCollection(config)
    report = coll.memory_report()
    buffer_bytes = sum(b.numel() * b.element_size() for b in coll.buffers())
    generator_bytes = coll.writer.generator.get_state().numel()
    assert report["total_bytes"] == buffer_bytes + generator_bytes
    parts = report["components"]
    assert parts["storage_payload"] == 15_000 * 16
    assert parts["quantization_params"] == 15_000 * 3
    assert parts["cache_rows"] == coll.cache.capacity * 16 * 4
    assert parts["optimizer_state"] == 15_000 * 4
    assert parts["cache_bookkeeping"] >= coll.cache.capacity * (4 + 4 + 4)
    assert report["fp32_bytes"] == 15_000 * 16 * 4 + 15_000 * 4
    assert CachedEmbeddingBagCollection.estimate_memory(config) == report


def test_flush_and_release_write_rows_back() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, precision="fp32", cache_size=0.2))
    train_steps(coll, range(3))
    before = torch.cat(coll.export_tables())
    coll.flush()
    assert torch.equal(coll.storage.payload, before)
    slots, rows = coll.cache.cached()
    assert coll.release_rows(rows[:5]) == 5
    assert coll.cache.lookup(rows[:5]).lt(0).all()
    assert torch.equal(torch.cat(coll.export_tables()), before)


def test_load_tables_round_trip_and_errors() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, precision="fp32", cache_size=0.2))
    train_steps(coll, range(2))  # something is cached
    tables = [torch.randn(n, 4) for n in SIZES]
    coll.load_tables(tables)
    assert coll.cache.cached()[0].numel() == 0
    for loaded, expected in zip(coll.export_tables(), tables, strict=True):
        assert torch.equal(loaded, expected)
    with pytest.raises(ValueError, match=r"table 1: expected shape \(7, 4\)"):
        coll.load_tables([tables[0], torch.zeros(8, 4), tables[2], tables[3]])
