"""The compiled CPU loops agree with the pure-torch path they replace."""

import numpy as np
import pytest
import torch

from slipcache import _native
from slipcache.embedding.cache import RowCache
from slipcache.errors import InvalidInputError
from slipcache.staleness.config import StalenessConfig
from slipcache.staleness.detector import StaleInputDetector

pytestmark = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("num_rows", [10_000, 2**31 + 10])  # int32 and int64 slot maps
@pytest.mark.parametrize("ways", [8, 80])  # a mask of the ways (up to 64), or one way after another
def test_lookup_and_touch_matches_torch(
    policy: str, num_rows: int, ways: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(2):
        cache = RowCache(512, 4, policy, num_rows, ways=ways, lfu_halving_interval=0)
        rows = torch.randint(
            0, min(num_rows, 5000), (600,), generator=torch.Generator().manual_seed(1)
        ).unique()
        assignment = cache.assign(rows, pin_since=1)
        fits = assignment.slots >= 0
        cache.install(
            assignment.slots[fits],
            rows[fits],
            torch.zeros(int(fits.sum()), 4),
            1,
            torch.ones(int(fits.sum())),
        )
        caches.append(cache)
    queries = torch.randint(0, min(num_rows, 5000), (4000,), generator=g)
    native_slots = caches[0].lookup_and_touch(queries, step=7)
    monkeypatch.setattr(_native, "native", lambda: None)
    torch_slots = caches[1].lookup_and_touch(queries, step=7)
    assert torch.equal(native_slots, torch_slots)
    assert int((native_slots >= 0).sum()) > 100  # the test exercises hits, not only misses
    for a, b in zip(caches[0].buffers(), caches[1].buffers(), strict=True):
        assert torch.equal(a, b)


def test_sgd_update_matches_index_put() -> None:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(300, 16, generator=g)
    slots = torch.randint(0, 300, (5000,), generator=g)  # many repeats
    grad = torch.randn(5000, 16, generator=g)
    expected = weights.clone().index_put_((slots,), grad * -0.1, accumulate=True)
    _native.sgd_update(weights, slots, grad, 0.1)
    assert torch.allclose(weights, expected, atol=1e-5)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_stale_input_filter_matches_numpy(alpha: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector's classification (hot, stale, counters) is the same with and without the compiled loop."""
    sizes = [400, 500, 30, 1000]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, size, 3000) for size in sizes], axis=1).astype(np.int32)

    def detector() -> StaleInputDetector:
        det = StaleInputDetector(StalenessConfig(alpha=alpha), offsets, dim=4)
        det.profile(ids[:300])
        det._threshold = 0.5  # mark a random half of the hot rows stale, without snapshots
        det._stale_flags = np.random.default_rng(1).random(len(det.hot)) < 0.5
        return det

    compiled = detector()
    stale, hot = compiled._classify(ids)
    keep = compiled.count(ids)
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = detector()
    assert np.array_equal(stale, reference._classify(ids)[0]) and np.array_equal(hot, reference._classify(ids)[1])
    assert np.array_equal(keep, reference.count(ids)) and compiled.stats() == reference.stats()
    assert 0 < stale.sum() < hot.sum() < len(ids)  # every outcome occurs


def test_stale_input_filter_rejects_an_id_outside_its_table() -> None:
    det = StaleInputDetector(StalenessConfig(), np.array([0, 5, 10]), dim=4)
    det.profile(np.array([[0, 0]], dtype=np.int32))
    with pytest.raises(InvalidInputError, match="out of range"):
        det.count(np.array([[1, 1], [5, 0]], dtype=np.int32))  # id 5 of a 5-row table
    with pytest.raises(InvalidInputError, match="out of range"):
        det.count(np.array([[1, -1]], dtype=np.int32))


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_compiled_pooling_is_index_add(dim: int) -> None:
    """Sum and mean (weighted) bags: the compiled pass adds in value order, as index_add_ does."""
    if _native.native() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(dim)
    values = torch.randn(3000, dim, generator=g) * 10
    bags = torch.randint(0, 200, (3000,), generator=g)
    weights = torch.rand(3000, generator=g)
    for weight in (None, weights):
        weighted = values if weight is None else values * weight[:, None]
        expected = torch.zeros(200, dim).index_add_(0, bags, weighted)
        assert torch.equal(_native.pool_bags(values, bags, weight, 200), expected)
    with pytest.raises(ValueError, match="bag 200 is outside"):
        _native.pool_bags(values[:2], torch.tensor([0, 200]), None, 200)
