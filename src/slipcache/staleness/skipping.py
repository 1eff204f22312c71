"""Stale-input skipping inside the training loop: warm-up, the Slipstream cycle and the guard.

The training loop calls `StaleSkipper` through its callback (`training/skip_inputs.py`), at these hooks:

    skipper.start_epoch(epoch, batch_in_epoch)   before the epoch's BatchIterator is built
    BatchIterator(..., sample_filter=skipper.sample_filter)
    skipper.after_batch(batch, logits)           after every optimizer step
    skipper.after_eval(scores)                   after every periodic validation
    skipper.event_fields(...) / skipper.summary(...) / state_dict() / load_state_dict()

1. **Warm-up** (`stale_warmup`): nothing is profiled, measured or skipped until the model has learned.
   "val" (default): once the validation loss failed twice in a row to improve its best by `stale_warmup_tol`
   (relative), or from epoch `stale_warmup_epoch` (0-based; default 1 = the second epoch) or half of the
   run (`WARMUP_LATEST`), whichever comes first, at the latest; "epoch":
   from that epoch only; "none": from the start. In every mode never within the first `stale_warmup_min`
   (10 %) of the run's inputs. Why: the first window used to open at 2 % of epoch 1, judging rows of an
   untrained model; the authors open it after a full pass over the cold inputs.
2. **Profile and window**: when warm-up ends (and then at the start of each epoch) the hot rows are
   profiled and a window of `stale_window` of the epoch's batches trains normally while rows are measured.
3. **Threshold**: bisection on a sample of hot inputs so that `stale_target` (D) of them are stale.
4. **Filtered training**: the BatchIterator's sample filter drops stale inputs as batches are assembled.
   `stale_decision` "rolling" re-measures every window length and refits T; "epoch" is the authors' mode:
   one decision per epoch, fixed until the next.
5. **Guard**: `stale_keep` (5 %) of the would-be-skipped inputs are trained anyway, as a control group.
   Their training loss, relative to that of all trained inputs in the same batches, is followed: if it
   rises by more than the guard's margin (`GuardConfig.margin`, 10 %) against its value when skipping
   (re)started, on 2 consecutive checks, skipped inputs were still teaching (the rest of the model moved on
   without them) and D is halved, then skipping stops. At each validation, a drop of validation AUC by
   more than `VAL_DROP` below its best since skipping began lowers D at once. Every action is reported.
   The controls also keep stale rows receiving updates, so the convergence rule can notice one that moves
   again.

Exact resume: the filter records every keep decision of the epoch (one bit per input) and a checkpoint
holds them. BatchIterator re-runs the filter over the batches before `start_batch`; the resumed filter
replays the recorded bits there instead of deciding again with today's state, then decides live.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from slipcache.data.batches import Batch
from slipcache.data.dataset import SplitArrays
from slipcache.model import DLRM
from slipcache.staleness.calibration import LabelCounts
from slipcache.staleness.config import GuardConfig
from slipcache.staleness.detector import StaleInputDetector
from slipcache.staleness.guard import GuardDecision, SkipGuard

logger = logging.getLogger(__name__)

_STATE_VERSION = 4
THRESHOLD_SAMPLE_MIN = 4096
WARMUPS = ("val", "epoch", "none")
DECISIONS = ("rolling", "epoch")
CONTROL_MIN = 100  # controls needed before a check: fewer make the mean loss noise
VAL_DROP = 0.002  # validation AUC below its best since skipping began by this much lowers D
# "val" warm-up ends by this share of the run at the latest: a one-epoch run has no second epoch to fall back
# on, and in `--quick` the noisy 20 k-sample validation loss sometimes flattened only at the very end.
WARMUP_LATEST = 0.5
# profile: hot rows and the window's first read; filter: classifying inputs; counting: update counters of
# hot rows (convergence rule); snapshots: re-checks and threshold fits; guard: its bookkeeping.
OVERHEAD_PARTS = ("profile", "filter", "counting", "snapshots", "guard")


class StaleSkipper:
    """Runs warm-up and the Slipstream cycle of each epoch for the trainer; state_dict holds all of it."""

    def __init__(self, config: Any, model: DLRM, split: SplitArrays, batches_per_epoch: int) -> None:
        self.model = model
        self.coll = model.embeddings
        self.split = split
        self.batch_size = int(config.schedule.batch_size)
        # The detector's settings come from the config's fields; two follow from other settings.
        rule = "random" if config.skipping.skip_rule == "random" else config.skipping.stale_rule
        recheck = None if config.skipping.stale_decision == "epoch" else config.skipping.stale_recheck
        self.detector = StaleInputDetector.from_collection(
            self.coll, config.staleness_config(rule=rule, recheck_interval=recheck)
        )
        self.window = self.detector.window_batches(batches_per_epoch)
        self.guard = SkipGuard.from_config(GuardConfig(), float(config.skipping.stale_target))
        self.guard_every = int(config.skipping.stale_guard_every) if config.skipping.stale_guard else 0
        # p: share of the would-be-skipped inputs trained anyway (the guard's control group).
        self.control_share = float(config.skipping.stale_keep)
        if self.detector.config.rule == "random":
            # The equal-share control: every hot input is a candidate and D of them are skipped at random (the
            # kept share, 1 - D, reuses the stateless control draw); no guard, same schedule.
            self.control_share = 1.0 - float(config.skipping.stale_target)
            self.guard_every = 0
        self.refit = config.skipping.stale_decision == "rolling"
        self.warmup = str(config.skipping.stale_warmup)
        self.warmup_epoch = int(config.skipping.stale_warmup_epoch)
        self.warmup_floor = float(config.skipping.stale_warmup_min) * int(config.schedule.samples or 0)
        self.warmup_latest = WARMUP_LATEST * int(config.schedule.samples or 0)
        self.warmup_tol = float(config.skipping.stale_warmup_tol)
        self.epoch = 0
        self.batch = 0  # batches trained in the current epoch
        self.trained = 0  # inputs trained in the run
        self.warm = False
        self.warm_at: dict[str, Any] | None = None  # where and why warm-up ended
        self.val_flat = False
        self.flat_evals = 0  # consecutive evaluations without a gain of warmup_tol on the best loss
        self.best_val_loss: float | None = None
        self.best_val_auc: float | None = None  # since skipping began
        self.window_start: int | None = None  # batch of this epoch where its window opened
        self.decisions: list[np.ndarray] = []  # keep masks of this epoch, in filter-call order
        self._replay = np.zeros(0, dtype=bool)  # decisions to repeat after a resume
        self._replay_pos = 0
        self.guard_checks = 0
        self.guard_actions: list[dict[str, Any]] = []
        self._reported_actions = 0
        self.last_guard: GuardDecision | None = None
        self.control_sums = [0.0, 0, 0.0, 0]  # control loss, controls, all trained loss, trained (since check)
        # Control flags of the inputs the filter kept and no batch has trained yet, in order: batches are cut
        # from the kept inputs in order, so each trained batch takes the next batch_size of them.
        self.pending_controls = np.zeros(0, dtype=bool)
        self.control_reference: float | None = None  # controls' loss ratio when skipping (re)started
        self.overhead = dict.fromkeys(OVERHEAD_PARTS, 0.0)  # seconds spent on skipping, by part
        self.fits: list[dict[str, Any]] = []
        self.refits = 0
        self.label_counts = LabelCounts()  # is the skipped group label-skewed?

    # ---- hooks -----------------------------------------------------------------------------------------

    def start_epoch(self, epoch: int, batch_in_epoch: int) -> None:
        """New epoch: profile and open the window if warm, unless this is a resumed epoch already under way."""
        if batch_in_epoch > 0 and self.epoch == epoch and self.detector.epoch == epoch:
            return
        t0 = time.perf_counter()
        self.epoch = epoch
        self.detector.start_epoch(epoch)
        self.batch = 0
        self.window_start = None
        self.decisions, self._replay, self._replay_pos = [], np.zeros(0, dtype=bool), 0
        self.control_sums = [0.0, 0, 0.0, 0]
        self.control_reference = None
        self.pending_controls = np.zeros(0, dtype=bool)
        if self.warm or self._end_warmup("epoch start"):
            self._open_window()
        self.overhead["profile"] += time.perf_counter() - t0

    def sample_filter(self, sparse: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """BatchIterator filter: keep mask; replays recorded decisions first after a resume."""
        t0 = time.perf_counter()
        n = sparse.shape[0]
        if self._replay_pos < self._replay.size:  # these inputs' controls are in the restored pending_controls
            keep = self._replay[self._replay_pos : self._replay_pos + n]
            self._replay_pos += n  # counted before the checkpoint
        else:
            if self.window_start is None:  # warm-up: nothing to classify yet
                keep, control = self.detector.pass_through(n), np.zeros(n, dtype=bool)
            else:
                keep, control = self.detector.count_with_controls(sparse, self.control_share)
            self.pending_controls = np.concatenate([self.pending_controls, control[keep]])
            self.label_counts.add(keep, self.split.labels[positions] > 0.5)
        self.decisions.append(keep)
        self.overhead["filter"] += time.perf_counter() - t0
        return keep

    sample_filter.wants_positions = True  # type: ignore[attr-defined]

    def loss_weights(self, n: int) -> torch.Tensor | None:
        """None: every trained input weighs the same (the kept controls too; the loss rule weighs its own)."""
        return None

    def after_batch(self, batch: Batch, logits: torch.Tensor, loss: float | None = None) -> None:
        """Warm-up check, update counting, window close and threshold fit, re-checks, guard bookkeeping.

        ``loss``: the step's mean (weighted) loss, which spares the guard a per-input loss of the whole batch.
        """
        self.batch += 1
        n = int(batch.labels.shape[0])
        self.trained += n
        control, self.pending_controls = self.pending_controls[:n], self.pending_controls[n:]
        if self.window_start is None:
            if self._end_warmup("run position"):
                t0 = time.perf_counter()
                self._open_window()
                self.overhead["profile"] += time.perf_counter() - t0
            return
        det = self.detector
        t0 = time.perf_counter()
        if self.guard_every and det.skipping:
            self._account_controls(batch, logits, control, loss)
        t1 = time.perf_counter()
        det.record_updates(batch.sparse.numpy())
        t2 = time.perf_counter()
        rechecked = det.after_batch(self.coll)
        if self.batch == self.window_start + self.window:
            det.end_window(self.coll)
            self._fit()
            rechecked = True
        elif rechecked and self.refit:
            det.refit()
            self.refits += 1
        t3 = time.perf_counter()
        if self.guard_every and self.batch % self.guard_every == 0:
            self._control_check()
        t4 = time.perf_counter()
        self.overhead["counting"] += t2 - t1
        self.overhead["snapshots"] += t3 - t2
        self.overhead["guard"] += (t1 - t0) + (t4 - t3)

    def after_eval(self, scores: dict[str, Any]) -> None:
        """Validation results: warm-up ends when the loss flattened; the guard watches AUC once skipping."""
        loss, auc = float(scores["logloss"]), float(scores["auc"])
        if self.best_val_loss is not None and loss > self.best_val_loss * (1.0 - self.warmup_tol):
            self.flat_evals += 1
            self.val_flat = self.val_flat or self.flat_evals >= 2  # 2 in a row: one can be noise
        else:
            self.flat_evals = 0
        self.best_val_loss = loss if self.best_val_loss is None else min(loss, self.best_val_loss)
        det = self.detector
        if not (self.guard_every and det.skipping):
            return
        if self.best_val_auc is not None and auc < self.best_val_auc - VAL_DROP:
            self._record(self._apply(self.guard.step_down(auc - self.best_val_auc)), "validation")
            self.best_val_auc = auc  # the next step needs a new drop below this
        else:
            self.best_val_auc = auc if self.best_val_auc is None else max(auc, self.best_val_auc)

    @property
    def skipped_inputs(self) -> int:
        """Inputs not trained so far in the run: they count against the sample budget like trained ones."""
        return self.detector.total.skipped

    @property
    def overhead_s(self) -> float:
        return sum(self.overhead.values())

    # ---- pieces ----------------------------------------------------------------------------------------

    def _end_warmup(self, where: str) -> bool:
        """Has warm-up ended? Sets `warm` (for good) and records where and why."""
        if self.warm:
            return True
        position = self.trained + self.detector.total.skipped
        if position < self.warmup_floor:
            return False
        if self.warmup == "none":
            reason = "no warm-up"
        elif self.epoch >= self.warmup_epoch and self.warmup in ("val", "epoch"):
            reason = f"epoch {self.epoch}"
        elif self.warmup == "val" and self.val_flat:
            reason = "validation loss flattened"
        elif self.warmup == "val" and position >= self.warmup_latest:
            reason = f"{WARMUP_LATEST:.0%} of the run"
        else:
            return False
        self.warm = True
        self.warm_at = {"epoch": self.epoch, "batch": self.batch, "samples": position, "reason": reason,
                        "checked_at": where}
        return True

    def _open_window(self) -> None:
        """Profile the hot rows and start measuring them; skipping begins when the window closes."""
        det = self.detector
        n = len(self.split)
        sample = self.split.sparse[det.sample_indices(n, det.config.profile_fraction, "profile")]
        det.profile(sample)
        det.begin_window(self.coll)
        self.window_start = self.batch

    def _fit(self) -> None:
        """Sample the epoch's threshold inputs and fit T on the window so that D of the hot ones are stale.

        Re-checks refit on the same sample (`StaleInputDetector.refit`); their thresholds show in the events.
        """
        det = self.detector
        # At least THRESHOLD_SAMPLE_MIN inputs: the achieved ratio moves in steps of 1 / (hot inputs sampled).
        n = len(self.split)
        share = min(1.0, max(det.config.threshold_sample_fraction, THRESHOLD_SAMPLE_MIN / max(n, 1)))
        self._fit_on(self.split.sparse[det.sample_indices(n, share, "threshold")])

    def _fit_on(self, sample: np.ndarray) -> None:
        """Fit T on these sampled inputs and record the fit."""
        det = self.detector
        result = det.fit_threshold(sample)
        self.fits.append({"epoch": det.epoch, "batch": self.batch, "threshold": result.threshold,
                          "ratio": result.achieved_ratio, "converged": result.converged, "reason": result.reason})
        if result.threshold is None:
            # Silence here would read as "nothing was stale"; the usual cause is a common row that most hot
            # inputs share, whose change moves their share across the whole band at once.
            logger.warning(
                "stale skipping: no threshold makes %.0f %% of the sampled hot inputs stale (%s); this epoch "
                "skips nothing (summary.json's staleness.threshold_fits has each fit)",
                100 * result.target, result.reason,
            )

    def _account_controls(self, batch: Batch, logits: torch.Tensor, control: np.ndarray,
                          loss: float | None = None) -> None:
        """Add the batch's losses: the sum over its controls (as the filter marked them) and over all inputs.

        With the step's mean loss given, only the controls' losses are computed (a few % of the batch) and the
        batch's sum follows from the mean: n x mean.
        """
        n = int(batch.labels.shape[0])
        if control.size != n:  # cannot happen while batches are cut from the kept inputs in order
            raise RuntimeError(f"{control.size} control flags for a batch of {n}")
        idx = torch.from_numpy(np.flatnonzero(control))
        if loss is None:
            losses = F.binary_cross_entropy_with_logits(logits.detach(), batch.labels, reduction="none")
            control_loss, all_loss = float(losses[idx].sum()), float(losses.sum())
        else:
            control_loss = float(F.binary_cross_entropy_with_logits(
                logits.detach()[idx], batch.labels[idx], reduction="sum")) if idx.numel() else 0.0
            all_loss = n * loss
        sums = self.control_sums
        sums[0] += control_loss
        sums[1] += int(idx.numel())
        sums[2] += all_loss
        sums[3] += n

    def _control_check(self) -> None:
        """Compare the controls' loss ratio since the last check with the ratio when skipping (re)started."""
        control_loss, controls, all_loss, trained = self.control_sums
        if controls < CONTROL_MIN or not trained or not all_loss:
            return
        self.control_sums = [0.0, 0, 0.0, 0]
        ratio = (control_loss / controls) / (all_loss / trained)
        if self.control_reference is None:
            self.control_reference = ratio
            return
        decision = self._apply(self.guard.update(ratio, self.control_reference))
        self.guard_checks += 1
        self.last_guard = decision
        if decision.action != "none":
            self._record(decision, "control loss")
            self.control_reference = None  # a new D skips a different population: measure it afresh

    def _apply(self, decision: GuardDecision) -> GuardDecision:
        """Tell the detector the guard's target (it refits T when D changed) and whether skipping may go on."""
        self.detector.retarget(decision.target, decision.active)
        return decision

    def _record(self, decision: GuardDecision, source: str) -> None:
        if decision.action != "none":
            self.guard_actions.append({"epoch": self.epoch, "batch": self.batch, "samples": self.trained,
                                       "source": source, "action": decision.action, "target": decision.target,
                                       "drift": decision.drift})

    # ---- reporting -------------------------------------------------------------------------------------

    def event_fields(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        """Staleness keys merged into each metrics.jsonl train event; guard actions since the last event."""
        det = self.detector
        stats = det.stats()
        total = det.total
        saved = total.skipped * seconds_per_trained_sample - self.overhead_s
        new_actions = self.guard_actions[self._reported_actions :]
        self._reported_actions = len(self.guard_actions)
        return {
            "skipped_fraction": total.skipped / total.inputs if total.inputs else 0.0,
            "epoch_skipped_fraction": stats["skipped_fraction"],
            "hot_skipped_fraction": total.skipped_hot / total.hot_inputs if total.hot_inputs else 0.0,
            "inputs_skipped": total.skipped,
            "control_inputs": total.controls,
            "warm": self.warm,
            "hot_rows": stats["hot_rows"],
            "stale_rows": stats["stale_rows"],
            "unknown_rows": stats["unknown_rows"],
            "threshold": stats["threshold"],
            "stale_target": stats["target_drop"],
            "skipping": stats["skipping"],
            "guard_drift": self.last_guard.drift if self.last_guard else None,
            "guard_actions": new_actions,
            "skip_overhead_s": self.overhead_s,
            "time_saved_s": saved,
        }

    def summary(self, seconds_per_trained_sample: float) -> dict[str, Any]:
        """The summary.json `staleness` block."""
        total = self.detector.total
        stats = self.detector.stats()
        fields = self.event_fields(seconds_per_trained_sample)
        fields.pop("guard_actions")
        return {
            **fields,
            "rule": stats["rule"],
            "warmup": self.warmup,
            "warm_at": self.warm_at,
            "skip_overhead_parts_s": dict(self.overhead),
            "rows_read": stats["rows_read"],
            "index_bytes": stats["index_bytes"],
            "inputs_seen": total.inputs,
            "hot_inputs_seen": total.hot_inputs,
            "window_batches": self.window,
            "rechecks": stats["rechecks"],
            "guard_checks": self.guard_checks,
            "guard_actions": self.guard_actions,
            "guard_active": self.guard.active,
            "threshold_fits": self.fits,
            "threshold_refits": self.refits,
            "nonstale_hot_rows": stats["hot_rows"] - stats["stale_rows"],
            **self.label_counts.rates(),
            "speedup_bound": 1.0 / max(1.0 - (total.skipped / total.inputs if total.inputs else 0.0), 1e-9),
        }

    # ---- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        decisions = np.concatenate(self.decisions) if self.decisions else np.zeros(0, dtype=bool)
        return {
            "version": _STATE_VERSION,
            "detector": self.detector.state_dict(),
            "guard": self.guard.state_dict(),
            "epoch": self.epoch,
            "batch": self.batch,
            "trained": self.trained,
            "warm": self.warm,
            "warm_at": self.warm_at,
            "val_flat": self.val_flat,
            "flat_evals": self.flat_evals,
            "pending_controls": torch.from_numpy(np.packbits(self.pending_controls)),
            "num_pending_controls": int(self.pending_controls.size),
            "best_val_loss": self.best_val_loss,
            "best_val_auc": self.best_val_auc,
            "window_start": self.window_start,
            "decisions": torch.from_numpy(np.packbits(decisions)),
            "num_decisions": int(decisions.size),
            "guard_checks": self.guard_checks,
            "guard_actions": list(self.guard_actions),
            "reported_actions": self._reported_actions,
            "last_guard": None if self.last_guard is None else vars(self.last_guard).copy(),
            "control_sums": list(self.control_sums),
            "control_reference": self.control_reference,
            "overhead": dict(self.overhead),
            "fits": list(self.fits),
            "refits": self.refits,
            "label_counts": self.label_counts.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported skipping state version {state.get('version')}")
        self.detector.load_state_dict(state["detector"])
        self.guard.load_state_dict(state["guard"])
        for name in ("epoch", "batch", "trained", "guard_checks", "refits"):
            setattr(self, name, int(state[name]))
        self.warm, self.val_flat = bool(state["warm"]), bool(state["val_flat"])
        self.warm_at = state["warm_at"]
        self.flat_evals = int(state["flat_evals"])
        bits = np.unpackbits(state["pending_controls"].numpy(), count=int(state["num_pending_controls"]))
        self.pending_controls = bits.astype(bool)
        self.best_val_loss, self.best_val_auc = state["best_val_loss"], state["best_val_auc"]
        self.window_start = state["window_start"]
        bits = np.unpackbits(state["decisions"].numpy(), count=int(state["num_decisions"]))
        self._replay, self._replay_pos = bits.astype(bool), 0
        self.decisions = []
        self.guard_actions = list(state["guard_actions"])
        self._reported_actions = int(state["reported_actions"])
        self.last_guard = GuardDecision(**state["last_guard"]) if state["last_guard"] else None
        self.control_sums = list(state["control_sums"])
        self.control_reference = state["control_reference"]
        self.overhead = {part: float(state["overhead"].get(part, 0.0)) for part in OVERHEAD_PARTS}
        self.fits = list(state["fits"])
        self.label_counts.load_state_dict(state.get("label_counts"))  # absent in older checkpoints
