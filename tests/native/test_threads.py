"""The compiled loops split over a worker pool give the pure-torch reference's results bit for bit, for any
thread count: lookups split by position, updates by the cache slots each thread owns."""

import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch

from slipcache import _native
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig, SparseFeatures
from slipcache.embedding.quant import RowStorage
from tests.native.test_fused import assert_same, spy, train

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
            torch.set_num_threads(1)  # as DataLoader workers do: the parent's OpenMP team does not survive a fork
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


def multi_hot(count: int) -> list[SparseFeatures]:
    g = torch.Generator().manual_seed(4)
    inputs = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (len(SIZES), 1024), generator=g)
        values = torch.cat([(torch.rand(int(n), generator=g) ** 3 * SIZES[t]).long()
                            for t, row in enumerate(lengths) for n in row])
        inputs.append(SparseFeatures.from_lengths(values, lengths))
    return inputs


@pytest.mark.parametrize("loop_threads", THREADS, indirect=True)
def test_split_backward_of_multi_hot_bags_equals_the_reference(
    loop_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = multi_hot(3)
    fused = make("int8")
    calls = spy(monkeypatch)
    fused_out = train(fused, inputs)
    assert calls["sgd_update_finite"] == len(inputs) and workers() == loop_threads - 1
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = make("int8")
    for a, b in zip(fused_out, train(reference, inputs), strict=True):
        assert torch.equal(a, b)
    assert_same(fused, reference)


@pytest.mark.parametrize("loop_threads", [2, 3, 4], indirect=True)
def test_overflowing_updates_are_fitted_as_on_one_thread(loop_threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients near fp32's largest value: cached rows overflow to inf in some parts, then are fitted."""
    inputs = big_batches(2)
    runs = []
    for threads in (loop_threads, 1):
        _native.set_threads(threads)
        coll = make("fp32")
        g = torch.Generator().manual_seed(5)
        for ids in inputs:
            out = coll(ids)
            out.backward(torch.rand(out.shape, generator=g) * 1e38)  # finite; sums overflow
        runs.append(coll)
    assert runs[0].stats()["nonfinite_values"] > 0
    assert_same(*runs)


@pytest.mark.parametrize("loop_threads", THREADS, indirect=True)
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("cached", [True, False])
def test_split_adagrad_equals_one_thread(loop_threads: int, optimizer: str, cached: bool) -> None:
    """Adagrad is compared with torch within a tolerance elsewhere; split, it must equal one thread exactly."""
    def build() -> CachedEmbeddingBagCollection:
        config = EmbeddingConfig(SIZES, dim=8, precision="int8", cache_rows=512 if cached else 0, ways=4, lr=0.3,
                                 optimizer=optimizer, seed=1)
        return CachedEmbeddingBagCollection(config)

    inputs = big_batches(3)
    split = build()
    split_out = train(split, inputs)
    assert workers() == loop_threads - 1
    _native.set_threads(1)
    single = build()
    for a, b in zip(split_out, train(single, inputs), strict=True):
        assert torch.equal(a, b)
    assert_same(split, single)


@pytest.mark.parametrize("loop_threads", [3, 4], indirect=True)
@pytest.mark.parametrize("precision", ["int8", "int4", "bf16"])
def test_split_quantize_and_finite_check(loop_threads: int, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes of many distinct rows (stochastic, some rows fitted) split by row range store torch's bytes, and
    reads of many rows (repeats included) decode them as torch does."""
    n, dim = 3000, 9
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, dim, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 3)
    x[5, 0], x[2500, 3], x[1700] = float("nan"), float("inf"), 1e6
    rows = torch.randperm(n + 50, generator=g)[:n]
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(_native, "native", lambda: None)
        storage = RowStorage(n + 50, dim, precision)
        fitted = storage.write(rows, x, "stochastic", torch.Generator().manual_seed(7))
        read = storage.read(torch.cat([rows, rows[:500]]), torch.device("cpu"))
        results.append(([*(b.view(torch.uint8) for b in storage.buffers()), read], fitted.saturated, fitted.nonfinite))
    (ours, sat_a, bad_a), (theirs, sat_b, bad_b) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert torch.equal(sat_a, sat_b) and torch.equal(bad_a, bad_b) and int(bad_a.sum()) >= 2
    monkeypatch.undo()
    values = torch.zeros(300_000)
    assert _native.all_finite(values) and workers() == loop_threads - 1
    for where in (0, 150_001, 299_999):
        poisoned = values.clone()
        poisoned[where] = float("nan")
        assert not _native.all_finite(poisoned)


def test_the_threads_flag_sets_the_loops_threads_for_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache.errors import SlipcacheError
    from slipcache.options import torch_threads

    before, torch_before = _native.threads(), torch.get_num_threads()
    with torch_threads(3):
        assert _native.threads() == 3 and torch.get_num_threads() == 3
    assert _native.threads() == before and torch.get_num_threads() == torch_before
    monkeypatch.setenv("SLIPCACHE_LOOP_THREADS", "2")  # the loops' own count, torch's from the flag
    with torch_threads(1):
        assert _native.threads() == 2 and torch.get_num_threads() == 1
    assert _native.threads() == before
    monkeypatch.setenv("SLIPCACHE_LOOP_THREADS", "two")
    with pytest.raises(SlipcacheError, match="SLIPCACHE_LOOP_THREADS must be a positive integer"), torch_threads(1):
        pass
    assert torch.get_num_threads() == torch_before


@pytest.mark.parametrize("loop_threads", [2], indirect=True)
def test_two_python_threads_share_the_pool(loop_threads: int) -> None:
    """ctypes releases the GIL: a loop called while the pool is busy runs its parts on its own thread."""
    inputs = big_batches(3)
    expected = train(make("int8"), inputs)
    results: dict[int, list[torch.Tensor]] = {}

    def run(key: int) -> None:
        results[key] = train(make("int8"), inputs)

    threads = [threading.Thread(target=run, args=(key,)) for key in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in range(2):
        assert all(torch.equal(a, b) for a, b in zip(results[key], expected, strict=True))


def test_a_process_with_a_running_pool_exits_cleanly() -> None:
    code = (
        "import torch; from slipcache import _native; _native.set_threads(3); "
        "assert _native.all_finite(torch.zeros(400_000)); assert _native.native().slipcache_pool_workers() == 2"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
