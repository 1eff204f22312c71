"""The skip guard's rule: lower the target D, or stop skipping, when a loss statistic drifts above a reference.
The skipper (``slipcache.staleness.skipping``) owns the guard and tells the detector the resulting target."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slipcache.errors import InvalidInputError

if TYPE_CHECKING:
    from slipcache.staleness.config import GuardConfig


@dataclass
class GuardDecision:
    """What one guard check concluded; ``action`` is one of none, lower, stop, raise, resume."""

    action: str
    target: float
    active: bool
    drift: float  # (loss - reference) / reference


class SkipGuard:
    """Lowers the skip target, or stops skipping, when the loss of skipped inputs drifts above a reference.

    The trainer's reference is the same inputs' loss when the epoch's skipping began (see
    ``slipcache.staleness.skipping``): Slipstream assumes stale inputs stay learned, and this checks it.
    Rule: ``drift = (loss - reference) / reference``. ``patience`` consecutive checks with
    ``drift > margin`` halve the target (``backoff``); if that would fall below ``min_target`` skipping
    stops. ``patience`` consecutive checks with ``drift < margin * release`` undo one step (resume,
    then double the target up to its base). Drift in between resets both streaks: that dead band is the
    hysteresis that keeps the guard from flapping around the margin.
    """

    def __init__(self, base_target: float, margin: float, release: float, patience: int, backoff: float,
                 min_target: float) -> None:
        self.base_target = base_target
        self.margin = margin
        self.release = release
        self.patience = patience
        self.backoff = backoff
        self.min_target = min_target
        self.target = base_target
        self.active = True
        self._bad = 0
        self._good = 0

    @classmethod
    def from_config(cls, config: GuardConfig, base_target: float) -> SkipGuard:
        return cls(base_target, config.margin, config.release, config.patience, config.backoff, config.min_target)

    def update(self, loss: float, reference: float) -> GuardDecision:
        """Feed one comparison (mean losses, same loss function) and apply the rule."""
        if not (math.isfinite(loss) and math.isfinite(reference)):
            raise InvalidInputError(f"guard losses must be finite, got {loss}, {reference}")
        drift = (loss - reference) / max(abs(reference), 1e-12)
        if drift > self.margin:
            self._bad, self._good = self._bad + 1, 0
        elif drift < self.margin * self.release:
            self._bad, self._good = 0, self._good + 1
        else:
            self._bad = self._good = 0

        action = "none"
        if self._bad >= self.patience:
            self._bad = 0
            if self.active:
                lowered = self.target * self.backoff
                if lowered < self.min_target:
                    self.active, action = False, "stop"
                else:
                    self.target, action = lowered, "lower"
        elif self._good >= self.patience:
            self._good = 0
            if not self.active:
                self.active, action = True, "resume"
            elif self.target < self.base_target:
                self.target, action = min(self.base_target, self.target / self.backoff), "raise"
        return GuardDecision(action, self.target, self.active, drift)

    def step_down(self, drift: float) -> GuardDecision:
        """One step down without waiting for ``patience`` checks: halve the target, or stop below the minimum."""
        self._bad = self._good = 0
        if not self.active:
            return GuardDecision("none", self.target, self.active, drift)
        lowered = self.target * self.backoff
        if lowered < self.min_target:
            self.active = False
            return GuardDecision("stop", self.target, self.active, drift)
        self.target = lowered
        return GuardDecision("lower", self.target, self.active, drift)

    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target, "active": self.active, "bad": self._bad, "good": self._good}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = float(state["target"])
        self.active = bool(state["active"])
        self._bad = int(state["bad"])
        self._good = int(state["good"])
