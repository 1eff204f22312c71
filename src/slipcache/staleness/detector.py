"""Slipstream-style stale-input skipping (Maboud et al., arXiv 2404.04270), plus rolling re-checks and a guard.

Hot embedding rows converge early; an input whose lookups all hit rows that no longer move adds little to
training, so the trainer may skip it. Per epoch:

1. ``profile``: count row accesses on a sample of inputs; the hot set is the most-accessed rows fitting a
   byte budget. An input is *hot* when every lookup is a hot row (at least alpha of them, when alpha < 1).
2. ``begin_window`` / ``end_window``: snapshot the hot rows (only those) around a window of normal training.
3. ``row_change``: per hot row, the largest per-dimension change (L-infinity) between the two snapshots;
   a row is stale under threshold ``T`` when that change is below ``T``.
4. ``fit_threshold``: bisection on ``T`` so that the stale fraction of a sample of hot inputs lands in
   ``target_drop +- tolerance``; when unreachable, report it and skip nothing.
5. ``stale_mask`` / ``sample_filter``: an input is skipped when at least alpha of its lookups are stale.

Two staleness rules (``StalenessConfig.rule``):

- ``paper``: the L-infinity change of a row between two snapshots of every hot row. A row that was not
  updated between them has change 0 and looks converged; in ``--quick`` 56,395 of 56,407 hot rows were
  "stale" that way, so the rule mostly skipped inputs avoiding the few rows that moved.
- ``convergence``: a row is judged only once it has been updated at least ``min_updates`` times since its
  last measurement; its score is the L-infinity change over that span divided by the number of updates and
  by the row's own L-infinity norm (change per update, relative to the row's scale). Rows not yet measured
  are unknown and never stale. Update counts are kept for the hot rows only (``record_updates``, through
  ``HotIndex``, a hash of the hot rows: no byte per row of the tables), and a re-check reads back only the
  rows with enough updates, not every hot row.

Beyond the paper: ``after_batch`` re-snapshots every K batches so a row that moves again stops being stale;
``SkipGuard`` lowers the target (or stops skipping) when skipped inputs' loss rises above a reference;
``stale_rows`` lists rows a cache may demote.

Memory: snapshots and counts are proportional to the hot set; the input filter also reads one flag byte per
row of every table (hot, stale), because a direct index is much faster than a search of the hot rows.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

from slipcache import _native
from slipcache.errors import InvalidInputError
from slipcache.staleness.guard import GuardDecision, SkipGuard
from slipcache.staleness.hotset import HotIndex, HotSet, _check_ids, _global_rows, _to_numpy

__all__ = [
    "RULES",
    "EmbeddingRowSource",
    "GuardDecision",
    "HotIndex",
    "HotSet",
    "SkipGuard",
    "StaleInputDetector",
    "StalenessConfig",
    "ThresholdResult",
]

_STATE_VERSION = 2
RULES = ("paper", "convergence")


class EmbeddingRowSource(Protocol):
    """The part of the embedding collection interface the detector needs (see docs/design.md)."""

    table_offsets: torch.Tensor
    dim: int

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor: ...


@dataclass
class StalenessConfig:
    """Every Slipstream constant as a parameter; defaults follow the paper (Criteo, 26 tables).

    ``alpha`` is a fraction of an input's lookups (1.0 = all of them). ``alpha_count``, when set, replaces it
    with an absolute number of lookups; the two are separate fields so a YAML ``1`` can never silently mean
    "one lookup" instead of "all lookups".
    """

    profile_fraction: float = 0.05  # share of training inputs sampled to count row accesses
    memory_budget_bytes: int = 256 * 2**20  # hot set size: rows * dim * 4 <= budget
    window_fraction: float = 0.02  # share of hot batches in the snapshot window (paper: 1.5-3 %)
    threshold_sample_fraction: float = 0.01  # share of inputs sampled for the threshold search
    threshold_sample_max: int = 200_000  # cap on hot inputs kept for (re)fitting the threshold
    target_drop: float = 0.3  # D: fraction of hot inputs to skip
    tolerance: float = 0.08  # delta: accepted |achieved - D|
    threshold_low: float = 0.0
    threshold_high: float = 0.1
    max_bisection_steps: int = 25
    alpha: float = 1.0  # skip when >= ceil(alpha * T) lookups are stale
    alpha_count: int | None = None  # absolute count; overrides alpha when set
    recheck_interval: int | None = 0  # batches between rolling snapshots; 0 = window length, None = off
    guard_margin: float = 0.01  # relative rise of the skipped inputs' loss that counts as drift
    guard_release: float = 0.5  # drift must fall below margin * release to relax (hysteresis)
    guard_patience: int = 2  # consecutive checks needed before acting, either way
    guard_backoff: float = 0.5  # target multiplier on drift (halve D)
    guard_min_target: float = 0.05  # below this the guard stops skipping instead
    guard_sample_size: int = 4096  # inputs per epoch whose loss the trainer follows (forward only)
    guard_min_skipped: int = 100  # fewer skipped inputs in that sample: too noisy to judge, no check
    rule: str = "paper"  # "paper" (L-inf change between snapshots) or "convergence" (see module docstring)
    min_updates: int = 4  # convergence rule: updates a row needs before its change is judged
    count_share: float = 1.0  # convergence rule: share of each trained batch whose lookups are counted
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject values that would make the method silently meaningless."""
        fractions = {
            "profile_fraction": self.profile_fraction,
            "window_fraction": self.window_fraction,
            "threshold_sample_fraction": self.threshold_sample_fraction,
        }
        for name, value in fractions.items():
            if not 0.0 < value <= 1.0:
                raise InvalidInputError(f"{name} must be in (0, 1], got {value}")
        if not 0.0 < self.alpha <= 1.0:
            raise InvalidInputError(f"alpha is a fraction in (0, 1], got {self.alpha}; use alpha_count for a count")
        if self.alpha_count is not None and (isinstance(self.alpha_count, bool) or self.alpha_count < 1):
            raise InvalidInputError(f"alpha_count must be a positive int, got {self.alpha_count}")
        if not 0.0 <= self.target_drop <= 1.0 or self.tolerance < 0.0:
            raise InvalidInputError("target_drop must be in [0, 1] and tolerance >= 0")
        if not 0.0 <= self.threshold_low < self.threshold_high:
            raise InvalidInputError("need 0 <= threshold_low < threshold_high")
        if self.max_bisection_steps < 1 or self.threshold_sample_max < 1:
            raise InvalidInputError("max_bisection_steps and threshold_sample_max must be >= 1")
        if self.memory_budget_bytes < 0:
            raise InvalidInputError("memory_budget_bytes must be >= 0")
        if self.recheck_interval is not None and self.recheck_interval < 0:
            raise InvalidInputError("recheck_interval must be None (off), 0 (window length) or positive")
        if self.guard_margin < 0.0 or not 0.0 <= self.guard_release <= 1.0:
            raise InvalidInputError("guard_margin must be >= 0 and guard_release in [0, 1]")
        if self.rule not in RULES:
            raise InvalidInputError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if isinstance(self.min_updates, bool) or self.min_updates < 1:
            raise InvalidInputError(f"min_updates must be a positive int, got {self.min_updates}")
        if not 0.0 < self.count_share <= 1.0:
            raise InvalidInputError(f"count_share must be in (0, 1], got {self.count_share}")
        if self.guard_patience < 1 or not 0.0 < self.guard_backoff < 1.0 or min(self.guard_sample_size,
                                                                                 self.guard_min_skipped) < 1:
            raise InvalidInputError("need guard_patience >= 1, guard_backoff in (0, 1), guard_sample_size >= 1 "
                                    "and guard_min_skipped >= 1")

    def required_stale(self, num_tables: int) -> int:
        """Number of stale lookups (out of ``num_tables``) that makes an input skippable."""
        if self.alpha_count is not None:
            if self.alpha_count > num_tables:
                raise InvalidInputError(f"alpha_count {self.alpha_count} exceeds the {num_tables} lookups per input")
            return self.alpha_count
        # The epsilon keeps 0.5 * 26 at 13 despite float rounding.
        return max(1, math.ceil(self.alpha * num_tables - 1e-9))


@dataclass
class ThresholdResult:
    """Outcome of the bisection. ``threshold`` is None when the target band is unreachable (no skipping)."""

    threshold: float | None
    achieved_ratio: float  # stale fraction of the sampled hot inputs at the last threshold tried
    steps: int  # bisection midpoints evaluated
    converged: bool
    target: float
    sample_size: int
    reason: str = ""


@dataclass
class _Counters:
    """Per-epoch input counts seen through ``sample_filter`` (or ``count``)."""

    inputs: int = 0
    hot_inputs: int = 0
    skipped: int = 0
    skipped_hot: int = 0
    controls: int = 0  # would-be-skipped inputs trained anyway as the guard's control group


class StaleInputDetector:
    """Drives one Slipstream cycle per epoch; the trainer calls it between batches (see module docstring)."""

    def __init__(self, config: StalenessConfig, table_offsets: np.ndarray | torch.Tensor, dim: int) -> None:
        offsets = np.asarray(_to_numpy(table_offsets), dtype=np.int64).reshape(-1)
        if offsets.size < 2 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise InvalidInputError("table_offsets must be non-decreasing, start at 0 and have T + 1 entries")
        if dim < 1:
            raise InvalidInputError(f"dim must be positive, got {dim}")
        self.config = config
        self.table_offsets = offsets  # int64 [T + 1]
        self.dim = int(dim)
        self.epoch = 0
        self.guard = SkipGuard.from_config(config)
        self._reset_epoch_state()
        self.total = _Counters()

    @classmethod
    def from_collection(cls, coll: EmbeddingRowSource, config: StalenessConfig | None = None) -> StaleInputDetector:
        return cls(config or StalenessConfig(), coll.table_offsets, int(coll.dim))

    # ---- epoch lifecycle -------------------------------------------------------------------------------

    @property
    def num_tables(self) -> int:
        return int(self.table_offsets.size - 1)

    @property
    def _stale_flags(self) -> np.ndarray:
        """bool, aligned with hot.rows."""
        return self._stale_aligned

    @_stale_flags.setter
    def _stale_flags(self, flags: np.ndarray) -> None:
        """Also refresh the per-row flag bytes (bit 0: hot, bit 1: stale) that the input filter reads.

        Why a byte for every row of every table: the filter classifies each training input, 26 lookups,
        and a direct index is about 50x faster than a binary search of the sorted hot rows. It costs one
        byte per row (34 MB for the Criteo Kaggle tables), reported as `flag_bytes` in the stats.
        """
        self._stale_aligned = flags
        # Only rows flagged before can be non-zero: clear those, not every row of every table (a re-check
        # runs every window length; clearing 34 M bytes each time would cost more than the re-check itself).
        rows = None if self.hot is None else self.hot.rows
        if self._flagged is not None and self._flagged is not rows:
            self._row_flags[self._flagged] = 0
        self._flagged = rows
        if rows is not None:
            self._row_flags[rows] = 1 | (flags.astype(np.uint8) << 1)

    def _reset_epoch_state(self) -> None:
        self._row_flags = np.zeros(int(self.table_offsets[-1]), dtype=np.uint8)
        self._flagged: np.ndarray | None = None  # the rows whose flag bytes may be non-zero
        self._fit_positions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (sample, pos, hit) memo
        self.hot: HotSet | None = None
        self.threshold_result: ThresholdResult | None = None
        self._threshold: float | None = None
        self._snap_prev: torch.Tensor | None = None
        self._snap_cur: torch.Tensor | None = None
        self._change_memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._stale_flags = np.zeros(0, dtype=bool)  # aligned with hot.rows
        self._fit_sample: np.ndarray | None = None  # hot inputs kept for refits after guard actions
        self._window_open = False
        self._window_batches = 0
        self._since_snapshot = 0
        self._rechecks = 0
        self.epoch_counts = _Counters()
        # convergence rule: per hot row, its value when its current span began, updates since then, score
        self._index: HotIndex | None = None
        self._base: torch.Tensor | None = None
        self._updates = np.zeros(0, dtype=np.int64)
        self._score = np.zeros(0, dtype=np.float32)  # inf = unknown (not yet updated min_updates times)
        self._pending: list[np.ndarray] = []  # hot positions of trained lookups not yet added to _updates
        self.rows_read = 0  # hot rows copied by snapshots and measurements this epoch

    @property
    def convergence(self) -> bool:
        return self.config.rule == "convergence"

    def start_epoch(self, epoch: int) -> None:
        """Forget last epoch's hot set, snapshots and threshold; the guard and totals carry over."""
        self.epoch = int(epoch)
        self._reset_epoch_state()

    def sample_indices(self, num_inputs: int, fraction: float, purpose: str) -> np.ndarray:
        """Sorted random input indices, deterministic in (seed, epoch, purpose); sorted for mmap reads."""
        if num_inputs < 0 or not 0.0 < fraction <= 1.0:
            raise InvalidInputError("need num_inputs >= 0 and fraction in (0, 1]")
        size = min(num_inputs, max(1, round(num_inputs * fraction))) if num_inputs else 0
        rng = self._rng(purpose)
        return np.sort(rng.choice(num_inputs, size=size, replace=False)).astype(np.int64)

    def window_batches(self, num_hot_batches: int) -> int:
        """Length of the snapshot window: ``window_fraction`` of the epoch's hot batches, at least 1."""
        return max(1, round(num_hot_batches * self.config.window_fraction))

    def _rng(self, purpose: str) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, self.epoch, zlib.crc32(purpose.encode())])

    # ---- 1. hot rows -----------------------------------------------------------------------------------

    def profile(self, sparse_sample: np.ndarray | torch.Tensor) -> HotSet:
        """Count accesses on a sample of inputs and keep the most-accessed rows that fit the budget."""
        global_rows = _global_rows(sparse_sample, self.table_offsets).reshape(-1)
        rows, counts = np.unique(global_rows, return_counts=True)
        max_rows = self.config.memory_budget_bytes // (self.dim * 4)
        if rows.size > max_rows:
            # Most accessed first; ties go to the lower row so the choice is deterministic.
            keep = np.lexsort((rows, -counts))[:max_rows]
            rows, counts = rows[keep], counts[keep]
        self.set_hot(HotSet(rows, counts, self.table_offsets))
        return self.hot

    def set_hot(self, hot: HotSet) -> None:
        """Install a hot set (from ``profile`` or a filtered one) and clear what was measured on the last."""
        self.hot = hot
        self._stale_flags = np.zeros(len(hot), dtype=bool)
        self._snap_prev = self._snap_cur = self._base = None
        if self.convergence:
            self._index = HotIndex(hot.rows)
            self._updates = np.zeros(len(hot), dtype=np.int64)
            self._score = np.full(len(hot), np.inf, dtype=np.float32)
            self._pending = []

    def hot_input_mask(self, sparse: np.ndarray | torch.Tensor) -> np.ndarray:
        """bool[n]: hot inputs, those with at least alpha of their lookups hot (all False before ``profile``).

        With alpha = 1 (the paper) every lookup must be hot. Only hot inputs can ever be skipped, so they are
        what the target D is a share of.
        """
        return self._classify(sparse)[1]

    # ---- 2. snapshots ----------------------------------------------------------------------------------

    def _read_hot(self, coll: EmbeddingRowSource) -> torch.Tensor:
        hot = self._require_hot()
        return self._read(coll, hot.rows)

    def _read(self, coll: EmbeddingRowSource, rows: np.ndarray) -> torch.Tensor:
        values = coll.read_rows(torch.from_numpy(rows))
        if tuple(values.shape) != (rows.size, self.dim):
            raise InvalidInputError(f"read_rows returned {tuple(values.shape)}, expected {(rows.size, self.dim)}")
        self.rows_read += int(rows.size)
        # Clone: a collection may hand back a view of rows that training keeps mutating.
        return values.detach().to(device="cpu", dtype=torch.float32).clone()

    def begin_window(self, coll: EmbeddingRowSource) -> None:
        """Snapshot the hot rows before the window of normal training."""
        if self.convergence:
            self._base = self._read_hot(coll)
            self._updates[:] = 0
            self._score[:] = np.inf
            self._pending = []
        else:
            self._snap_prev = self._read_hot(coll)
        self._snap_cur = None
        self._window_open = True
        self._since_snapshot = 0

    def end_window(self, coll: EmbeddingRowSource) -> torch.Tensor:
        """Snapshot the hot rows after the window; returns the per-row L-infinity change."""
        if not self._window_open:
            raise InvalidInputError("end_window called without begin_window")
        if self.convergence:
            self._measure(coll)
        else:
            self._snap_cur = self._read_hot(coll)
        self._window_open = False
        self._window_batches = self._since_snapshot
        self._since_snapshot = 0
        self._refresh_flags()
        return self.row_score()

    @property
    def window_done(self) -> bool:
        """True once the first window of the epoch closed: re-checks and fits can run."""
        return (self._base is not None or self._snap_cur is not None) and not self._window_open

    def record_updates(self, sparse: np.ndarray | torch.Tensor) -> None:
        """Convergence rule: count one update of each hot row per trained input that looks it up.

        Each input adds one gradient term to each of its rows, so this counts gradient contributions. Call it
        with every trained batch while a window or span is open; a no-op under the paper's rule. With
        ``count_share`` < 1 only the batch's first inputs are counted (a random sample: batches are shuffled)
        and counts are scaled up when judged: the hash lookups are most of the bookkeeping's cost. A row
        counted at all was updated at least once, so a row never updated still stays unknown.
        """
        if self._index is None or self._base is None:
            return
        # Trained ids were validated by the filter already: no range check here (it cost a third of this).
        ids = _to_numpy(sparse)
        if self.config.count_share < 1.0:
            ids = ids[: max(1, math.ceil(ids.shape[0] * self.config.count_share))]
        if ids.ndim == 2 and ids.dtype.kind in "iu" and _native.native() is not None:
            # One pass in C: flag byte, hash probe and counter increment per lookup (NumPy below: ~6x slower).
            # Batches hold int64 ids; ids index a table, so int32 holds them (the copy is of the counted share).
            ids = np.ascontiguousarray(ids, dtype=np.int32)
            _native.count_hot_updates(ids, self.table_offsets, self._row_flags, self._index.keys,
                                      self._index.values, self._updates)
            return
        rows = (ids + self.table_offsets[:-1].astype(ids.dtype)).reshape(-1)
        rows = rows[np.take(self._row_flags, rows) != 0]  # hot lookups only: the flag byte says so
        pos = self._index.find(rows)
        self._pending.append(pos[pos >= 0])

    def _fold_updates(self) -> None:
        if self._pending:
            self._updates += np.bincount(np.concatenate(self._pending), minlength=self._updates.size)
            self._pending = []

    def _measure(self, coll: EmbeddingRowSource) -> None:
        """Score every hot row updated at least ``min_updates`` times since its span began; start a new span.

        Score = L-inf change over the span / (updates x the row's L-inf norm now). Only those rows are read:
        a row with fewer updates keeps its span open and its last score (inf until it has one).
        """
        self._fold_updates()
        hot = self._require_hot()
        estimated = self._updates / self.config.count_share
        ready = np.flatnonzero(estimated >= self.config.min_updates)
        if ready.size:
            idx = torch.from_numpy(ready)
            now = self._read(coll, hot.rows[ready])
            change = (now - self._base[idx]).abs().amax(dim=1)
            scale = now.abs().amax(dim=1).clamp_min(1e-12)
            self._score[ready] = (change / (scale * torch.from_numpy(estimated[ready]).float())).numpy()
            self._base[idx] = now
            self._updates[ready] = 0

    def after_batch(self, coll: EmbeddingRowSource) -> bool:
        """Call after every trained batch; re-snapshots every K batches once the window has ended.

        Returns True when a rolling re-check happened. Stale flags then come from the latest snapshot pair.
        """
        self._since_snapshot += 1
        interval = self._recheck_interval()
        if not self.window_done or interval is None or self._since_snapshot < interval:
            return False
        self.recheck(coll)
        return True

    def recheck(self, coll: EmbeddingRowSource) -> None:
        """Take a new snapshot; staleness is recomputed from (previous snapshot, this one)."""
        if not self.window_done:
            raise InvalidInputError("recheck needs a finished window (end_window) first")
        if self.convergence:
            self._measure(coll)
        else:
            self._snap_prev, self._snap_cur = self._snap_cur, self._read_hot(coll)
        self._since_snapshot = 0
        self._rechecks += 1
        self._refresh_flags()

    def _recheck_interval(self) -> int | None:
        interval = self.config.recheck_interval
        if interval == 0:  # match the window so changes are comparable with the fitted threshold
            interval = self._window_batches or None
        return interval

    # ---- 3. staleness ----------------------------------------------------------------------------------

    def row_change(self) -> torch.Tensor:
        """float32 [hot rows]: largest per-dimension change between the latest two snapshots."""
        if self._snap_prev is None or self._snap_cur is None:
            raise InvalidInputError("row_change needs two snapshots (begin_window, end_window)")
        prev, cur = self._snap_prev, self._snap_cur
        memo = self._change_memo  # the filter, refits and stats all ask between two snapshots
        if memo is None or memo[0] is not prev or memo[1] is not cur:
            change = torch.zeros(0) if prev.shape[0] == 0 else (cur - prev).abs().amax(dim=1)
            self._change_memo = memo = (prev, cur, change)
        return memo[2]

    def row_score(self) -> np.ndarray:
        """float32 [hot rows]: what the threshold is compared with under the configured rule.

        paper: the L-inf change between the latest two snapshots; convergence: change per update relative
        to the row's scale, inf for rows not yet measured (never stale).
        """
        if not self.convergence:
            return self.row_change().numpy()
        if self._base is None:
            raise InvalidInputError("row_score needs a window (begin_window, end_window)")
        return self._score

    def _refresh_flags(self) -> None:
        if self._threshold is None or not self.window_done:
            self._stale_flags = np.zeros(len(self._require_hot()), dtype=bool)
        else:
            self._stale_flags = self.row_score() < self._threshold

    def stale_rows(self) -> np.ndarray:
        """Sorted global rows currently stale: a cache can give their slots to rows that still move."""
        if self.hot is None:
            return np.zeros(0, dtype=np.int64)
        return self.hot.rows[self._stale_flags]

    def is_stale_row(self, global_rows: np.ndarray | torch.Tensor) -> np.ndarray:
        """Boolean mask over arbitrary global rows (non-hot rows are never stale)."""
        rows = np.asarray(_to_numpy(global_rows), dtype=np.int64)
        if self.hot is None:
            return np.zeros(rows.shape, dtype=bool)
        pos, hit = self.hot.positions(rows)
        return hit & self._stale_flags[pos]

    # ---- 4. threshold ----------------------------------------------------------------------------------

    @property
    def threshold(self) -> float | None:
        return self._threshold

    def fit_threshold(self, sample_inputs: np.ndarray | torch.Tensor) -> ThresholdResult:
        """Bisect T in [low, high] so the stale fraction of the sample's hot inputs lands in D +- delta.

        Non-hot inputs in ``sample_inputs`` are dropped first. When the band is unreachable the result has
        ``threshold=None`` and nothing is skipped this epoch.
        """
        sparse = _check_ids(sample_inputs, self.table_offsets)
        hot_inputs = sparse[self.hot_input_mask(sparse)]
        if hot_inputs.shape[0] > self.config.threshold_sample_max:
            pick = self._rng("threshold-cap").choice(hot_inputs.shape[0], self.config.threshold_sample_max,
                                                      replace=False)
            hot_inputs = hot_inputs[np.sort(pick)]
        self.row_score()  # fail early without snapshots
        self._fit_sample = np.ascontiguousarray(hot_inputs, dtype=np.int32)
        return self._fit(self.guard.target)

    def refit(self) -> ThresholdResult:
        """Refit T on the latest snapshot pair, with the inputs sampled by the last ``fit_threshold``.

        Cheap enough to run at every rolling re-check: the sample's rows are located in the hot set once.
        """
        if self._fit_sample is None:
            raise InvalidInputError("refit needs a sample: call fit_threshold first")
        return self._fit(self.guard.target)

    def _input_keys(self, sparse: np.ndarray) -> np.ndarray:
        """Per input, the smallest T that makes it stale is just above its k-th smallest lookup change."""
        memo = self._fit_positions
        if memo is None or memo[0] is not sparse:
            pos, hit = self._require_hot().positions(_global_rows(sparse, self.table_offsets))
            self._fit_positions = memo = (sparse, pos, hit)
        _, pos, hit = memo
        change = self.row_score()[pos]
        if not hit.all():
            change[~hit] = np.inf
        k = self.config.required_stale(self.num_tables) - 1
        if not change.size:
            return np.zeros(0)
        if k == self.num_tables - 1:  # alpha = all lookups: the largest change
            return change.max(axis=1)
        return np.partition(change, k, axis=1)[:, k]

    def _fit(self, target: float) -> ThresholdResult:
        cfg = self.config
        sample = self._fit_sample if self._fit_sample is not None else np.zeros((0, self.num_tables), np.int32)
        keys = self._input_keys(sample)
        n = int(keys.size)

        def ratio(t: float) -> float:
            return float(np.count_nonzero(keys < t)) / n

        def result(t: float | None, achieved: float, steps: int, ok: bool, reason: str = "") -> ThresholdResult:
            self._threshold = t
            self.threshold_result = ThresholdResult(t, achieved, steps, ok, target, n, reason)
            self._refresh_flags()
            return self.threshold_result

        if n == 0:
            return result(None, 0.0, 0, False, "no hot inputs in the threshold sample")
        lo, hi = cfg.threshold_low, cfg.threshold_high
        if self.convergence:  # scores are relative: search up to just above the largest known input key
            known = keys[np.isfinite(keys)]
            if not known.size:
                return result(None, 0.0, 0, False, "no sampled hot input has all its rows measured yet")
            lo, hi = 0.0, float(np.nextafter(np.float32(known.max()), np.float32(np.inf)))
        top = ratio(hi)
        if top < target - cfg.tolerance:
            return result(None, top, 0, False, f"stale fraction at T={hi} is {top:.3f} < {target - cfg.tolerance:.3f}")
        achieved = top
        for step in range(1, cfg.max_bisection_steps + 1):
            mid = 0.5 * (lo + hi)
            achieved = ratio(mid)
            if abs(achieved - target) <= cfg.tolerance:
                return result(mid, achieved, step, True)
            if achieved < target:
                lo = mid
            else:
                hi = mid
        return result(None, achieved, cfg.max_bisection_steps, False,
                      f"no T in [{cfg.threshold_low}, {cfg.threshold_high}] gives {target:.3f} +- {cfg.tolerance}")

    # ---- 5. classify -----------------------------------------------------------------------------------

    @property
    def skipping(self) -> bool:
        """True when a threshold was found and the guard allows skipping."""
        return self._threshold is not None and self.guard.active

    def stale_counts(self, sparse: np.ndarray | torch.Tensor) -> np.ndarray:
        """int[n]: stale lookups per input."""
        return np.count_nonzero(self._flags(sparse) == 3, axis=1)

    def stale_mask(self, sparse: np.ndarray | torch.Tensor) -> np.ndarray:
        """bool[n]: inputs with at least alpha stale lookups (pure classification, ignores the guard)."""
        return self._classify(sparse)[0]

    def skip_mask(self, sparse: np.ndarray | torch.Tensor) -> np.ndarray:
        """bool[n]: inputs to skip now; all False unless ``skipping``."""
        mask = self.stale_mask(sparse)
        return mask if self.skipping else np.zeros_like(mask)

    def _flags(self, sparse: np.ndarray | torch.Tensor) -> np.ndarray:
        """uint8 [n, T]: per lookup 0 (cold), 1 (hot) or 3 (hot and stale)."""
        return np.take(self._row_flags, _global_rows(sparse, self.table_offsets))

    def _classify(self, sparse: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(stale: at least alpha lookups stale, hot: at least alpha lookups hot), bool[n] each.

        This runs on every training input: the compiled loop (`slipcache._native`) does it in one pass over
        the int32 ids, validating them on the way; otherwise NumPy, where the common case (alpha = every
        lookup) takes one reduction: the smallest flag decides both.
        """
        required = self.config.required_stale(self.num_tables)
        ids = _to_numpy(sparse)
        if self._compiled(ids):
            result = _native.classify_inputs(ids, self.table_offsets, self._row_flags, required)
            if result is None:
                raise InvalidInputError("sparse ids out of range for their tables")
            return result
        flags = self._flags(sparse)
        if required == self.num_tables:
            lowest = flags.min(axis=1, initial=3)
            return lowest == 3, lowest >= 1
        return np.count_nonzero(flags == 3, axis=1) >= required, np.count_nonzero(flags, axis=1) >= required

    def _compiled(self, ids: np.ndarray) -> bool:
        """Whether the compiled loops can take these ids (C-contiguous int32 [n, T], as the splits hold them)."""
        return (ids.dtype == np.int32 and ids.ndim == 2 and ids.shape[1] == self.num_tables
                and ids.flags.c_contiguous and _native.native() is not None)

    def count(self, sparse: np.ndarray | torch.Tensor, control_share: float = 0.0) -> np.ndarray:
        """Classify for skipping and record the counts for ``stats``; returns the keep mask."""
        return self.count_with_controls(sparse, control_share)[0]

    def count_with_controls(self, sparse: np.ndarray | torch.Tensor,
                            control_share: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(keep, control): ``count``, and which kept inputs are controls.

        ``control_share``: that share of the would-be-skipped inputs is kept anyway (the guard's control
        group), chosen by a hash of the input's position in the run, so the choice needs no RNG state.
        """
        ids = _to_numpy(sparse)
        if self._compiled(ids):  # one C pass (this runs on every training input): a few NumPy passes less
            result = _native.filter_inputs(ids, self.table_offsets, self._row_flags,
                                           self.config.required_stale(self.num_tables), self.skipping,
                                           control_share, _seed_mix(self.config.seed), self.total.inputs)
            if result is None:
                raise InvalidInputError("sparse ids out of range for their tables")
            keep, control, num_hot, num_would_skip, num_control = result
            self._add_counts(keep.size, num_hot, num_would_skip - num_control, num_control)
            return keep, control
        skip, hot = self._classify(sparse)
        control = np.zeros_like(skip)
        num_hot = int(np.count_nonzero(hot))
        would_skip = np.flatnonzero(skip) if self.skipping else np.zeros(0, dtype=np.int64)
        num_control = 0
        if control_share > 0.0 and would_skip.size:
            # draws for the would-be-skipped inputs only; the same values a draw for every input gives them
            chosen = would_skip[_uniform(self.config.seed, self.total.inputs + would_skip) < control_share]
            control[chosen] = True
            num_control = int(chosen.size)
        keep = np.ones_like(skip)
        keep[would_skip] = False
        keep |= control
        self._add_counts(skip.size, num_hot, int(would_skip.size) - num_control, num_control)
        return keep, control

    def _add_counts(self, inputs: int, hot: int, skipped: int, controls: int) -> None:
        # skipped inputs are stale under alpha, so hot under alpha too: every skipped input is a hot one
        for counters in (self.epoch_counts, self.total):
            counters.inputs += int(inputs)
            counters.hot_inputs += hot
            counters.skipped += skipped
            counters.skipped_hot += skipped
            counters.controls += controls

    def pass_through(self, n: int) -> np.ndarray:
        """Keep all of ``n`` inputs without classifying them (before warm-up ends); counts them."""
        for counters in (self.epoch_counts, self.total):
            counters.inputs += int(n)
        return np.ones(int(n), dtype=bool)

    def sample_filter(self) -> Callable[[np.ndarray], np.ndarray]:
        """A ``BatchIterator`` ``sample_filter``: keep = not stale; it counts what it skips.

        Reads the detector's state at each call, so rolling re-checks and guard actions apply immediately.
        """
        return self.count

    # ---- guard -----------------------------------------------------------------------------------------

    def guard_indices(self, num_inputs: int) -> np.ndarray:
        """The epoch's guard sample: inputs whose loss the guard follows (deterministic per seed and epoch)."""
        return self.sample_indices(num_inputs, min(1.0, self.config.guard_sample_size / max(num_inputs, 1)), "guard")

    def update_guard(self, loss: float, reference: float) -> GuardDecision:
        """Feed the guard's loss statistic and its reference; refits T if D changed."""
        before = self.guard.target
        decision = self.guard.update(loss, reference)
        if decision.target != before and self._fit_sample is not None:
            self._fit(decision.target)
        return decision

    def step_down_guard(self, drift: float) -> GuardDecision:
        """Lower D one step now (or stop skipping), e.g. when validation AUC fell; refits T."""
        decision = self.guard.step_down(drift)
        if decision.action == "lower" and self._fit_sample is not None:
            self._fit(decision.target)
        return decision

    # ---- metrics and checkpoints -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Flat JSON-ready metrics for metrics.jsonl."""
        res = self.threshold_result
        ep = self.epoch_counts
        return {
            "epoch": self.epoch,
            "hot_rows": len(self.hot) if self.hot is not None else 0,
            "hot_bytes": (len(self.hot) if self.hot is not None else 0) * self.dim * 4,
            "flag_bytes": int(self._row_flags.nbytes),
            "index_bytes": self._index.nbytes if self._index is not None else 0,
            "rule": self.config.rule,
            "stale_rows": int(np.count_nonzero(self._stale_flags)),
            "unknown_rows": int(np.count_nonzero(~np.isfinite(self._score))) if self.convergence else None,
            "rows_read": self.rows_read,
            "threshold": self._threshold,
            "threshold_converged": res.converged if res else False,
            "threshold_steps": res.steps if res else 0,
            "threshold_ratio": res.achieved_ratio if res else None,
            "threshold_reason": res.reason if res else "",
            "target_drop": self.guard.target,
            "skipping": self.skipping,
            "guard_active": self.guard.active,
            "window_batches": self._window_batches,
            "rechecks": self._rechecks,
            "inputs_seen": ep.inputs,
            "hot_inputs_seen": ep.hot_inputs,
            "inputs_skipped": ep.skipped,
            "skipped_fraction": ep.skipped / ep.inputs if ep.inputs else 0.0,
            "hot_skipped_fraction": ep.skipped_hot / ep.hot_inputs if ep.hot_inputs else 0.0,
            "total_inputs_skipped": self.total.skipped,
        }

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, so ``torch.load(weights_only=True)`` can read it back."""
        def tensor(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a))

        self._fold_updates()  # sums are order-free: folding early changes no count

        return {
            "version": _STATE_VERSION,
            "config": asdict(self.config),
            "table_offsets": tensor(self.table_offsets),
            "dim": self.dim,
            "epoch": self.epoch,
            "hot_rows": tensor(self.hot.rows) if self.hot is not None else None,
            "hot_counts": tensor(self.hot.counts) if self.hot is not None else None,
            "snap_prev": self._snap_prev,
            "snap_cur": self._snap_cur,
            "threshold": self._threshold,
            "threshold_result": asdict(self.threshold_result) if self.threshold_result else None,
            "stale_flags": tensor(self._stale_flags),
            "fit_sample": tensor(self._fit_sample),
            "window_open": self._window_open,
            "window_batches": self._window_batches,
            "since_snapshot": self._since_snapshot,
            "rechecks": self._rechecks,
            "base": self._base,
            "updates": tensor(self._updates),
            "score": tensor(self._score),
            "rows_read": self.rows_read,
            "guard": self.guard.state_dict(),
            "epoch_counts": asdict(self.epoch_counts),
            "total": asdict(self.total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly; the collection geometry must match. The detector's own config is kept."""
        if state.get("version") != _STATE_VERSION:
            raise InvalidInputError(f"unsupported staleness state version {state.get('version')}")
        offsets = state["table_offsets"].numpy()
        if int(state["dim"]) != self.dim or not np.array_equal(offsets, self.table_offsets):
            raise InvalidInputError("staleness state was saved for a different embedding geometry")

        def array(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy().copy()

        self._reset_epoch_state()
        self.epoch = int(state["epoch"])
        if state["hot_rows"] is not None:
            self.set_hot(HotSet(array(state["hot_rows"]), array(state["hot_counts"]), self.table_offsets))
        self._base = None if state["base"] is None else state["base"].clone()
        self._updates = array(state["updates"])
        self._score = array(state["score"])
        self.rows_read = int(state["rows_read"])
        self._snap_prev = None if state["snap_prev"] is None else state["snap_prev"].clone()
        self._snap_cur = None if state["snap_cur"] is None else state["snap_cur"].clone()
        self._threshold = state["threshold"]
        res = state["threshold_result"]
        self.threshold_result = ThresholdResult(**res) if res else None
        self._stale_flags = array(state["stale_flags"]).astype(bool)
        self._fit_sample = array(state["fit_sample"])
        self._window_open = bool(state["window_open"])
        self._window_batches = int(state["window_batches"])
        self._since_snapshot = int(state["since_snapshot"])
        self._rechecks = int(state["rechecks"])
        self.guard.load_state_dict(state["guard"])
        self.epoch_counts = _Counters(**state["epoch_counts"])
        self.total = _Counters(**state["total"])

    def _require_hot(self) -> HotSet:
        if self.hot is None:
            raise InvalidInputError("call profile() before using the hot set")
        return self.hot


def _uniform(seed: int, positions: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) values for inputs at these positions of a run: splitmix64 of (seed, position).

    Stateless, so a resumed run draws exactly what the uninterrupted one drew for the same inputs.
    """
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) + np.uint64(_seed_mix(seed))
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _seed_mix(seed: int) -> int:
    return (seed * 0x632BE59BD9B4E019) % 2**64
