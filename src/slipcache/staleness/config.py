"""The staleness detector's settings and the skip guard's, with the one set of defaults and ranges the
trainer's ``stale_*`` settings take theirs from (``slipcache.training.parts.SkippingSettings``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipcache.errors import InvalidInputError, SettingError

__all__ = ["DETECTOR_RULES", "HOT_SETS", "ORDERS", "RULES", "SKIP_RULES", "SKIP_RULE_HELP",
           "STALE_PRESETS", "WINDOW_COUNTS", "GuardConfig", "StalenessConfig", "preset_help"]

RULES = ("paper", "convergence")  # staleness rules a user picks (`--stale-rule`)
DETECTOR_RULES = (*RULES, "random")  # and the random control (`--skip-rule random`)
HOT_SETS = ("budget", "frequency")  # the most accessed rows fitting the budget, or an access-count threshold
ORDERS = ("data", "cold_first")  # `input_order`: the data's own order, or FAE's cold inputs first
WINDOW_COUNTS = ("epoch", "hot")  # `stale_window_count`: what the window's position and length are shares of


@dataclass
class StalenessConfig:
    """Every Slipstream constant as a parameter (Criteo, 26 tables); the trainer's defaults.

    ``alpha`` is a fraction of an input's lookups (1.0 = all of them). ``alpha_count``, when set, replaces it
    with an absolute number of lookups; the two are separate fields so a YAML ``1`` can never silently mean
    "one lookup" instead of "all lookups".
    """

    profile_fraction: float = 0.05  # share of training inputs sampled to count row accesses
    memory_budget_bytes: int = 256 * 2**20  # hot set size: rows * dim * 4 <= budget
    hot_share: float | None = None  # hot set size as a share of all rows; replaces the budget when set
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
    hot_set: str = "budget"  # "budget": most accessed rows that fit; "frequency": FAE's access-count threshold
    hot_min_rate: float = 1e-4  # "frequency": hot rows are looked up by at least this share of sampled inputs
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
                raise SettingError(name, f"{name} must be in (0, 1], got {value}")
        if not 0.0 < self.alpha <= 1.0:
            raise SettingError("alpha", f"alpha is a fraction in (0, 1], got {self.alpha}; use alpha_count for a count")
        if self.alpha_count is not None and (isinstance(self.alpha_count, bool) or self.alpha_count < 1):
            raise InvalidInputError(f"alpha_count must be a positive int, got {self.alpha_count}")
        if not 0.0 <= self.target_drop <= 1.0:
            raise SettingError("target_drop", f"target_drop must be in [0, 1], got {self.target_drop}")
        if self.tolerance < 0.0:
            raise InvalidInputError("tolerance must be >= 0")
        if not 0.0 <= self.threshold_low < self.threshold_high:
            raise InvalidInputError("need 0 <= threshold_low < threshold_high")
        if self.max_bisection_steps < 1 or self.threshold_sample_max < 1:
            raise InvalidInputError("max_bisection_steps and threshold_sample_max must be >= 1")
        if self.memory_budget_bytes < 0:
            budget = self.memory_budget_bytes
            raise SettingError("memory_budget_bytes", f"memory_budget_bytes must be >= 0, got {budget}")
        if self.hot_share is not None and not 0.0 < self.hot_share <= 1.0:
            raise SettingError("hot_share", f"hot_share must be in (0, 1], got {self.hot_share}")
        if self.recheck_interval is not None and self.recheck_interval < 0:
            raise SettingError("recheck_interval", "recheck_interval must be None (off), 0 (window length) or positive")
        if self.rule not in DETECTOR_RULES:
            raise SettingError("rule", f"rule must be one of {', '.join(DETECTOR_RULES)}, got {self.rule!r}")
        if self.hot_set not in HOT_SETS:
            raise SettingError("hot_set", f"hot_set must be one of {', '.join(HOT_SETS)}, got {self.hot_set!r}")
        if not 0.0 < self.hot_min_rate <= 1.0:
            raise SettingError("hot_min_rate", f"hot_min_rate must be in (0, 1], got {self.hot_min_rate}")
        if isinstance(self.min_updates, bool) or self.min_updates < 1:
            raise SettingError("min_updates", f"min_updates must be a positive int, got {self.min_updates}")
        if not 0.0 < self.count_share <= 1.0:
            raise SettingError("count_share", f"count_share must be in (0, 1], got {self.count_share}")

    def max_hot_rows(self, total_rows: int, dim: int) -> int:
        """The hot set's size: ``hot_share`` of all rows, else as many rows as the byte budget holds."""
        if self.hot_share is not None:
            return max(1, round(self.hot_share * total_rows))
        return self.memory_budget_bytes // (dim * 4)

    def required_stale(self, num_tables: int) -> int:
        """Number of stale lookups (out of ``num_tables``) that makes an input skippable."""
        if self.alpha_count is not None:
            if self.alpha_count > num_tables:
                raise InvalidInputError(f"alpha_count {self.alpha_count} exceeds the {num_tables} lookups per input")
            return self.alpha_count
        # The epsilon keeps 0.5 * 26 at 13 despite float rounding.
        return max(1, math.ceil(self.alpha * num_tables - 1e-9))


SKIP_RULES = ("stale", "random", "loss")  # `--skip-rule`: what decides which inputs are not trained
SKIP_RULE_HELP = (
    "turn skipping on (off by default): stale = Slipstream's stale inputs; random = the same "
    "share of hot inputs (--stale-target) skipped at random, the equal-compute control; loss = prune "
    "--prune-share of the below-mean-loss inputs, the kept ones weighted up. Measured with the authors' "
    "settings on a model that learned (10 M rows of generator v5): stale skipping lost 0.002 AUC to random "
    "skipping of its share and saved no time; random reached the baseline's AUC 1.15x sooner (docs/skipping.md)"
)
# `--stale-preset`: complete sets of the stale rule's settings (TrainConfig key -> value); flags and config
# files the user sets still win, as over `--quick`. "paper" is Slipstream as published; "tuned" is ours.
STALE_PRESETS: dict[str, dict[str, object]] = {
    "paper": {  # the authors' published code; docs/skipping.md states each rule
        "input_order": "cold_first",  # each epoch: cold inputs, then hot ones
        "stale_hot_set": "budget",  # FAE: the most accessed rows of a 5 % sample...
        "stale_hot_share": 0.1242,  # ...as many as 256 MB holds at dim 16 of Kaggle's 33.8 M rows (4.19 M)
        "stale_window_count": "hot",  # the window counts hot batches after the cold pass:
        "stale_window_start": 0.04,  # opens after 1,000 of the authors' ~24 k hot batches, the same share here,
        "stale_window_start_max": 1000,  # and never later than 1,000 hot batches in
        "stale_window": 0.03,  # spans 3 % of the hot batches
        "stale_threshold_sample": 0.001,  # T fitted on 0.1 % of the hot inputs
        "stale_rule": "paper",  # L-inf change of each hot row between two snapshots
        "stale_decision": "epoch",  # one threshold per window: fitted once, no re-checks
        "stale_keep": 0.0,  # no control group
        "stale_guard": False,  # no guard
        "stale_warmup": "none",  # the window's position decides
        "stale_warmup_min": 0.0,
        "stale_alpha": 1.0,  # stale only when all lookups are
        "batch_size": 1024,
        "lr": 0.01,
        "epochs": 1,
        "samples": None,  # one whole epoch, also over --quick's budget
    },
    "tuned": {
        "stale_rule": "convergence",  # change per counted update of rows updated >= k times
        "stale_hot_set": "budget",  # the most accessed rows that fit the budget
        "stale_decision": "rolling",  # re-check and refit every window length
        "stale_keep": 0.05,  # a control group, trained anyway
        "stale_guard": True,  # control-loss and validation-AUC guard
        "stale_warmup": "val",  # after validation loss flattened
        "stale_warmup_min": 0.1,
        "stale_alpha": 1.0,
    },
}


def preset_help() -> str:
    """Each preset's settings, for `train --help` (one source: STALE_PRESETS)."""
    return "; ".join(
        f"{name}: " + ", ".join(f"{k.removeprefix('stale_').replace('_', '-')}={v}" for k, v in values.items())
        for name, values in STALE_PRESETS.items()
    )


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
