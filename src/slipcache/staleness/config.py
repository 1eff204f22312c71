"""The staleness detector's settings and the skip guard's, with the one set of defaults the trainer's
``stale_*`` fields take theirs from (``slipcache.training.config.TrainConfig``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipcache.errors import InvalidInputError

__all__ = ["RULES", "GuardConfig", "StalenessConfig"]

RULES = ("paper", "convergence")


@dataclass
class StalenessConfig:
    """Every Slipstream constant as a parameter (Criteo, 26 tables); the trainer's defaults.

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
    rule: str = "convergence"  # "convergence" (change per update, measured rows) or "paper" (L-inf change)
    min_updates: int = 4  # convergence rule: updates a row needs before its change is judged
    count_share: float = 0.25  # convergence rule: share of each trained batch whose lookups are counted
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
        if self.rule not in RULES:
            raise InvalidInputError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if isinstance(self.min_updates, bool) or self.min_updates < 1:
            raise InvalidInputError(f"min_updates must be a positive int, got {self.min_updates}")
        if not 0.0 < self.count_share <= 1.0:
            raise InvalidInputError(f"count_share must be in (0, 1], got {self.count_share}")

    def required_stale(self, num_tables: int) -> int:
        """Number of stale lookups (out of ``num_tables``) that makes an input skippable."""
        if self.alpha_count is not None:
            if self.alpha_count > num_tables:
                raise InvalidInputError(f"alpha_count {self.alpha_count} exceeds the {num_tables} lookups per input")
            return self.alpha_count
        # The epsilon keeps 0.5 * 26 at 13 despite float rounding.
        return max(1, math.ceil(self.alpha * num_tables - 1e-9))


@dataclass
class GuardConfig:
    """The skip guard's rule (``slipcache.staleness.guard.SkipGuard``); the skipper owns the guard.

    A relative rise of the controls' loss ratio above ``margin`` counts as "still teaching": its noise with
    100-400 controls per check is a few %, and 10 % on ``patience`` consecutive checks does not fire on noise.
    """

    margin: float = 0.10  # relative rise of the statistic that counts as drift
    release: float = 0.5  # drift must fall below margin * release to relax (hysteresis)
    patience: int = 2  # consecutive checks needed before acting, either way
    backoff: float = 0.5  # target multiplier on drift (halve D)
    min_target: float = 0.05  # below this the guard stops skipping instead

    def __post_init__(self) -> None:
        if self.margin < 0.0 or not 0.0 <= self.release <= 1.0:
            raise InvalidInputError("guard margin must be >= 0 and release in [0, 1]")
        if self.patience < 1 or not 0.0 < self.backoff < 1.0:
            raise InvalidInputError("need guard patience >= 1 and backoff in (0, 1)")
