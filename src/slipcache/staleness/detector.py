"""Slipstream-style stale-input skipping (Maboud et al., arXiv 2404.04270): hot rows, flags, threshold, filter.

Hot embedding rows converge early; an input whose lookups all hit rows that no longer move adds little to
training, so the trainer may skip it. Per epoch:

1. ``profile``: count row accesses on a sample of inputs; the hot set is the most-accessed rows fitting a
   byte budget. An input is *hot* when every lookup is a hot row (at least alpha of them, when alpha < 1).
2. ``begin_window`` / ``end_window``: measure the hot rows (only those) around a window of normal training.
3. ``row_score``: per hot row, the configured rule's score (``slipcache.staleness.rules``: the paper's
   L-infinity change, or change per update); a row is stale under threshold ``T`` when its score is below.
4. ``fit_threshold``: bisection on ``T`` (``slipcache.staleness.threshold.fit_threshold``) so that the stale
   fraction of a sample of hot inputs lands in ``target +- tolerance``; when unreachable, skip nothing.
5. ``stale_mask`` / ``sample_filter``: an input is skipped when at least alpha of its lookups are stale.

Beyond the paper: ``after_batch`` re-measures every K batches so a row that moves again stops being stale.
The skip guard lives with the skipper (``slipcache.staleness.skipping``), which sets the detector's
``target`` and ``active`` through ``retarget``.

Memory: measurements and counts are proportional to the hot set; the input filter also reads one flag byte
per row of every table (hot, stale), because a direct index is much faster than a search of the hot rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from slipcache.errors import InvalidInputError
from slipcache.staleness.config import StalenessConfig
from slipcache.staleness.filtering import Counters as _Counters
from slipcache.staleness.filtering import classify, filter_inputs, lookup_flags
from slipcache.staleness.hotset import HotSet, _check_ids, _global_rows, _to_numpy, select_hot
from slipcache.staleness.rules import EmbeddingRowSource, make_rule
from slipcache.staleness.threshold import ThresholdResult, fit_threshold

__all__ = ["EmbeddingRowSource", "HotSet", "StaleInputDetector", "StalenessConfig", "ThresholdResult"]

_STATE_VERSION = 3


class StaleInputDetector:
    """Drives one Slipstream cycle per epoch; the trainer calls it between batches (see module docstring)."""

    _flagged: np.ndarray | None  # the rows whose flag bytes may be non-zero

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
        self.rule = make_rule(config)
        self.target = float(config.target_drop)  # D; the skipper's guard lowers it (``retarget``)
        self.active = True  # False: the skipper's guard stopped skipping
        self._reset_epoch_state()
        self.total = _Counters()

    @classmethod
    def from_collection(cls, coll: EmbeddingRowSource, config: StalenessConfig | None = None) -> StaleInputDetector:
        return cls(config or StalenessConfig(), coll.table_offsets, int(coll.dim))

    @property
    def num_tables(self) -> int:
        return int(self.table_offsets.size - 1)

    @property
    def _stale_flags(self) -> np.ndarray:
        """bool, aligned with hot.rows."""
        return self._stale_aligned

    @_stale_flags.setter
    def _stale_flags(self, flags: np.ndarray) -> None:
        """Also refresh the per-row flag bytes the input filter reads (``slipcache.staleness.filtering``)."""
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
        self._flagged = None
        self._fit_positions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (sample, pos, hit) memo
        self.hot: HotSet | None = None
        self.threshold_result: ThresholdResult | None = None
        self._threshold: float | None = None
        self._stale_flags = np.zeros(0, dtype=bool)  # aligned with hot.rows
        self._fit_sample: np.ndarray | None = None  # hot inputs kept for refits after guard actions
        self._window_open = False
        self._window_batches = 0
        self._since_snapshot = 0
        self._rechecks = 0
        self.epoch_counts = _Counters()
        self.rule.reset(None)
        self.rows_read = 0  # hot rows copied by snapshots and measurements this epoch

    def start_epoch(self, epoch: int) -> None:
        """Forget last epoch's hot set, measurements and threshold; the target and totals carry over."""
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

    def profile(self, sparse_sample: np.ndarray | torch.Tensor) -> HotSet:
        """The hot set of a sample of inputs (``slipcache.staleness.hotset.select_hot``: the budget's most
        accessed rows, or FAE's access-count threshold)."""
        cfg = self.config
        self.set_hot(select_hot(sparse_sample, self.table_offsets, cfg.max_hot_rows(int(self.table_offsets[-1]),
                                self.dim), cfg.hot_set, cfg.hot_min_rate, cfg.seed))
        return self._require_hot()

    def set_hot(self, hot: HotSet) -> None:
        """Install a hot set (from ``profile`` or a filtered one) and clear what was measured on the last."""
        self.hot = hot
        self._stale_flags = np.zeros(len(hot), dtype=bool)
        self.rule.reset(hot)

    def hot_input_mask(self, sparse: np.ndarray | torch.Tensor) -> np.ndarray:
        """bool[n]: hot inputs, those with at least alpha of their lookups hot (all False before ``profile``).

        With alpha = 1 (the paper) every lookup must be hot. Only hot inputs can ever be skipped, so they are
        what the target D is a share of.
        """
        return self._classify(sparse)[1]

    def _reader(self, coll: EmbeddingRowSource) -> Callable[[np.ndarray], torch.Tensor]:
        return lambda rows: self._read(coll, rows)

    def _read(self, coll: EmbeddingRowSource, rows: np.ndarray) -> torch.Tensor:
        values = coll.read_rows(torch.from_numpy(rows))
        if tuple(values.shape) != (rows.size, self.dim):
            raise InvalidInputError(f"read_rows returned {tuple(values.shape)}, expected {(rows.size, self.dim)}")
        self.rows_read += int(rows.size)
        # Clone: a collection may hand back a view of rows that training keeps mutating.
        return values.detach().to(device="cpu", dtype=torch.float32).clone()

    def begin_window(self, coll: EmbeddingRowSource) -> None:
        """Measure the hot rows before the window of normal training."""
        self.rule.begin_window(self._reader(coll), self._require_hot())
        self._window_open = True
        self._since_snapshot = 0

    def end_window(self, coll: EmbeddingRowSource) -> np.ndarray:
        """Measure the hot rows after the window; returns the rule's per-row score."""
        if not self._window_open:
            raise InvalidInputError("end_window called without begin_window")
        self.rule.end_window(self._reader(coll), self._require_hot())
        self._window_open = False
        self._window_batches = self._since_snapshot
        self._since_snapshot = 0
        self._refresh_flags()
        return self.row_score()

    @property
    def window_done(self) -> bool:
        """True once the first window of the epoch closed: re-checks and fits can run."""
        return self.rule.measured() and not self._window_open

    def record_updates(self, sparse: np.ndarray | torch.Tensor) -> None:
        """Convergence rule: count one update of each hot row per trained input that looks it up.

        Each input adds one gradient term to each of its rows, so this counts gradient contributions. Call it
        with every trained batch while a window or span is open; a no-op under the paper's rule. With
        ``count_share`` < 1 only the batch's first inputs are counted (a random sample: batches are shuffled)
        and counts are scaled up when judged: the hash lookups are most of the bookkeeping's cost. A row
        counted at all was updated at least once, so a row never updated still stays unknown.
        """
        self.rule.record_updates(sparse, self.table_offsets, self._row_flags)

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
        self.rule.recheck(self._reader(coll), self._require_hot())
        self._since_snapshot = 0
        self._rechecks += 1
        self._refresh_flags()

    def _recheck_interval(self) -> int | None:
        interval = self.config.recheck_interval
        if interval == 0:  # match the window so changes are comparable with the fitted threshold
            interval = self._window_batches or None
        return interval

    def row_change(self) -> torch.Tensor:
        """float32 [hot rows]: largest per-dimension change between the latest two snapshots (paper rule)."""
        if not hasattr(self.rule, "row_change"):
            raise InvalidInputError("row_change needs two snapshots (begin_window, end_window)")
        return self.rule.row_change()

    def row_score(self) -> np.ndarray:
        """float32 [hot rows]: what the threshold is compared with under the configured rule.

        paper: the L-inf change between the latest two snapshots; convergence: change per update relative
        to the row's scale, inf for rows not yet measured (never stale).
        """
        return self.rule.score()

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
        return self._fit(self.target)

    def refit(self) -> ThresholdResult:
        """Refit T on the latest snapshot pair, with the inputs sampled by the last ``fit_threshold``.

        Cheap enough to run at every rolling re-check: the sample's rows are located in the hot set once.
        """
        if self._fit_sample is None:
            raise InvalidInputError("refit needs a sample: call fit_threshold first")
        return self._fit(self.target)

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
        fixed = getattr(self.rule, "fixed_threshold", None)
        if fixed is not None:  # the random control: every hot input is a candidate, no bisection
            self.threshold_result = ThresholdResult(fixed, 1.0, 0, True, target, int(sample.shape[0]), "fixed")
        else:
            keys = self._input_keys(sample)
            self.threshold_result = fit_threshold(keys, target, cfg.tolerance, cfg.threshold_low,
                                                  cfg.threshold_high, cfg.max_bisection_steps,
                                                  relative=self.rule.relative)
        self._threshold = self.threshold_result.threshold
        self._refresh_flags()
        return self.threshold_result

    @property
    def skipping(self) -> bool:
        """True when a threshold was found and the skipper's guard allows skipping."""
        return self._threshold is not None and self.active

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
        return lookup_flags(sparse, self.table_offsets, self._row_flags)

    def _classify(self, sparse: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(stale: at least alpha lookups stale, hot: at least alpha lookups hot), bool[n] each."""
        return classify(sparse, self.table_offsets, self._row_flags, self.config.required_stale(self.num_tables))

    def count(self, sparse: np.ndarray | torch.Tensor, control_share: float = 0.0) -> np.ndarray:
        """Classify for skipping and record the counts for ``stats``; returns the keep mask."""
        return self.count_with_controls(sparse, control_share)[0]

    def count_with_controls(self, sparse: np.ndarray | torch.Tensor,
                            control_share: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(keep, control): ``count``, and which kept inputs are controls.

        ``control_share``: that share of the would-be-skipped inputs is kept anyway (the guard's control
        group), chosen by a hash of the input's position in the run, so the choice needs no RNG state.
        """
        keep, control, num_hot, num_would_skip, num_control = filter_inputs(
            sparse, self.table_offsets, self._row_flags, self.config.required_stale(self.num_tables), self.skipping,
            control_share, self.config.seed, self.total.inputs)
        self._add_counts(keep.size, num_hot, num_would_skip - num_control, num_control)
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

    def retarget(self, target: float, active: bool) -> None:
        """A new D (refit T when it changed and a sample exists) and whether skipping is allowed at all."""
        changed = target != self.target
        self.target, self.active = float(target), bool(active)
        if changed and self._fit_sample is not None:
            self._fit(self.target)

    def stats(self) -> dict[str, Any]:
        """Flat JSON-ready metrics for metrics.jsonl."""
        res = self.threshold_result
        ep = self.epoch_counts
        rule_stats = self.rule.stats()
        return {
            "epoch": self.epoch,
            "hot_rows": len(self.hot) if self.hot is not None else 0,
            "hot_bytes": (len(self.hot) if self.hot is not None else 0) * self.dim * 4,
            "flag_bytes": int(self._row_flags.nbytes),
            "index_bytes": rule_stats["index_bytes"],
            "rule": self.config.rule,
            "stale_rows": int(np.count_nonzero(self._stale_flags)),
            "unknown_rows": rule_stats["unknown_rows"],
            "rows_read": self.rows_read,
            "threshold": self._threshold,
            "threshold_converged": res.converged if res else False,
            "threshold_steps": res.steps if res else 0,
            "threshold_ratio": res.achieved_ratio if res else None,
            "threshold_reason": res.reason if res else "",
            "target_drop": self.target,
            "skipping": self.skipping,
            "active": self.active,
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

        return {
            "version": _STATE_VERSION,
            "config": asdict(self.config),
            "table_offsets": tensor(self.table_offsets),
            "dim": self.dim,
            "epoch": self.epoch,
            "hot_rows": tensor(self.hot.rows) if self.hot is not None else None,
            "hot_counts": tensor(self.hot.counts) if self.hot is not None else None,
            "rule": self.rule.state_dict(),
            "threshold": self._threshold,
            "threshold_result": asdict(self.threshold_result) if self.threshold_result else None,
            "stale_flags": tensor(self._stale_flags),
            "fit_sample": tensor(self._fit_sample),
            "window_open": self._window_open,
            "window_batches": self._window_batches,
            "since_snapshot": self._since_snapshot,
            "rechecks": self._rechecks,
            "rows_read": self.rows_read,
            "target": self.target,
            "active": self.active,
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

        def array(t: torch.Tensor) -> np.ndarray:
            return t.numpy().copy()

        def maybe_array(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else array(t)

        self._reset_epoch_state()
        self.epoch = int(state["epoch"])
        if state["hot_rows"] is not None:
            self.set_hot(HotSet(array(state["hot_rows"]), array(state["hot_counts"]), self.table_offsets))
        self.rule.load_state_dict(state["rule"])
        self.rows_read = int(state["rows_read"])
        self._threshold = state["threshold"]
        res = state["threshold_result"]
        self.threshold_result = ThresholdResult(**res) if res else None
        self._stale_flags = array(state["stale_flags"]).astype(bool)
        self._fit_sample = maybe_array(state["fit_sample"])
        self._window_open = bool(state["window_open"])
        self._window_batches = int(state["window_batches"])
        self._since_snapshot = int(state["since_snapshot"])
        self._rechecks = int(state["rechecks"])
        self.target, self.active = float(state["target"]), bool(state["active"])
        self.epoch_counts = _Counters(**state["epoch_counts"])
        self.total = _Counters(**state["total"])

    def _require_hot(self) -> HotSet:
        if self.hot is None:
            raise InvalidInputError("call profile() before using the hot set")
        return self.hot

