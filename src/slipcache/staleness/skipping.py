"""Stale-input skipping inside the training loop: the per-epoch Slipstream protocol around `StaleInputDetector`.

The trainer calls `StaleSkipper` through four hooks (see `slipcache.training.trainer.train`):

    skipper.start_epoch(epoch, batch_in_epoch)   before the epoch's BatchIterator is built
    BatchIterator(..., sample_filter=skipper.sample_filter)
    skipper.after_batch()                        after every optimizer step
    skipper.event_fields(...) / skipper.summary(...) / state_dict() / load_state_dict()

One epoch, in a single pass over the data (so a one-epoch run can skip too):

1. profile: count row accesses on `profile_fraction` of the split; hot rows are the most accessed that fit
   `stale_budget_mb`, minus rows too rare to be touched during a window (see `_keep_frequent`);
2. window: the epoch's first `stale_window` share of batches trains normally between two snapshots of the
   hot rows; these batches are at the start of the epoch, so the rest of the epoch can skip;
3. threshold: bisection on a sample of hot inputs so that `stale_target` (D) of them are stale;
4. filtered training: the BatchIterator's sample filter drops stale inputs as batches are assembled, so
   batches stay full and a skipped input never reaches forward or backward. Every K batches a rolling
   snapshot recomputes which rows are stale, and (`stale_refit`, default on) the threshold is refitted on
   that pair: embeddings of a young model speed up after the window, so a threshold fitted once on the
   window pair skipped 0.7 % instead of D * hot share (~9 %) in `--quick`. When the window closes the guard
   records the loss of a fixed sample of training inputs (forward only, eval mode, no_grad: the cache and the
   weights are untouched); every G batches it evaluates those of them the detector now skips and lowers D (or
   stops skipping) when their loss has risen above the recorded one by the margin. Each input is compared
   with itself, so the check is not fooled by skipped inputs being easier than trained ones, and its noise
   is that of a change, not of a population.

Exact resume: the filter records every keep decision of the epoch (one bit per input) and a checkpoint
holds them. BatchIterator re-runs the filter over the batches before `start_batch`; the resumed filter
replays the recorded bits there instead of deciding again with today's state, then decides live.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from slipcache.data.dataset import SplitArrays
from slipcache.model import DLRM
from slipcache.staleness.detector import GuardDecision, HotSet, StaleInputDetector, StalenessConfig

_STATE_VERSION = 2
THRESHOLD_SAMPLE_MIN = 4096
# profile: hot rows and the window's first snapshot; filter: classifying inputs; snapshots: re-checks,
# threshold fits and cache release; guard: its forward passes.
OVERHEAD_PARTS = ("profile", "filter", "snapshots", "guard")


class StaleSkipper:
    """Runs the Slipstream cycle of each epoch for the trainer; all state needed to resume is in state_dict."""

    def __init__(self, config: Any, model: DLRM, split: SplitArrays, batches_per_epoch: int) -> None:
        self.model = model
        self.coll = model.embeddings
        self.split = split
        self.batch_size = int(config.batch_size)
        self.detector = StaleInputDetector.from_collection(
            self.coll,
            StalenessConfig(
                target_drop=config.stale_target,
                alpha=config.stale_alpha,
                window_fraction=config.stale_window,
                recheck_interval=config.stale_recheck,
                memory_budget_bytes=int(config.stale_budget_mb * 2**20),
                seed=config.seed,
            ),
        )
        self.window = self.detector.window_batches(batches_per_epoch)
        self.guard_every = int(config.stale_guard_every) if config.stale_guard else 0
        self.release_cache = bool(config.stale_release_cache) and hasattr(self.coll, "release_rows")
        self.min_accesses = float(config.stale_min_accesses)
        self.refit = bool(config.stale_refit)
        self.batch = 0  # batches trained in the current epoch
        self.decisions: list[np.ndarray] = []  # keep masks of this epoch, in filter-call order
        self._replay = np.zeros(0, dtype=bool)  # decisions to repeat after a resume
        self._replay_pos = 0
        self.released_rows = 0
        self.guard_checks = 0
        self.guard_actions: list[dict[str, Any]] = []
        self.last_guard: GuardDecision | None = None
        self.guard_sample = np.zeros(0, dtype=np.int64)  # the epoch's guard inputs (split indices)
        self.guard_reference = np.zeros(0, dtype=np.float32)  # their loss when the window closed
        self.overhead = dict.fromkeys(OVERHEAD_PARTS, 0.0)  # seconds spent on skipping, by part
        self.fits: list[dict[str, Any]] = []
        self.refits = 0

    # ---- hooks -----------------------------------------------------------------------------------------

    def start_epoch(self, epoch: int, batch_in_epoch: int) -> None:
        """Profile and open the snapshot window, unless this is a resumed epoch already under way."""
        if batch_in_epoch > 0 and self.detector.epoch == epoch and self.detector.hot is not None:
            return
        t0 = time.perf_counter()
        det = self.detector
        det.start_epoch(epoch)
        self.batch = 0
        self.decisions, self._replay, self._replay_pos = [], np.zeros(0, dtype=bool), 0
        n = len(self.split)
        sample = self.split.sparse[det.sample_indices(n, det.config.profile_fraction, "profile")]
        det.profile(sample)
        self._keep_frequent(sample_share=len(sample) / max(n, 1))
        det.begin_window(self.coll)
        self.overhead["profile"] += time.perf_counter() - t0

    def sample_filter(self, sparse: np.ndarray) -> np.ndarray:
        """BatchIterator filter: keep mask; replays recorded decisions first after a resume."""
        t0 = time.perf_counter()
        n = sparse.shape[0]
        if self._replay_pos < self._replay.size:
            keep = self._replay[self._replay_pos : self._replay_pos + n]
            self._replay_pos += n
        else:
            keep = self.detector.count(sparse)
        self.decisions.append(keep)
        self.overhead["filter"] += time.perf_counter() - t0
        return keep

    def after_batch(self) -> None:
        """Close the window and fit the threshold, rolling re-checks, cache release and guard checks."""
        t0 = time.perf_counter()
        det = self.detector
        self.batch += 1
        rechecked = det.after_batch(self.coll)
        if self.batch == self.window:
            det.end_window(self.coll)
            self._fit()
            rechecked = True
        elif rechecked and self.refit:
            self.detector.refit()
            self.refits += 1
        if rechecked and self.release_cache and det.skipping:
            self.released_rows += int(self.coll.release_rows(torch.from_numpy(det.stale_rows())))
        t1 = time.perf_counter()
        self.overhead["snapshots"] += t1 - t0
        if self.guard_every and self.batch == self.window:
            self.guard_sample = det.guard_indices(len(self.split))
            self.guard_reference = self._losses(self.guard_sample)
        if self.guard_every and det.threshold is not None and self.batch % self.guard_every == 0:
            self._guard_check()
        self.overhead["guard"] += time.perf_counter() - t1

    @property
    def overhead_s(self) -> float:
        return sum(self.overhead.values())

    # ---- pieces ----------------------------------------------------------------------------------------

    def _fit(self) -> None:
        """Sample the epoch's threshold inputs and fit T on the window pair so that D of the hot ones are stale.

        Re-checks refit on the same sample (`StaleInputDetector.refit`); their thresholds show in the events.
        """
        det = self.detector
        # At least THRESHOLD_SAMPLE_MIN inputs: the achieved ratio moves in steps of 1 / (hot inputs sampled).
        n = len(self.split)
        share = min(1.0, max(det.config.threshold_sample_fraction, THRESHOLD_SAMPLE_MIN / max(n, 1)))
        result = det.fit_threshold(self.split.sparse[det.sample_indices(n, share, "threshold")])
        self.fits.append({"epoch": det.epoch, "threshold": result.threshold, "ratio": result.achieved_ratio,
                          "converged": result.converged, "reason": result.reason})

    def _keep_frequent(self, sample_share: float) -> None:
        """Drop hot rows expected to be accessed fewer than `stale_min_accesses` times in a window.

        A row untouched between two snapshots has change 0 and would look converged when it was merely not
        sampled; rare rows are the ones that still need training, so by default they are never hot.
        """
        det = self.detector
        hot = det.hot
        if hot is None or not len(hot):
            return
        window_inputs = self.window * self.batch_size
        expected = hot.counts / max(sample_share, 1e-12) * window_inputs / max(len(self.split), 1)
        keep = expected >= self.min_accesses
        if not keep.all():
            det.hot = HotSet(hot.rows[keep], hot.counts[keep], det.table_offsets)
            det._stale_flags = np.zeros(len(det.hot), dtype=bool)

    @torch.no_grad()
    def _losses(self, idx: np.ndarray) -> np.ndarray:
        """Per-input BCE of training inputs `idx`, forward only in eval mode (no cache or weight change)."""
        dense = torch.from_numpy(np.ascontiguousarray(self.split.dense[idx]))
        sparse = torch.from_numpy(self.split.sparse[idx].astype(np.int64))
        labels = torch.from_numpy(np.ascontiguousarray(self.split.labels[idx]))
        was_training = self.model.training
        self.model.eval()
        try:
            logits = self.model(dense, sparse)
            return F.binary_cross_entropy_with_logits(logits, labels, reduction="none").numpy()
        finally:
            self.model.train(was_training)

    def _guard_check(self) -> None:
        """Has the loss of the guard inputs now skipped risen since the window closed? Forward only.

        With fewer than `guard_min_skipped` of them the mean is noise (at D = 0.1 on 320 k rows, ~60 inputs
        gave a drift of +0.26 and halved D), and skipping that few inputs cannot cost much: no check.
        """
        det = self.detector
        stale = det.stale_mask(self.split.sparse[self.guard_sample])
        if np.count_nonzero(stale) < det.config.guard_min_skipped:
            return
        loss = float(self._losses(self.guard_sample[stale]).mean())
        decision = det.update_guard(loss, float(self.guard_reference[stale].mean()))
        self.guard_checks += 1
        self.last_guard = decision
        if decision.action != "none":
            self.guard_actions.append({"epoch": det.epoch, "batch": self.batch, "action": decision.action,
                                       "target": decision.target, "drift": decision.drift})

    # ---- reporting -------------------------------------------------------------------------------------

    def event_fields(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        """Staleness keys merged into each metrics.jsonl train event."""
        det = self.detector
        stats = det.stats()
        total = det.total
        saved = total.skipped * seconds_per_trained_sample - self.overhead_s
        return {
            "skipped_fraction": total.skipped / total.inputs if total.inputs else 0.0,
            "epoch_skipped_fraction": stats["skipped_fraction"],
            "hot_skipped_fraction": total.skipped_hot / total.hot_inputs if total.hot_inputs else 0.0,
            "inputs_skipped": total.skipped,
            "hot_rows": stats["hot_rows"],
            "stale_rows": stats["stale_rows"],
            "threshold": stats["threshold"],
            "stale_target": stats["target_drop"],
            "skipping": stats["skipping"],
            "guard_drift": self.last_guard.drift if self.last_guard else None,
            "released_rows": self.released_rows,
            "skip_overhead_s": self.overhead_s,
            "time_saved_s": saved,
        }

    def summary(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        """The summary.json `staleness` block."""
        total = self.detector.total
        return {
            **self.event_fields(seconds_per_trained_sample),
            "skip_overhead_parts_s": dict(self.overhead),
            "inputs_seen": total.inputs,
            "hot_inputs_seen": total.hot_inputs,
            "window_batches": self.window,
            "rechecks": self.detector.stats()["rechecks"],
            "guard_checks": self.guard_checks,
            "guard_actions": self.guard_actions,
            "guard_active": self.detector.guard.active,
            "threshold_fits": self.fits,
            "threshold_refits": self.refits,
            "speedup_bound": 1.0 / max(1.0 - (total.skipped / total.inputs if total.inputs else 0.0), 1e-9),
        }

    # ---- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        decisions = np.concatenate(self.decisions) if self.decisions else np.zeros(0, dtype=bool)
        return {
            "version": _STATE_VERSION,
            "detector": self.detector.state_dict(),
            "batch": self.batch,
            "decisions": torch.from_numpy(np.packbits(decisions)),
            "num_decisions": int(decisions.size),
            "released_rows": self.released_rows,
            "guard_checks": self.guard_checks,
            "guard_actions": list(self.guard_actions),
            "last_guard": None if self.last_guard is None else vars(self.last_guard).copy(),
            "guard_sample": torch.from_numpy(self.guard_sample),
            "guard_reference": torch.from_numpy(self.guard_reference),
            "overhead": dict(self.overhead),
            "fits": list(self.fits),
            "refits": self.refits,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported skipping state version {state.get('version')}")
        self.detector.load_state_dict(state["detector"])
        self.batch = int(state["batch"])
        bits = np.unpackbits(state["decisions"].numpy(), count=int(state["num_decisions"]))
        self._replay, self._replay_pos = bits.astype(bool), 0
        self.decisions = []
        self.released_rows = int(state["released_rows"])
        self.guard_checks = int(state["guard_checks"])
        self.guard_actions = list(state["guard_actions"])
        self.last_guard = GuardDecision(**state["last_guard"]) if state["last_guard"] else None
        self.guard_sample = state["guard_sample"].numpy().copy()
        self.guard_reference = state["guard_reference"].numpy().copy()
        self.overhead = {part: float(state["overhead"][part]) for part in OVERHEAD_PARTS}
        self.fits = list(state["fits"])
        self.refits = int(state["refits"])

