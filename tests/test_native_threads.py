"""The compiled loops split over a worker pool give the pure-torch reference's results bit for bit, for any
thread count: lookups split by position, updates by the cache slots each thread owns."""

import os
import warnings
from collections.abc import Iterator

import pytest
import torch

from slipcache import _native
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from tests.test_fused import assert_same, spy, train

pytestmark = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")

BATCH = 1400  # x 3 tables: 4200 lookups, enough for 4 parts of the loops' smallest share (1024 lookups)
THREADS = [1, 2, 3, 4]
SIZES = [500, 3000, 20000]


def make(precision: str, policy: str = "lru", optimizer: str = "sgd") -> CachedEmbeddingBagCollection:
    """512 slots in 4-way sets: hits, misses, evictions and rows served from storage in every step."""
    config = EmbeddingConfig(SIZES, dim=8, precision=precision, cache_rows=512, ways=4, policy=policy, lr=0.3,
                             optimizer=optimizer, seed=1)
    return CachedEmbeddingBagCollection(config)


@pytest.fixture
def loop_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = _native.set_threads(request.param)
    yield request.param
    _native.set_threads(previous)


def workers() -> int:
    return int(_native.native().slipcache_pool_workers())


def big_batches(count: int) -> list[torch.Tensor]:
    """Skewed ids: many duplicates in a batch, far more rows than the cache holds."""
    g = torch.Generator().manual_seed(11)
    return [torch.stack([(torch.rand(BATCH, generator=g) ** 3 * n).long() for n in SIZES], dim=1) for _ in range(count)]


@pytest.mark.parametrize("loop_threads", THREADS, indirect=True)
@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_split_step_equals_the_torch_reference(
    loop_threads: int, precision: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = big_batches(4)
    fused = make(precision, policy)
    calls = spy(monkeypatch)
    fused_out = train(fused, inputs)
    assert calls["lookup_gather"] == len(inputs) and calls["sgd_update_finite"] == len(inputs)
    assert workers() == loop_threads - 1  # the loops did run on the pool
    stats = fused.stats()
    assert stats["evictions"] > 0 and stats["overflow_rows"] > 0 and stats["hits"] > 0
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = make(precision, policy)
    for a, b in zip(fused_out, train(reference, inputs), strict=True):
        assert torch.equal(a, b)
    assert_same(fused, reference)


@pytest.mark.parametrize("loop_threads", [2, 3], indirect=True)
def test_a_fork_child_builds_its_own_pool(loop_threads: int) -> None:
    """DataLoader workers and torchrun fork: the child has none of the parent's workers and starts its own."""
    coll = make("fp32")
    inputs = big_batches(2)
    expected = train(make("fp32"), inputs)
    assert workers() == loop_threads - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running: what we test
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            before = workers()
            got = train(coll, inputs)
            code = 0 if before == 0 and workers() == loop_threads - 1 and all(
                torch.equal(a, b) for a, b in zip(got, expected, strict=True)) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(train(coll, inputs)[1], expected[1])  # the parent's pool still serves it


def test_the_pool_is_resized_and_results_stay() -> None:
    inputs = big_batches(2)
    outputs = []
    previous = _native.set_threads(4)
    try:
        for count in (4, 2, 1, 3):
            _native.set_threads(count)
            outputs.append(train(make("int8", "lfu"), inputs))
            assert workers() == count - 1 and _native.threads() == count
    finally:
        _native.set_threads(previous)
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="threads must be positive"):
        _native.set_threads(0)
