"""Tests for Slipstream stale-input skipping: hot rows, snapshots, threshold search, alpha, rolling, guard."""

from __future__ import annotations

import io
import json
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipcache.errors import InvalidInputError
from slipcache.staleness.config import GuardConfig
from slipcache.staleness.config import StalenessConfig as _StalenessConfig
from slipcache.staleness.detector import StaleInputDetector
from slipcache.staleness.guard import SkipGuard
from slipcache.staleness.hotset import HotIndex


def StalenessConfig(**kw: object) -> _StalenessConfig:  # noqa: N802 - stands in for the class below
    """The detector's config with the paper's rule and every update counted unless a test says otherwise."""
    return _StalenessConfig(**{"rule": "paper", "count_share": 1.0, **kw})


class FakeCollection:
    """The collection interface the detector uses, backed by a tensor the test mutates."""

    def __init__(self, table_sizes: list[int], dim: int = 4, seed: int = 0) -> None:
        self.table_sizes = table_sizes
        self.dim = dim
        self.table_offsets = torch.tensor([0, *np.cumsum(table_sizes)], dtype=torch.int64)
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(int(sum(table_sizes)), dim, generator=gen)
        self.reads: list[int] = []

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        self.reads.append(int(rows.numel()))
        return self.weight[rows]

    def move(self, rows: np.ndarray, amount: float) -> None:
        """Shift one coordinate of each row by ``amount`` (its L-infinity change)."""
        self.weight[torch.as_tensor(rows, dtype=torch.int64), 0] += amount


def all_rows_inputs(table_sizes: list[int]) -> np.ndarray:
    """Inputs that touch every row of every table (row i of each table in input i)."""
    n = max(table_sizes)
    return np.stack([np.arange(n) % size for size in table_sizes], axis=1).astype(np.int32)


def make(config: StalenessConfig, coll: FakeCollection) -> StaleInputDetector:
    return StaleInputDetector.from_collection(coll, config)


def frozen_and_moving(config: StalenessConfig | None = None):
    """3 tables x 10 rows; ids 0-4 of each table are frozen, ids 5-9 move by 0.2 during the window."""
    coll = FakeCollection([10, 10, 10])
    det = make(config or StalenessConfig(tolerance=1.0), coll)
    det.profile(all_rows_inputs(coll.table_sizes))
    det.begin_window(coll)
    moving = np.array([o + i for o in (0, 10, 20) for i in range(5, 10)])
    coll.move(moving, 0.2)
    det.end_window(coll)
    frozen = np.setdiff1d(np.arange(30), moving)
    return coll, det, frozen, moving


# ---- hot set ---------------------------------------------------------------------------------------------


def test_hot_set_respects_budget_and_keeps_most_accessed():
    coll = FakeCollection([50, 50], dim=8)
    rng = np.random.default_rng(1)
    # Table 0: id i appears (50 - i) times; table 1: uniform noise with few repeats.
    col0 = np.repeat(np.arange(50), np.arange(50, 0, -1))
    sample = np.stack([col0, rng.integers(0, 50, col0.size)], axis=1).astype(np.int32)
    budget = 20 * 8 * 4 + 31  # room for 20 rows, not 21
    det = make(StalenessConfig(memory_budget_bytes=budget), coll)
    hot = det.profile(sample)

    assert len(hot) == 20 and len(hot) * coll.dim * 4 <= budget
    assert np.all(np.diff(hot.rows) > 0)
    uniq, counts = np.unique(sample + coll.table_offsets[:-1].numpy(), return_counts=True)
    threshold_count = np.sort(counts)[::-1][19]
    assert hot.counts.min() >= threshold_count
    assert set(uniq[counts > threshold_count]) <= set(hot.rows.tolist())
    assert det.stats()["hot_bytes"] <= budget


def test_zero_budget_gives_empty_hot_set_and_no_hot_inputs():
    coll = FakeCollection([5, 5])
    det = make(StalenessConfig(memory_budget_bytes=0), coll)
    assert len(det.profile(all_rows_inputs([5, 5]))) == 0
    assert not det.hot_input_mask(all_rows_inputs([5, 5])).any()


def test_hot_input_mask_requires_every_lookup_hot():
    coll = FakeCollection([4, 4], dim=1)
    det = make(StalenessConfig(memory_budget_bytes=3 * 4), coll)  # three rows fit
    det.profile(np.array([[0, 0], [0, 0], [0, 1], [1, 2]], dtype=np.int32))  # rows 0: 3, 4: 2, 1/5/6: 1
    assert det.hot.rows.tolist() == [0, 1, 4]  # counts 3, 1, 2 -> ties on 1 go to the lower row
    mask = det.hot_input_mask(np.array([[0, 0], [1, 0], [0, 1], [2, 0]]))
    assert mask.tolist() == [True, True, False, False]


def test_alpha_below_one_makes_inputs_with_enough_hot_lookups_hot_and_skippable():
    """alpha = 0.5 of 4 lookups: inputs with 2 hot (and, once fitted, 2 stale) lookups qualify."""
    coll = FakeCollection([3, 3, 3, 3], dim=1)
    det = make(StalenessConfig(alpha=0.5, tolerance=1.0), coll)
    det.profile(np.array([[0, 0, 0, 0], [1, 1, 1, 1]], dtype=np.int32))  # ids 0 and 1 of every table are hot
    inputs = np.array([[0, 1, 2, 2], [0, 2, 2, 2], [2, 2, 2, 2], [1, 1, 1, 2]], dtype=np.int32)
    assert det.hot_input_mask(inputs).tolist() == [True, False, False, True]
    det.begin_window(coll)
    coll.move(np.array([1, 4, 7, 10]), 0.5)  # id 1 moves in every table, id 0 stays
    det.end_window(coll)
    det.fit_threshold(inputs)
    assert det.stale_rows().tolist() == [0, 3, 6, 9]
    assert det.stale_counts(inputs).tolist() == [1, 1, 0, 0]
    keep = det.count(np.array([[0, 0, 2, 2], [0, 1, 2, 2]], dtype=np.int32))
    assert keep.tolist() == [False, True]
    assert det.stats()["hot_inputs_seen"] == 2


# ---- snapshots and staleness -----------------------------------------------------------------------------


def test_frozen_rows_are_stale_and_moving_rows_are_not():
    coll, det, frozen, moving = frozen_and_moving()
    change = det.row_change().numpy()
    assert np.allclose(change[frozen], 0.0) and np.allclose(change[moving], 0.2)
    result = det.fit_threshold(all_rows_inputs(coll.table_sizes))
    assert result.converged and result.threshold is not None
    assert det.stale_rows().tolist() == frozen.tolist()
    assert det.is_stale_row(moving).sum() == 0 and det.is_stale_row(frozen).all()
    batch = np.array([[0, 1, 2], [5, 6, 7], [0, 1, 9]])
    assert det.stale_mask(batch).tolist() == [True, False, False]
    assert det.stale_mask(torch.as_tensor(batch)).tolist() == [True, False, False]


def test_rows_outside_the_hot_set_are_never_stale():
    coll = FakeCollection([10])
    det = make(StalenessConfig(tolerance=1.0, memory_budget_bytes=5 * coll.dim * 4), coll)
    det.profile(np.array([0, 1, 2, 3, 4] * 3 + [5, 6, 7, 8, 9], dtype=np.int32)[:, None])
    det.begin_window(coll)
    det.end_window(coll)  # nothing moved: every hot row is stale
    det.fit_threshold(np.arange(10, dtype=np.int32)[:, None])
    assert det.stale_rows().tolist() == [0, 1, 2, 3, 4]
    assert not det.is_stale_row(np.arange(5, 10)).any()
    assert det.stale_mask(np.arange(10)[:, None]).tolist() == [True] * 5 + [False] * 5


def test_snapshots_read_only_hot_rows():
    coll = FakeCollection([100, 100])
    det = make(StalenessConfig(memory_budget_bytes=7 * coll.dim * 4), coll)
    det.profile(np.array([[1, 2]] * 5 + [[3, 4]] * 4 + [[5, 6]] * 3 + [[7, 8]] * 2, dtype=np.int32))
    det.begin_window(coll)
    det.end_window(coll)
    assert coll.reads == [7, 7]


def test_nothing_is_skipped_before_a_threshold_exists():
    coll, det, frozen, _ = frozen_and_moving()
    batch = all_rows_inputs(coll.table_sizes)
    assert det.threshold is None and not det.skipping
    assert not det.stale_mask(batch).any() and det.stale_rows().size == 0
    assert det.sample_filter()(batch).all()


# ---- threshold search ------------------------------------------------------------------------------------


def uniform_change_detector(n: int = 1000, tolerance: float = 0.01, **kw) -> tuple[StaleInputDetector, np.ndarray]:
    """One table whose row r moves by 0.1 * r / n, so the stale fraction under T is about 10 T."""
    coll = FakeCollection([n], dim=2)
    det = make(StalenessConfig(tolerance=tolerance, **kw), coll)
    sample = np.arange(n, dtype=np.int32)[:, None]
    det.profile(sample)
    det.begin_window(coll)
    coll.weight[:, 1] += torch.arange(n, dtype=torch.float32) * (0.1 / n)
    det.end_window(coll)
    return det, sample


def test_bisection_reaches_target_ratio():
    det, sample = uniform_change_detector(tolerance=0.005)
    result = det.fit_threshold(sample)
    assert result.converged and 1 <= result.steps <= 25
    assert abs(result.achieved_ratio - 0.3) <= 0.005
    assert result.threshold == pytest.approx(0.03, abs=0.001)
    assert det.stale_mask(sample).mean() == pytest.approx(result.achieved_ratio)
    assert det.stats()["threshold"] == result.threshold


def test_bisection_uses_only_hot_inputs_of_the_sample():
    det, sample = uniform_change_detector(memory_budget_bytes=999 * 2 * 4)  # row 999 is not hot
    cold = np.full((5000, 1), 999, dtype=np.int32)
    result = det.fit_threshold(np.concatenate([sample, cold]))
    assert result.sample_size == 999 and result.converged
    assert abs(result.achieved_ratio - 0.3) <= 0.01


def test_bisection_gives_up_when_all_inputs_change_alike():
    coll = FakeCollection([20, 20])
    det = make(StalenessConfig(), coll)
    sample = all_rows_inputs(coll.table_sizes)
    det.profile(sample)
    coll.weight.zero_()
    det.begin_window(coll)
    coll.weight += 0.03125  # every row changes by exactly the same amount (exact in float32)
    det.end_window(coll)
    result = det.fit_threshold(sample)
    assert not result.converged and result.threshold is None
    assert result.steps == 25 and result.achieved_ratio in (0.0, 1.0) and result.reason
    assert not det.skipping and det.stale_rows().size == 0
    assert det.sample_filter()(sample).all()
    assert det.stats()["threshold_converged"] is False


def test_bisection_gives_up_early_when_even_the_top_threshold_is_too_small():
    coll = FakeCollection([20])
    det = make(StalenessConfig(), coll)
    sample = np.arange(20, dtype=np.int32)[:, None]
    det.profile(sample)
    det.begin_window(coll)
    coll.weight += 0.5
    det.end_window(coll)
    result = det.fit_threshold(sample)
    assert not result.converged and result.steps == 0 and result.threshold is None


def test_fit_threshold_requires_snapshots():
    coll = FakeCollection([5])
    det = make(StalenessConfig(), coll)
    det.profile(np.arange(5, dtype=np.int32)[:, None])
    with pytest.raises(InvalidInputError):
        det.fit_threshold(np.arange(5, dtype=np.int32)[:, None])


# ---- alpha -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "alpha_count", "expected"),
    [
        (1.0, None, [False, False, False, False, True]),
        (0.5, None, [False, False, True, True, True]),
        (0.25, None, [False, True, True, True, True]),
        (0.3, None, [False, False, True, True, True]),  # ceil(0.3 * 4) = 2
        (1.0, 3, [False, False, False, True, True]),
    ],
)
def test_alpha_semantics(alpha, alpha_count, expected):
    coll = FakeCollection([10, 10, 10, 10])
    det = make(StalenessConfig(tolerance=1.0, alpha=alpha, alpha_count=alpha_count), coll)
    det.profile(all_rows_inputs(coll.table_sizes))
    det.begin_window(coll)
    coll.move(np.array([o + i for o in (0, 10, 20, 30) for i in range(5, 10)]), 0.2)  # ids >= 5 move
    det.end_window(coll)
    det.fit_threshold(all_rows_inputs(coll.table_sizes))
    # Input k has k stale lookups (id 0) and 4 - k moving ones (id 9).
    batch = np.array([[0] * k + [9] * (4 - k) for k in range(5)])
    assert det.stale_counts(batch).tolist() == [0, 1, 2, 3, 4]
    assert det.stale_mask(batch).tolist() == expected


def test_alpha_validation():
    assert StalenessConfig().required_stale(26) == 26
    assert StalenessConfig(alpha=0.5).required_stale(26) == 13
    assert StalenessConfig(alpha=0.5).required_stale(3) == 2
    assert StalenessConfig(alpha_count=20).required_stale(26) == 20
    with pytest.raises(InvalidInputError):
        StalenessConfig(alpha=26.0)
    with pytest.raises(InvalidInputError):
        StalenessConfig(alpha_count=0)
    with pytest.raises(InvalidInputError):
        StalenessConfig(alpha_count=27).required_stale(26)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_vectorized_mask_matches_a_per_input_loop(data):
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    coll = FakeCollection(sizes, dim=2)
    det = make(StalenessConfig(tolerance=1.0, alpha=data.draw(st.sampled_from([0.25, 0.5, 1.0]))), coll)
    sample = np.stack([data.draw(st.lists(st.integers(0, s - 1), min_size=8, max_size=8)) for s in sizes], 1)
    det.profile(sample)
    det.begin_window(coll)
    moving = data.draw(st.lists(st.integers(0, sum(sizes) - 1), max_size=6))
    coll.move(np.array(moving, dtype=np.int64), 0.2)
    det.end_window(coll)
    det.fit_threshold(sample)
    batch = np.stack([data.draw(st.lists(st.integers(0, s - 1), min_size=5, max_size=5)) for s in sizes], 1)
    stale = set(det.stale_rows().tolist())
    need = det.config.required_stale(len(sizes))
    offsets = coll.table_offsets.numpy()
    naive = [sum(int(offsets[t] + row[t]) in stale for t in range(len(sizes))) >= need for row in batch]
    assert det.stale_mask(batch).tolist() == naive


# ---- rolling re-checks -----------------------------------------------------------------------------------


def test_rolling_recheck_unstales_a_row_that_starts_moving():
    coll, det, frozen, moving = frozen_and_moving(StalenessConfig(tolerance=1.0, recheck_interval=3))
    det.fit_threshold(all_rows_inputs(coll.table_sizes))
    assert det.stale_mask(np.array([[0, 1, 2]])).all()
    woken, settled = frozen[0], moving[0]
    results = []
    for _ in range(3):
        coll.move(np.array([woken]), 0.2)  # row 0 starts moving, the old moving row stops
        results.append(det.after_batch(coll))
    assert results == [False, False, True]
    assert not det.is_stale_row(np.array([woken]))[0]
    assert det.is_stale_row(np.array([settled]))[0]
    assert not det.stale_mask(np.array([[0, 1, 2]])).any()
    assert det.stats()["rechecks"] == 1


def test_recheck_interval_zero_matches_the_window_length():
    coll = FakeCollection([10])
    det = make(StalenessConfig(tolerance=1.0, recheck_interval=0), coll)
    sample = np.arange(10, dtype=np.int32)[:, None]
    det.profile(sample)
    det.begin_window(coll)
    for _ in range(4):
        coll.move(np.arange(5, 10), 0.05)
        assert not det.after_batch(coll)
    det.end_window(coll)
    det.fit_threshold(sample)
    assert det.stats()["window_batches"] == 4
    assert [det.after_batch(coll) for _ in range(8)] == [False, False, False, True] * 2


def test_recheck_disabled():
    coll, det, _, _ = frozen_and_moving(StalenessConfig(tolerance=1.0, recheck_interval=None))
    det.fit_threshold(all_rows_inputs(coll.table_sizes))
    assert not any(det.after_batch(coll) for _ in range(50))


# ---- guard -----------------------------------------------------------------------------------------------


def test_guard_lowers_then_stops_with_patience_and_recovers_with_hysteresis():
    guard = SkipGuard(base_target=0.3, margin=0.05, release=0.5, patience=2, backoff=0.5, min_target=0.05)
    drift = (1.10, 1.0)  # skipped loss 10 % above trained
    assert guard.update(*drift).action == "none"
    d = guard.update(*drift)
    assert (d.action, d.target) == ("lower", pytest.approx(0.15))
    guard.update(*drift)
    assert guard.update(*drift).target == pytest.approx(0.075)
    guard.update(*drift)
    d = guard.update(*drift)
    assert d.action == "stop" and not d.active and d.target == pytest.approx(0.075)
    # Inside the dead band (between 2.5 % and 5 %) nothing changes and streaks reset.
    guard.update(1.0, 1.0)
    assert guard.update(1.04, 1.0).action == "none"
    assert guard.update(1.0, 1.0).action == "none"
    assert guard.update(1.0, 1.0).action == "resume" and guard.active
    guard.update(1.0, 1.0)
    assert guard.update(1.0, 1.0).action == "raise" and guard.target == pytest.approx(0.15)
    for _ in range(4):
        guard.update(0.9, 1.0)
    assert guard.target == pytest.approx(0.3)  # never above the configured target
    with pytest.raises(InvalidInputError):
        guard.update(float("nan"), 1.0)


def guarded(det: StaleInputDetector, guard: SkipGuard, loss: float, reference: float):  # type: ignore[no-untyped-def]
    """What the skipper does with a guard check: the detector takes the guard's target."""
    decision = guard.update(loss, reference)
    det.retarget(decision.target, decision.active)
    return decision


def test_guard_refits_the_threshold_and_stops_skipping():
    det, sample = uniform_change_detector()
    guard = SkipGuard.from_config(GuardConfig(margin=0.01, patience=1), det.target)
    first = det.fit_threshold(sample)
    decision = guarded(det, guard, loss=0.6, reference=0.4)
    assert decision.action == "lower"
    refit = det.threshold_result
    assert refit.target == pytest.approx(0.15) and abs(refit.achieved_ratio - 0.15) <= 0.01
    assert refit.threshold < first.threshold
    assert det.skip_mask(sample).mean() == pytest.approx(refit.achieved_ratio)
    for _ in range(3):
        guarded(det, guard, 0.6, 0.4)
    assert not det.skipping and not det.skip_mask(sample).any()
    assert det.stale_mask(sample).any()  # classification still works for the guard's own evaluation
    assert det.sample_filter()(sample).all()


# ---- filter, stats, determinism, checkpoints -------------------------------------------------------------


def test_sample_filter_keeps_non_stale_inputs_and_counts():
    coll, det, _, _ = frozen_and_moving()
    det.fit_threshold(all_rows_inputs(coll.table_sizes))
    keep = det.sample_filter()
    batch = np.array([[0, 1, 2], [5, 6, 7], [0, 1, 9], [3, 3, 3]], dtype=np.int32)
    assert keep(batch).tolist() == [False, True, True, False]
    s = det.stats()
    assert (s["inputs_seen"], s["hot_inputs_seen"], s["inputs_skipped"]) == (4, 4, 2)
    assert s["skipped_fraction"] == 0.5 and s["hot_skipped_fraction"] == 0.5
    assert s["stale_rows"] == 15 and s["hot_rows"] == 30 and s["skipping"]
    json.dumps(s)  # metrics.jsonl-ready


def test_start_epoch_resets_the_cycle_but_keeps_guard_and_totals():
    coll, det, _, _ = frozen_and_moving(StalenessConfig(tolerance=1.0))
    det.fit_threshold(all_rows_inputs(coll.table_sizes))
    det.sample_filter()(np.array([[0, 1, 2]]))
    guarded(det, SkipGuard.from_config(GuardConfig(patience=1), det.target), 2.0, 1.0)
    det.start_epoch(1)
    s = det.stats()
    assert (s["epoch"], s["hot_rows"], s["threshold"], s["skipping"], s["inputs_seen"]) == (1, 0, None, False, 0)
    assert s["target_drop"] == pytest.approx(0.15) and s["total_inputs_skipped"] == 1
    assert det.sample_filter()(np.array([[0, 1, 2]])).all()


def test_rejects_bad_ids():
    coll, det, _, _ = frozen_and_moving()
    for bad in (np.array([[0, 1, 10]]), np.array([[0, -1, 2]]), np.array([[0, 1]]), np.array([[0.0, 1.0, 2.0]])):
        with pytest.raises(InvalidInputError):
            det.stale_mask(bad)


def run_epoch(seed: int, epoch: int = 3):
    coll = FakeCollection([200, 300, 50], seed=1)
    det = make(StalenessConfig(seed=seed, profile_fraction=0.2, memory_budget_bytes=150 * 16), coll)
    det.start_epoch(epoch)
    rng = np.random.default_rng(0)
    data = np.stack([rng.zipf(1.5, 4000) % s for s in (200, 300, 50)], 1).astype(np.int32)
    det.profile(data[det.sample_indices(len(data), det.config.profile_fraction, "profile")])
    det.begin_window(coll)
    coll.weight += torch.rand(coll.weight.shape, generator=torch.Generator().manual_seed(2)) * 0.1
    det.end_window(coll)
    res = det.fit_threshold(data[det.sample_indices(len(data), 0.5, "threshold")])
    return det, data, res


def test_deterministic_per_seed():
    a, data, res_a = run_epoch(seed=7)
    b, _, res_b = run_epoch(seed=7)
    c, _, _ = run_epoch(seed=8)
    assert np.array_equal(a.hot.rows, b.hot.rows) and res_a == res_b
    assert np.array_equal(a.stale_mask(data), b.stale_mask(data))
    assert not np.array_equal(a.sample_indices(4000, 0.2, "profile"), c.sample_indices(4000, 0.2, "profile"))
    a.start_epoch(4)
    assert not np.array_equal(a.sample_indices(4000, 0.2, "profile"), b.sample_indices(4000, 0.2, "profile"))


def test_state_dict_round_trip():
    coll, det, _, _ = frozen_and_moving(StalenessConfig(tolerance=1.0, recheck_interval=2))
    det.fit_threshold(all_rows_inputs(coll.table_sizes))
    det.after_batch(coll)
    det.retarget(0.2, True)
    det.sample_filter()(np.array([[0, 1, 2], [5, 6, 7]]))
    buf = io.BytesIO()
    torch.save(det.state_dict(), buf)
    buf.seek(0)
    restored = make(StalenessConfig(tolerance=1.0, recheck_interval=2), coll)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.stats() == det.stats()
    assert np.array_equal(restored.stale_rows(), det.stale_rows())
    # Both continue identically: the next batch triggers the same re-check.
    coll.move(np.array([0]), 0.3)
    assert det.after_batch(coll) and restored.after_batch(coll)
    assert torch.equal(restored.row_change(), det.row_change())
    assert restored.stats() == det.stats()

    other = make(StalenessConfig(), FakeCollection([10, 10, 11]))
    with pytest.raises(InvalidInputError):
        other.load_state_dict(det.state_dict())


def test_memory_scales_with_hot_rows_not_with_tables():
    """33 M rows in total, 1000 hot: nothing may allocate per row of all tables."""

    class LazyCollection:
        dim = 16
        table_offsets = torch.arange(27, dtype=torch.int64) * 1_270_000

        def __init__(self) -> None:
            self.step = 0.0

        def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
            frozen = (rows % 2 == 0).float()[:, None]
            return rows.float()[:, None] * 1e-7 + self.step * (1 - frozen) + torch.zeros(1, self.dim)

    coll = LazyCollection()
    config = StalenessConfig(memory_budget_bytes=1000 * 16 * 4, tolerance=1.0, alpha=0.5)
    det = StaleInputDetector.from_collection(coll, config)
    rng = np.random.default_rng(0)
    popular = rng.integers(0, 38, (2000, 26))  # 26 * 38 = 988 rows, each accessed ~50 times: the hot set
    sample = np.concatenate([rng.integers(0, 1_270_000, (8000, 26)), popular]).astype(np.int32)
    tracemalloc.start()
    det.profile(sample)
    det.begin_window(coll)
    coll.step = 0.5  # odd rows move, even rows stay
    det.end_window(coll)
    result = det.fit_threshold(sample)
    keep = det.sample_filter()(sample)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(det.hot) == 1000 and result.converged and result.sample_size == 2000
    assert set(det.stale_rows() % 2) == {0} and 0 < (~keep).sum() < 2000
    # one flag byte per row is held for the epoch (allocated before tracing started, and reported);
    # everything else scales with the hot set and the sample: int64 per row would be 264 MB
    assert peak < 25 * 2**20
    assert det.stats()["flag_bytes"] == int(coll.table_offsets[-1])


# ---- convergence rule ------------------------------------------------------------------------------------


def convergence_window(min_updates: int = 2):
    """1 table x 6 rows, all hot. During the window: rows 0-1 updated 3 times and barely move (converged),
    rows 2-3 updated 3 times and move a lot, rows 4-5 never updated (unknown)."""
    coll = FakeCollection([6])
    det = make(StalenessConfig(rule="convergence", min_updates=min_updates, tolerance=1.0), coll)
    det.profile(np.arange(6, dtype=np.int32)[:, None])
    det.begin_window(coll)
    for _ in range(3):
        det.record_updates(np.array([[0], [1], [2], [3]]))
    coll.move(np.array([0, 1]), 1e-4)
    coll.move(np.array([2, 3]), 0.5)
    det.end_window(coll)
    return coll, det


def test_convergence_rule_never_calls_a_row_without_updates_stale():
    """Rows 4-5 did not change at all, which the paper's rule calls perfectly stale; here they are unknown."""
    coll, det = convergence_window()
    score = det.row_score()
    assert np.isinf(score[4:]).all() and np.isfinite(score[:4]).all()
    scale = coll.weight[:4].abs().amax(dim=1).numpy()
    assert score[:2] == pytest.approx(1e-4 / (3 * scale[:2]), rel=1e-3)  # change per update, relative
    det.fit_threshold(np.arange(6, dtype=np.int32)[:, None])
    assert det.threshold is not None
    assert det.stale_rows().tolist() == [0, 1]
    assert not det.is_stale_row(np.array([4, 5])).any()
    assert det.stale_mask(np.arange(6)[:, None]).tolist() == [True, True, False, False, False, False]


def test_convergence_rule_waits_for_min_updates_and_reads_only_ready_rows():
    coll, det = convergence_window(min_updates=4)  # 3 updates each: nobody is judged yet
    assert np.isinf(det.row_score()).all()
    assert det.fit_threshold(np.arange(6, dtype=np.int32)[:, None]).threshold is None
    reads = len(coll.reads)
    det.record_updates(np.array([[0], [2]]))  # rows 0 and 2 reach 4 updates, 1 and 3 stay at 3
    det.recheck(coll)
    assert coll.reads[reads:] == [2]  # only the two ready rows are copied, not the hot set
    score = det.row_score()
    assert np.isfinite(score[[0, 2]]).all() and np.isinf(score[[1, 3, 4, 5]]).all()
    assert score[0] < score[2]


def test_convergence_rule_ignores_lookups_of_rows_that_are_not_hot():
    coll = FakeCollection([10])
    det = make(StalenessConfig(rule="convergence", min_updates=1, memory_budget_bytes=3 * coll.dim * 4), coll)
    det.profile(np.array([0, 0, 1, 1, 2, 2, 7], dtype=np.int32)[:, None])
    det.begin_window(coll)
    det.record_updates(np.array([[0], [7], [9], [2]]))
    det.end_window(coll)
    assert np.isfinite(det.row_score()).tolist() == [True, False, True]  # hot rows 0, 1, 2


def test_compiled_update_counting_matches_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C loop (flag byte, hash probe, increment) counts exactly what the NumPy path counts."""
    from slipcache import _native

    if _native.native() is None:
        pytest.skip("no compiled library")
    rng = np.random.default_rng(5)
    sizes = [50, 3, 400, 1000]
    ids = np.stack([np.minimum(rng.zipf(1.4, 3000) - 1, s - 1) for s in sizes], axis=1).astype(np.int32)
    counts = []
    for compiled in (True, False):
        coll = FakeCollection(sizes)
        det = make(StalenessConfig(rule="convergence", memory_budget_bytes=60 * coll.dim * 4), coll)
        det.profile(ids[:500])
        det.begin_window(coll)
        if not compiled:
            monkeypatch.setattr(_native, "native", lambda: None)
        for batch in np.split(ids, 6):
            det.record_updates(batch.astype(np.int64))  # as the trainer's batches hold them
        det.rule.fold_updates()
        counts.append(det.rule.updates.copy())
    assert counts[0].sum() > 0 and np.array_equal(counts[0], counts[1])


def test_hot_index_matches_a_sorted_search():
    rng = np.random.default_rng(3)
    rows = np.sort(rng.choice(1_000_000, 5000, replace=False))
    index = HotIndex(rows)
    queries = np.concatenate([rng.choice(rows, 3000), rng.integers(0, 1_000_000, 3000)])
    expected = np.searchsorted(rows, queries)
    expected = np.where(rows[np.minimum(expected, rows.size - 1)] == queries, expected, -1)
    assert np.array_equal(index.find(queries), expected)
    assert index.nbytes <= 4 * 12 * rows.size and HotIndex(np.zeros(0, np.int64)).find(queries).max() == -1


def test_convergence_state_round_trip_continues_identically():
    coll, det = convergence_window()
    det.fit_threshold(np.arange(6, dtype=np.int32)[:, None])
    det.record_updates(np.array([[4], [4], [5]]))
    buf = io.BytesIO()
    torch.save(det.state_dict(), buf)
    buf.seek(0)
    restored = make(StalenessConfig(rule="convergence", min_updates=2, tolerance=1.0), coll)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.stats() == det.stats()
    for d in (det, restored):
        d.record_updates(np.array([[5]]))
    coll.move(np.array([4, 5]), 0.01)
    det.recheck(coll)
    restored.recheck(coll)
    assert np.array_equal(restored.row_score(), det.row_score()) and np.isfinite(det.row_score()[4:]).all()


def test_control_share_keeps_that_share_of_stale_inputs_and_counts_them():
    coll, det = convergence_window()
    det.fit_threshold(np.arange(6, dtype=np.int32)[:, None])
    stale = np.zeros((20_000, 1), dtype=np.int32)  # row 0 is stale
    keep = det.count(stale, control_share=0.05)
    assert keep.mean() == pytest.approx(0.05, abs=0.01)
    assert det.total.controls == int(keep.sum()) and det.total.skipped == int((~keep).sum())
    again = make(StalenessConfig(rule="convergence", min_updates=2, tolerance=1.0), coll)
    again.load_state_dict(det.state_dict())
    again.total.inputs = 0  # the same run positions draw the same controls
    assert np.array_equal(again.count(stale, control_share=0.05), keep)


def test_guard_step_down_lowers_then_stops():
    guard = SkipGuard(0.4, margin=0.1, release=0.5, patience=2, backoff=0.5, min_target=0.15)
    assert guard.step_down(-0.003).action == "lower" and guard.target == pytest.approx(0.2)
    assert guard.step_down(-0.003).action == "stop" and not guard.active
    assert guard.step_down(-0.003).action == "none"


def test_compiled_filter_matches_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """keep, control and every counter of the one-pass C filter equal the NumPy path's, alpha < 1 too."""
    from slipcache import _native

    if _native.native() is None:
        pytest.skip("no compiled library")
    rng = np.random.default_rng(7)
    sizes = [40, 5, 300]
    ids = np.stack([np.minimum(rng.zipf(1.3, 4000) - 1, s - 1) for s in sizes], axis=1).astype(np.int32)
    for alpha in (1.0, 0.6):
        results = []
        for compiled in (True, False):
            coll = FakeCollection(sizes)
            det = make(StalenessConfig(rule="convergence", min_updates=1, tolerance=1.0, alpha=alpha, seed=3), coll)
            det.profile(ids[:1000])
            det.begin_window(coll)
            det.record_updates(ids[:1000])
            coll.move(np.arange(0, 345, 2), 0.3)  # even rows move: odd ones are stale
            det.end_window(coll)
            det.fit_threshold(ids[:1000])
            assert det.skipping
            if not compiled:
                monkeypatch.setattr(_native, "native", lambda: None)
            out = [det.count_with_controls(batch, control_share=0.3) for batch in np.split(ids, 8)]
            monkeypatch.undo()
            results.append((np.concatenate([k for k, _ in out]), np.concatenate([c for _, c in out]), det.total))
        (keep, control, total), (keep_np, control_np, total_np) = results
        assert np.array_equal(keep, keep_np) and np.array_equal(control, control_np) and total == total_np
        assert total.skipped > 0 and total.controls > 0
        cold = int(np.flatnonzero(det._row_flags[:40] == 0)[0])  # the flag reads stop at a cold first lookup,
        with pytest.raises(InvalidInputError):  # the range check does not
            det.count_with_controls(np.array([[cold, 0, 300]], dtype=np.int32), control_share=0.3)
