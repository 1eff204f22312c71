"""Property tests of the row cache: maps consistent, capacity respected, no update ever lost."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipcache.embedding.cache import EMPTY
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

SIZES = [30, 5, 60]
NUM_ROWS = sum(SIZES)


def check_invariants(coll: CachedEmbeddingBagCollection) -> None:
    cache = coll.cache
    resident = cache.slot_rows[cache.slot_rows != EMPTY].long()
    assert resident.numel() <= cache.capacity
    assert resident.unique().numel() == resident.numel(), "a row sits in two slots"
    slots, rows = cache.cached()
    assert torch.equal(cache.set_of(rows), slots // cache.ways), "a row sits outside its set"
    assert torch.equal(cache.lookup(rows), slots), "row -> slot lookup disagrees with slot -> row"
    absent = torch.tensor(sorted(set(range(NUM_ROWS)) - set(rows.tolist())), dtype=torch.long)
    if absent.numel():
        assert bool((cache.lookup(absent) == EMPTY).all())


batches = st.lists(
    st.lists(st.tuples(*(st.integers(0, n - 1) for n in SIZES)), min_size=1, max_size=24),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    batches=batches,
    capacity=st.integers(1, 40),
    ways=st.sampled_from([1, 2, 4, 8]),
    policy=st.sampled_from(["lru", "lfu"]),
    optimizer=st.sampled_from(["sgd", "rowwise_adagrad"]),
    per_table=st.booleans(),
)
@pytest.mark.slow
def test_cache_never_loses_an_update(batches, capacity, ways, policy, optimizer, per_table) -> None:
    """With fp32 storage, any sequence of batches and any (even tiny, or per-table) cache trains exactly as
    no cache."""
    common = dict(
        table_sizes=SIZES, dim=3, precision="fp32", optimizer=optimizer, lr=0.05, lfu_halving_interval=3
    )
    cached = CachedEmbeddingBagCollection(
        EmbeddingConfig(
            cache_rows=[capacity, capacity // 8, 2 * capacity] if per_table else capacity,
            policy=policy,
            ways=ways,
            **common,
        )
    )
    plain = CachedEmbeddingBagCollection(EmbeddingConfig(cache_size=0, policy="none", **common))
    for batch in batches:
        ids = torch.tensor(batch)
        target = torch.arange(ids.numel() * 3, dtype=torch.float32).view(len(batch), len(SIZES), 3) % 5 - 2
        for coll in (cached, plain):
            ((coll(ids) - target) ** 2).sum().backward()
        check_invariants(cached)
        stats = cached.stats()
        assert stats["hits"] + stats["misses"] == stats["lookups"]
    expected = torch.cat(plain.export_tables())
    assert torch.allclose(torch.cat(cached.export_tables()), expected, atol=1e-5)
    cached.flush()
    assert torch.allclose(cached.storage.payload, expected, atol=1e-5), "flush() did not restore every row"
    check_invariants(cached)


def test_batch_larger_than_cache_updates_the_rest_in_storage() -> None:
    coll = CachedEmbeddingBagCollection(
        EmbeddingConfig([1000], dim=4, precision="int8", cache_rows=8, ways=4)
    )
    ids = torch.arange(100).view(100, 1)
    before = torch.cat(coll.export_tables())[:100]
    coll(ids).sum().backward()
    stats = coll.stats()
    assert stats["overflow_rows"] == 92 and coll.cache.cached()[0].numel() == 8
    after = torch.cat(coll.export_tables())[:100]
    # every row moved by -lr * 1, cached or not (int8 rounding error aside)
    assert torch.allclose(after - before, torch.full_like(after, -0.1), atol=0.02)


def test_rows_of_the_batch_in_flight_are_never_evicted() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig([64], dim=2, precision="fp32", cache_rows=4, ways=4))
    first = torch.tensor([[0], [1], [2], [3]])
    coll(first).sum().backward()
    # a batch re-using 2 cached rows plus 5 new ones: only 2 slots may be given up
    out = coll(torch.tensor([[0], [1], [10], [11], [12], [13], [14]]))
    _, rows = coll.cache.cached()
    assert {0, 1} <= set(rows.tolist())
    assert coll.stats()["overflow_rows"] == 3
    out.sum().backward()
