"""The fused compiled step (one pass forward: probe, touch, gather, count; one pass backward: finite check and
SGD on the forward's slots) equals the pure-torch reference bit for bit, whatever the thread count."""

from collections import Counter

import pytest
import torch

from slipcache import _native
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig, SparseFeatures
from slipcache.errors import InvalidInputError

pytestmark = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")

SIZES = [50, 300, 1000]
DIM = 8


def batches(count: int, batch: int = 96) -> list[torch.Tensor]:
    """Skewed ids (many duplicates in a batch) over rows far more than the cache holds."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        columns = [(torch.rand(batch, generator=g) ** 3 * n).long() for n in SIZES]
        out.append(torch.stack(columns, dim=1))
    return out


def make(precision: str, policy: str = "lru") -> CachedEmbeddingBagCollection:
    # 48 slots in 4-way sets for 1350 rows: misses, evictions and overflow rows in every step.
    config = EmbeddingConfig(SIZES, dim=DIM, precision=precision, cache_rows=48, ways=4, policy=policy, lr=0.3, seed=1)
    return CachedEmbeddingBagCollection(config)


def train(coll: CachedEmbeddingBagCollection, inputs: list, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outputs = []
    for ids in inputs:
        out = coll(ids)
        out.backward(torch.randn(out.shape, generator=g))
        outputs.append(out.detach().clone())
    return outputs


def state(coll: CachedEmbeddingBagCollection) -> dict:
    return {k: v.clone() for k, v in coll.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_same(a: CachedEmbeddingBagCollection, b: CachedEmbeddingBagCollection) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert a.stats() == b.stats()


def spy(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count the calls of the fused compiled loops (they must run, or the comparison proves nothing)."""
    calls: Counter = Counter()
    for name in ("lookup_gather", "sgd_update_finite"):
        original = getattr(_native, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(_native, name, counted)
    return calls


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_fused_step_equals_the_torch_reference(precision: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = batches(6)
    fused = make(precision, policy)
    calls = spy(monkeypatch)
    fused_out = train(fused, inputs)
    assert calls["lookup_gather"] == len(inputs) and calls["sgd_update_finite"] == len(inputs)
    stats = fused.stats()
    assert stats["evictions"] > 0 and stats["overflow_rows"] > 0 and stats["hits"] > 0  # every case occurs
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = make(precision, policy)
    reference_out = train(reference, inputs)
    for a, b in zip(fused_out, reference_out, strict=True):
        assert torch.equal(a, b)
    assert_same(fused, reference)


def test_fused_backward_of_multi_hot_bags_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(4)
    inputs = []
    for _ in range(4):
        lengths = torch.randint(0, 4, (len(SIZES), 32), generator=g)
        values = torch.cat([(torch.rand(int(n), generator=g) ** 3 * SIZES[t]).long()
                            for t, row in enumerate(lengths) for n in row])
        inputs.append(SparseFeatures.from_lengths(values, lengths))
    fused = make("fp32")
    calls = spy(monkeypatch)
    fused_out = train(fused, inputs)
    assert calls["sgd_update_finite"] == len(inputs)
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = make("fp32")
    for a, b in zip(fused_out, train(reference, inputs), strict=True):
        assert torch.equal(a, b)
    assert_same(fused, reference)


def test_a_nonfinite_gradient_leaves_every_row_unchanged() -> None:
    coll = make("int8")
    train(coll, batches(3))
    out = coll(batches(4)[3])
    assert coll.stats()["overflow_rows"] > 0  # the step serves rows from storage as well as from the cache
    before = state(coll)
    grad = torch.ones(out.shape)
    grad[-1, -1, -1] = float("nan")
    out.backward(grad)
    after = state(coll)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert coll.skipped_updates == 1


def test_the_fused_forward_refuses_an_id_outside_its_table() -> None:
    coll = make("fp32")
    ids = batches(1)[0]
    ids[5, 1] = SIZES[1]
    with pytest.raises(InvalidInputError, match=r"table 1 \(size 300\): id 300 is outside"):
        coll(ids)
    ids[5, 1] = -1
    with pytest.raises(InvalidInputError, match=r"id -1 is outside"):
        coll(ids)


def test_the_compiled_gather_checks_its_tensors() -> None:
    coll = make("fp32")
    cache, rows = coll.cache, torch.arange(6)
    args = (cache.slot_rows, cache.num_sets, cache.ways, cache.multiplier)
    with pytest.raises(ValueError, match="out must be"):
        _native.lookup_gather(*args, rows, 3, cache.last_used, None, 1, cache.weights, torch.empty(6, DIM + 1),
                              coll.counters, (0, 1, 2))
    with pytest.raises(ValueError, match="not whole rows of 4 tables"):
        _native.lookup_gather(*args, rows, 4, cache.last_used, None, 1, cache.weights, torch.empty(6, DIM),
                              coll.counters, (0, 1, 2))
    with pytest.raises(ValueError, match="counter columns"):
        _native.lookup_gather(*args, rows, 3, cache.last_used, None, 1, cache.weights, torch.empty(6, DIM),
                              coll.counters, (0, 1, 99))
    with pytest.raises(ValueError, match="slot 48 is outside"):
        _native.sgd_update_finite(cache.weights, torch.tensor([-1, 48]), torch.zeros(2, DIM), 0.1)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("num_rows", [3000, 2**31 + 10])  # int32 and int64 slot maps
def test_compiled_assign_equals_the_torch_assign(policy: str, num_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty, pinned and evictable ways mixed in one set, more missing rows than a set can take."""
    from slipcache.embedding.cache import RowCache

    g = torch.Generator().manual_seed(7)
    cache = RowCache(64, 2, policy, num_rows, ways=8, lfu_halving_interval=0)
    resident = torch.randperm(3000, generator=g)[:200]
    first = cache.assign(resident, pin_since=1)
    fits = first.slots >= 0
    cache.install(first.slots[fits], resident[fits], torch.zeros(int(fits.sum()), 2), 1, torch.ones(int(fits.sum())))
    cache.last_used.copy_(torch.randint(0, 10, cache.last_used.shape, generator=g, dtype=torch.int32))
    if policy == "lfu":
        cache.use_count.copy_(torch.randint(0, 4, cache.use_count.shape, generator=g, dtype=torch.int32))
    cache.evict(torch.randperm(64, generator=g)[:10])  # a few empty ways
    missing = torch.randperm(3000, generator=g)[:150] + 5000  # rows never resident
    compiled = cache.assign(missing, pin_since=7)
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = cache.assign(missing, pin_since=7)
    assert (compiled.slots >= 0).any() and (compiled.slots < 0).any() and compiled.victim_slots.numel()
    for a, b in zip(compiled.__dict__.values(), reference.__dict__.values(), strict=True):
        assert torch.equal(a, b)


def test_step_buffers_are_reused_only_once_nothing_holds_them() -> None:
    coll = make("fp32")
    first, second, third = batches(3)
    g = torch.Generator().manual_seed(0)
    out = coll(first)
    out.backward(torch.randn(out.shape, generator=g))
    address = out.data_ptr()
    del out
    kept = coll(second)  # the first step's output buffer, now free, is written again
    assert kept.data_ptr() == address
    kept.backward(torch.randn(kept.shape, generator=g))
    copy = kept.detach().clone()
    later = coll(third)  # the caller still holds `kept`: a new buffer, `kept` untouched
    assert later.data_ptr() != kept.data_ptr() and torch.equal(kept, copy)
    plan_rows = coll.scratch.buffers["rows"]
    coll(first)  # a second forward before the first's backward: its plan keeps its rows
    assert coll.scratch.buffers["rows"] is not plan_rows


def test_compiled_finite_check() -> None:
    values = torch.zeros(40_000)
    assert _native.all_finite(values)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 20_000, 39_999):
            poisoned = values.clone()
            poisoned[where] = bad
            assert not _native.all_finite(poisoned)
    assert _native.all_finite(torch.tensor([torch.finfo(torch.float32).max, -1e-45]))


def test_a_nonfinite_gradient_skips_the_general_update_too() -> None:
    """Adagrad takes the general path: its check is the compiled one."""
    config = EmbeddingConfig(SIZES, dim=DIM, precision="int8", cache_rows=48, ways=4, optimizer="adagrad", seed=1)
    coll = CachedEmbeddingBagCollection(config)
    out = coll(batches(1)[0])
    before = state(coll)
    grad = torch.zeros(out.shape)
    grad[3, 2, 1] = float("inf")
    out.backward(grad)
    after = state(coll)
    assert all(torch.equal(before[k], after[k]) for k in before) and coll.skipped_updates == 1


@pytest.mark.parametrize(
    ("precision", "rounding"), [("fp32", "stochastic"), ("int8", "nearest"), ("int8", "stochastic")]
)
def test_no_cache_equals_the_torch_reference(precision: str, rounding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cache, distinct rows found by hashing (fp32, nearest rounding) or sorting: the same training."""
    def build() -> CachedEmbeddingBagCollection:
        config = EmbeddingConfig(SIZES, dim=DIM, precision=precision, cache_size=0.0, rounding=rounding, lr=0.3, seed=1)
        return CachedEmbeddingBagCollection(config)

    inputs = batches(4)
    calls: Counter = Counter()
    original = _native.unique_rows

    def counted(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls["unique_rows"] += 1
        return original(rows)

    monkeypatch.setattr(_native, "unique_rows", counted)
    summed = _native.sum_rows_finite

    def counted_sums(*args: torch.Tensor) -> torch.Tensor | None:
        calls["sum_rows_finite"] += 1
        return summed(*args)

    monkeypatch.setattr(_native, "sum_rows_finite", counted_sums)
    hashed = build()
    hashed_out = train(hashed, inputs)
    assert calls["unique_rows"] == (0 if rounding == "stochastic" and precision != "fp32" else len(inputs))
    assert calls["sum_rows_finite"] == len(inputs)  # the one-pass backward of rows served from storage ran
    monkeypatch.setattr(_native, "native", lambda: None)
    reference = build()
    for a, b in zip(hashed_out, train(reference, inputs), strict=True):
        assert torch.equal(a, b)
    assert_same(hashed, reference)
    assert hashed.stats()["rows_in"] < hashed.stats()["lookups"]  # the batches repeat rows


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_gradient_leaves_an_uncached_table_unchanged(bad: float) -> None:
    config = EmbeddingConfig(SIZES, dim=DIM, precision="int8", cache_size=0.0, lr=0.3, seed=1)
    coll = CachedEmbeddingBagCollection(config)
    train(coll, batches(2))
    out = coll(batches(3)[2])
    before = state(coll)
    grad = torch.ones(out.shape)
    grad[-1, -1, -1] = bad
    out.backward(grad)
    after = state(coll)
    assert all(torch.equal(before[k], after[k]) for k in before) and coll.skipped_updates == 1


@pytest.mark.parametrize("loop_threads", [1, 3])
def test_compiled_row_sums_are_index_put_and_check_the_gradient(loop_threads: int) -> None:
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 300, (5000,), generator=g)  # many repeats
    grad = torch.randn(5000, 16, generator=g)
    previous = _native.set_threads(loop_threads)
    try:
        summed = _native.sum_rows_finite(index, grad, 300)
        expected = torch.zeros(300, 16).index_put_((index,), grad, accumulate=True)
        assert summed is not None and torch.equal(summed, expected)
        for where in (0, 2500, 4999):
            poisoned = grad.clone()
            poisoned[where, 3] = float("nan")
            assert _native.sum_rows_finite(index, poisoned, 300) is None
        with pytest.raises(ValueError, match="outside"):
            _native.sum_rows_finite(index, grad, 299 if int(index.max()) == 299 else int(index.max()))
    finally:
        _native.set_threads(previous)


def test_unique_rows_in_order_of_first_occurrence() -> None:
    rows = torch.tensor([7, 3, 7, 2**40, 3, 0, 7])
    unique, inverse = _native.unique_rows(rows)
    assert unique.tolist() == [7, 3, 2**40, 0] and torch.equal(unique[inverse], rows)
    empty, none = _native.unique_rows(torch.empty(0, dtype=torch.int64))
    assert empty.numel() == 0 and none.numel() == 0


@pytest.mark.parametrize("n", [0, 1, 7, 5000])
def test_sorted_unique_is_torch_unique_of_the_taken_rows(n: int) -> None:
    """The compiled distinct rows, sorted: torch.unique's tensors, of every row or of the missed lookups only,
    negative and 64-bit rows too (the radix sort orders signed keys and skips the bytes they share)."""
    g = torch.Generator().manual_seed(n)
    for rows in (
        torch.randint(0, 40, (n,), generator=g),
        torch.randint(-(2**62), 2**62, (n,), generator=g),
        torch.randint(0, 2**40, (n,), generator=g) * 256,  # the low byte shared by all
    ):
        slots = torch.randint(-1, 2, (n,), generator=g)
        found = _native.sorted_unique(rows)
        assert found is not None and found[0] is None
        for have, want in zip(found[1:], torch.unique(rows, return_inverse=True, return_counts=True), strict=True):
            assert torch.equal(have, want)
        found = _native.sorted_unique(rows, slots)
        assert found is not None
        positions = torch.nonzero(slots < 0).squeeze(1)
        assert found[0] is not None and torch.equal(found[0], positions)
        expected = torch.unique(rows[positions], return_inverse=True, return_counts=True)
        for have, want in zip(found[1:], expected, strict=True):
            assert torch.equal(have, want)
    with pytest.raises(ValueError, match="slots"):
        _native.sorted_unique(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


def test_fill_misses_is_the_indexed_copies_and_checks_first() -> None:
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(50, 8, generator=g)
    slots = torch.full((40,), 7, dtype=torch.int64)
    positions = torch.tensor([1, 4, 5, 9, 30, 39])
    inverse = torch.tensor([0, 1, 0, 2, 3, 1])
    assigned = torch.tensor([12, -1, 49, 0])
    out = torch.zeros(40, 8)
    expected_slots, expected_out = slots.clone(), out.clone()
    expected_slots[positions] = assigned[inverse]
    cached = positions[assigned[inverse] >= 0]
    expected_out[cached] = weights[expected_slots[cached]]
    _native.fill_misses(positions, inverse, assigned, slots, weights, out)
    assert torch.equal(slots, expected_slots) and torch.equal(out, expected_out)
    before = slots.clone(), out.clone()
    for bad in (
        (torch.tensor([1, 40]), torch.tensor([0, 1]), assigned),  # a position beyond the lookups
        (torch.tensor([1, 2]), torch.tensor([0, 4]), assigned),  # a row beyond the distinct rows
        (torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([3, 50])),  # a slot beyond the cache
        (torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([3, -2])),
    ):
        with pytest.raises(ValueError, match="out of range"):
            _native.fill_misses(*bad, slots, weights, out)
        assert torch.equal(slots, before[0]) and torch.equal(out, before[1])  # nothing written
