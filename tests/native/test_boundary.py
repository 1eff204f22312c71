"""The C boundary: every compiled entry point refuses what it cannot read safely (wrong dtype, layout or
length, an index out of range, a repeat where rows must be distinct) with a clear error and nothing written,
and every one is called by a test that the sanitizer run (.ci/run) runs."""

import ast
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from slipcache import _native
from slipcache._native import build
from slipcache._native import filter as native_filter
from slipcache.embedding.cache import RowCache
from slipcache.errors import InvalidInputError
from slipcache.staleness.hotset import HotIndex

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "src" / "slipcache" / "_native"
compiled = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")


def hot_counts_numpy(ids: np.ndarray, offsets: np.ndarray, flags: np.ndarray, index: HotIndex, size: int) -> np.ndarray:
    rows = (ids.astype(np.int64) + offsets[:-1]).reshape(-1)
    found = index.find(rows[flags[rows] != 0])
    return np.bincount(found[found >= 0], minlength=size)


@compiled
def test_hot_update_counting_matches_numpy_and_a_one_key_index_works() -> None:
    rng = np.random.default_rng(0)
    offsets = np.array([0, 50, 53, 453])
    ids = np.stack([rng.integers(0, s, 2000) for s in np.diff(offsets)], axis=1).astype(np.int32)
    hot = np.sort(rng.choice(453, 60, replace=False))
    flags = np.zeros(453, np.uint8)
    flags[hot] = 1
    index = HotIndex(hot)
    counts = np.zeros(hot.size, np.int64)
    counted = native_filter.count_hot_updates(ids, offsets, flags, index.keys, index.values, counts)
    assert counted == counts.sum() > 0
    assert np.array_equal(counts, hot_counts_numpy(ids, offsets, flags, index, hot.size))
    # An index of one slot: the hash takes no bits (in C a shift by 64 would be undefined).
    row = 51  # table 1, id 1
    one = np.zeros(1, np.int64)
    keys, values = np.array([row], np.int64), np.zeros(1, np.int32)
    assert native_filter.count_hot_updates(ids, offsets, flags | (np.arange(453) == row), keys, values, one) == one[0]
    assert one[0] == np.count_nonzero(ids[:, 1] == 1) > 0
    full = np.array([10_000], np.int64)  # a full table without any row: each probe ends after every slot
    assert native_filter.count_hot_updates(ids, offsets, np.ones(453, np.uint8), full, values, one) == 0


@compiled
def test_hot_update_counting_refuses_bad_arrays_and_leaves_counts_as_they_were() -> None:
    offsets = np.array([0, 5, 10])
    ids = np.array([[1, 2], [3, 4]], np.int32)
    flags = np.ones(10, np.uint8)
    index = HotIndex(np.arange(10))
    counts = np.full(10, 7, np.int64)

    def count(**changed: object) -> int:
        arrays = dict(ids=ids, offsets=offsets, flags=flags, keys=index.keys, values=index.values, counts=counts)
        return native_filter.count_hot_updates(**{**arrays, **changed})

    assert count() == 4 and counts.sum() == 74
    counts[:] = 7
    with pytest.raises(InvalidInputError, match="id 5 of table 1 is out of range"):
        count(ids=np.array([[1, 2], [3, 5]], np.int32))  # the last id: the ones before were not counted
    with pytest.raises(InvalidInputError, match="id -1 of table 0"):
        count(ids=np.array([[-1, 0]], np.int32))
    short = np.zeros(5, np.int64)  # positions 5..9 have no counter: refused, the ones counted taken back
    with pytest.raises(ValueError, match=r"position outside \[0, 5\)"):
        count(counts=short, ids=np.array([[1, 0], [2, 3]], np.int32))
    assert not short.any()
    bad = {
        "flags": [np.ones(20, np.uint8)[::2], np.ones(10, bool), np.ones(9, np.uint8)],
        "ids": [np.asfortranarray(np.zeros((3, 2), np.int32)), np.zeros((2, 2), np.int64), np.zeros(2, np.int32)],
        "keys": [index.keys[::2], index.keys.astype(np.int32), index.keys[:-1]],
        "values": [index.values[::2], index.values.astype(np.int64), index.values[:-1]],
        "counts": [np.zeros(20, np.int64)[::2], np.zeros(10, np.int32)],
        "offsets": [np.array([0, 5]), np.array([-1, 5, 10]), np.array([0, 6, 5]), np.array([0, 5, 11])],
    }
    for name, arrays in bad.items():
        for array in arrays:
            with pytest.raises(ValueError, match="compiled loop"):
                count(**{name: array})
    assert (counts == 7).all()  # nothing written by any refusal


@compiled
def test_the_input_filters_refuse_offsets_outside_the_flags() -> None:
    ids, flags = np.zeros((4, 2), np.int32), np.full(10, 3, np.uint8)
    stale, hot = native_filter.classify_inputs(ids, np.array([0, 5, 10]), flags, 2)
    assert stale.all() and hot.all()
    keep, control, *counts = native_filter.filter_inputs(ids, np.array([0, 5, 10]), flags, 2, True, 0.0, 0, 0)
    assert not keep.any() and not control.any() and counts == [4, 4, 0]
    assert native_filter.classify_inputs(ids + 5, np.array([0, 5, 10]), flags, 2) is None  # id 5 of 5 rows
    for offsets in (np.array([-5, 0, 5]), np.array([0, 8, 4]), np.array([0, 5, 11]), np.array([0, 10])):
        with pytest.raises(ValueError, match="offsets"):
            native_filter.classify_inputs(ids, offsets, flags, 2)
        with pytest.raises(ValueError, match="offsets"):
            native_filter.filter_inputs(ids, offsets, flags, 2, True, 0.0, 0, 0)


@compiled
def test_adagrad_refuses_repeated_slots_or_state_rows_and_writes_nothing() -> None:
    weights, state, grad = torch.ones(8, 4), torch.zeros(8), torch.ones(3, 4)
    before = weights.clone(), state.clone()
    with pytest.raises(InvalidInputError, match="slot 5 appears 2 times"):
        _native.adagrad_update(weights, torch.tensor([5, 1, 5]), state, torch.tensor([0, 1, 2]), grad, 0.1, 1e-8)
    with pytest.raises(InvalidInputError, match="state row 2 appears 2 times"):
        _native.adagrad_update(weights, None, state, torch.tensor([2, 1, 2]), grad, 0.1, 1e-8)
    assert torch.equal(weights, before[0]) and torch.equal(state, before[1])
    sparse_weights, sparse_state = torch.ones(5000, 4), torch.zeros(5000)  # few rows of many: a set, not a bit each
    with pytest.raises(InvalidInputError, match="slot 4500 appears 2 times"):
        _native.adagrad_update(sparse_weights, torch.tensor([4500, 2, 4500]), state, torch.tensor([0, 1, 2]), grad, 0.1,
                               1e-8)
    with pytest.raises(InvalidInputError, match="state row 4000 appears 2 times"):
        _native.adagrad_update(weights, None, sparse_state, torch.tensor([4000, 1, 4000]), grad, 0.1, 1e-8)
    assert (sparse_weights == 1).all() and not sparse_state.any() and torch.equal(state, before[1])
    assert _native.adagrad_update(weights, torch.tensor([5, 1, 6]), state, torch.tensor([0, 1, 2]), grad, 0.1, 1e-8)
    assert (state[:3] == 1).all() and (weights[[5, 1, 6]] < 1).all() and torch.equal(weights[0], before[0][0])
    assert _native.adagrad_update(torch.ones(0, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                                  torch.zeros(0, dtype=torch.int64), torch.ones(0, 4), 0.1, 1e-8)  # nothing to do
    many = torch.randperm(5000, generator=torch.Generator().manual_seed(0))  # more than the scratch's first size
    repeated = torch.cat([many, many[:1]])
    with pytest.raises(InvalidInputError, match="appears 2 times"):
        _native.adagrad_update(torch.ones(5000, 2), repeated, torch.zeros(5000), torch.arange(5001) % 5000,
                               torch.ones(5001, 2), 0.1, 1e-8)


@compiled
def test_a_cache_step_beyond_int32_is_refused_not_wrapped() -> None:
    cache = RowCache(64, 4, "lru", 1000, ways=4)
    rows = torch.tensor([3, 141, 592])
    cache.install(cache.assign(rows, pin_since=1).slots, rows, torch.zeros(3, 4), 1, torch.ones(3))
    slots = _native.lookup(cache.slot_rows, cache.num_sets, cache.ways, cache.multiplier, rows, cache.last_used,
                           None, 2**31 - 1)
    assert (slots >= 0).all() and (cache.last_used[slots] == 2**31 - 1).all()
    out, counters = torch.zeros(3, 4), torch.zeros(3, 3, dtype=torch.int64)
    for step in (2**31, -(2**31) - 1):
        with pytest.raises(InvalidInputError, match="outside int32"):
            _native.lookup(cache.slot_rows, cache.num_sets, cache.ways, cache.multiplier, rows, cache.last_used,
                           None, step)
        with pytest.raises(InvalidInputError, match="outside int32"):
            _native.lookup_gather(cache.slot_rows, cache.num_sets, cache.ways, cache.multiplier, rows, 3,
                                  cache.last_used, None, step, cache.weights, out, counters, (0, 1, 2))
    assert (cache.last_used[slots] == 2**31 - 1).all() and not counters.any()


@compiled
def test_global_rows_and_slot_assignment_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    offsets = torch.tensor([0, 10, 15])
    ids = torch.tensor([[1, 4], [9, 0]])
    rows, bad = _native.global_rows(ids, offsets)
    assert rows.tolist() == [1, 14, 9, 10] and bad == -1
    assert _native.global_rows(torch.tensor([[1, 4], [9, 5]]), offsets)[1] == 3  # id 5 of a 5-row table
    cache = RowCache(32, 4, "lru", 1000, ways=4)
    resident = torch.arange(100, 140)
    placed = cache.assign(resident, pin_since=1).slots
    cache.install(placed[placed >= 0], resident[placed >= 0], torch.zeros(int((placed >= 0).sum()), 4), 1,
                  torch.ones(int((placed >= 0).sum())))
    missing = torch.arange(200, 260)
    compiled_result = _native.assign_slots(cache.slot_rows, cache.num_sets, cache.ways, cache.multiplier,
                                           cache.last_used, None, 2, missing)
    monkeypatch.setattr(_native, "native", lambda: None)
    expected = cache.assign(missing, pin_since=2)
    assert torch.equal(compiled_result[0], expected.slots)
    assert torch.equal(compiled_result[1], expected.victim_slots)
    assert torch.equal(compiled_result[2], expected.victim_rows)
    assert compiled_result[1].numel() > 0 and (compiled_result[0] >= 0).any()  # victims and placements both occur


@compiled
def test_the_backward_reuses_its_scratch_and_a_thread_frees_its_own() -> None:
    weights = torch.zeros(4096, 8)
    slots = torch.randint(0, 4096, (20_000,), generator=torch.Generator().manual_seed(0))
    grad = torch.ones(20_000, 8)
    previous = _native.set_threads(2)
    try:
        _native.sgd_update(weights, slots, grad, 1.0)
        held = _native.scratch_bytes()
        assert held >= 2 * 20_000 * 8  # the position lists: a part's per lookup
        for _ in range(3):
            _native.sgd_update(weights, slots, grad, 1.0)
        assert _native.scratch_bytes() <= held  # reused, not allocated again (another thread's may have gone)
        expected = torch.zeros(4096, 8).index_add_(0, slots, -4 * grad)
        assert torch.equal(weights, expected)
        worker = threading.Thread(target=_native.sgd_update, args=(weights, slots, grad, 1.0))
        worker.start()
        worker.join()
        for _ in range(1000):  # the buffer goes as the thread ends, just after join() returns
            if _native.scratch_bytes() <= held:
                break
            time.sleep(0.01)
        assert _native.scratch_bytes() <= held  # the thread's own buffer went with it
    finally:
        _native.set_threads(previous)


# ------------------------------------------------------------------ every entry point in the sanitizer run


def sanitized_test_files() -> list[Path]:
    """The test files .ci/run runs against the sanitizer build (after SLIPCACHE_NATIVE_SANITIZE=1)."""
    script = (ROOT / ".ci" / "run").read_text()
    sanitized = script[script.index("SLIPCACHE_NATIVE_SANITIZE=1"):]
    return [ROOT / name for name in re.findall(r"tests/[\w/]+\.py", sanitized)]


def exported_entry_points() -> set[str]:
    """Every function the C files export (not static, not declared internal in the shared header)."""
    internal = set(re.findall(r"SLIPCACHE_INTERNAL [\w ]+?\*?(\w+)\(", (NATIVE / build.HEADER).read_text()))
    names: set[str] = set()
    for name in build.SOURCES:
        text = (NATIVE / name).read_text()
        names.update(re.findall(r"^(?:ROW_LOOPS )?(?:int64_t|int|void) \*?(\w+)\(", text, flags=re.MULTILINE))
    return names - internal


def wrappers() -> dict[str, set[str]]:
    """Per entry point, the functions of the Python wrappers that reach it (directly or through each other;
    build.py only declares the signatures)."""
    calls: dict[str, set[str]] = {}
    for path in sorted(set(NATIVE.glob("*.py")) - {NATIVE / "build.py"}):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                calls[node.name] = {
                    n.attr if isinstance(n, ast.Attribute) else n.id
                    for n in ast.walk(node) if isinstance(n, ast.Attribute | ast.Name)
                }
    reach = {name: {name} for name in calls}
    changed = True
    while changed:
        changed = False
        for name, used in calls.items():
            for callee in used & set(calls):
                if not reach[callee] <= reach[name]:
                    reach[name] |= reach[callee]
                    changed = True
    found: dict[str, set[str]] = {}
    for name in calls:
        for entry in set().union(*(calls[f] for f in reach[name])):
            found.setdefault(entry, set()).add(name)
    return found


def test_every_compiled_entry_point_is_declared_and_called_in_the_sanitizer_run() -> None:
    exported = exported_entry_points()
    declared = set(re.findall(r"library\.(\w+)\.argtypes", (NATIVE / "build.py").read_text()))
    assert exported == declared, "each exported C function gets a ctypes signature in build._declare"
    files = sanitized_test_files()
    assert files and all(path.exists() for path in files)
    texts = "\n".join(path.read_text() for path in files)
    reached = wrappers()
    missing = []
    for entry in sorted(exported):
        callers = reached.get(entry, set()) - {"usable", "_check"}
        called = re.search(rf"\.{entry}\(", texts) or any(
            re.search(rf"\b(?:_native|native_filter|quantize)\.{name}\(", texts) for name in callers
        )
        if not called:
            missing.append(entry)
    assert missing == [], "no test in the sanitizer run (.ci/run) calls these; add one, or add its file there"
