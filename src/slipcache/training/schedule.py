"""`--lr-schedule mlperf`: the learning-rate schedule of the MLPerf DLRM reference, for the MLPs and the tables.

The rate rises linearly from 0 over the warm-up steps, holds, then from the decay start falls as the square of
the remaining share of the decay steps, and after them stays at the last one's (1 / decay steps)^2, as the
reference's `LRPolicyScheduler` freezes at its last rate (no floor of its own: a rate of 0 is valid). Step counts
not given follow the run's length as the reference's do its own: warm-up over the first 4 % of the steps,
decay from 75 % to the end. The factor depends on the step alone, so a resumed run follows the same curve.
"""

from __future__ import annotations

import typing
from typing import Any

from slipcache.callback import Callback
from slipcache.training.parts import DECAY_START_SHARE, WARMUP_SHARE

if typing.TYPE_CHECKING:
    from slipcache.training.config import TrainConfig
    from slipcache.training.run import Run


def lr_factor(step: int, warmup: int, decay_start: int, decay_steps: int) -> float:
    """The multiplier of the base rate at (0-based) `step`."""
    if step < warmup:
        return (step + 1) / warmup
    if decay_steps > 0 and step >= decay_start:
        left = max(1, decay_start + decay_steps - step) / decay_steps  # after the decay: its last rate
        return left * left
    return 1.0


def schedule_steps(config: TrainConfig, total_steps: int) -> tuple[int, int, int]:
    """(warm-up, decay start, decay steps) of a run of `total_steps`: the given ones, else the shares."""
    given = config.schedule
    warmup = given.lr_warmup_steps if given.lr_warmup_steps is not None else round(WARMUP_SHARE * total_steps)
    start = given.lr_decay_start if given.lr_decay_start is not None else round(DECAY_START_SHARE * total_steps)
    steps = given.lr_decay_steps if given.lr_decay_steps is not None else max(0, total_steps - start)
    return warmup, start, steps


def budget_steps(samples: int, batch_size: int) -> int:
    """Steps of a run of `samples` samples: whole batches, the last one rounded up. Integer arithmetic: a
    float would round a budget beyond 2**53 (`--samples 9223372036854775807` showed ...808)."""
    return -(-int(samples) // int(batch_size))


def nearest_quotient(numerator: int, denominator: int) -> int:
    """round(numerator / denominator) in exact integer arithmetic (halves rounded to even, like round)."""
    quotient, remainder = divmod(int(numerator), denominator)
    if 2 * remainder > denominator or (2 * remainder == denominator and quotient % 2):
        quotient += 1
    return quotient


class LRSchedule(Callback):
    """Sets every learning rate of the run (MLP optimizer, tables, a table optimizer) before each step."""

    def __init__(self, run: Run) -> None:
        total_steps = run.budget // run.config.schedule.batch_size
        self.steps = schedule_steps(run.config, total_steps)
        self.dense_lr = run.config.mlp_lr()
        self.lr = run.config.embeddings.lr

    def on_start(self, run: Run) -> None:
        self._apply(run, run.progress.step)  # after a resume too: the rates the checkpoint's step had

    def after_step(self, run: Run, batch: Any, logits: Any, loss: float) -> None:
        self._apply(run, run.progress.step + 1)  # the step that just ran is not counted yet

    def _apply(self, run: Run, step: int) -> None:
        factor = lr_factor(step, *self.steps)
        for group in run.dense_opt.param_groups:
            group["lr"] = self.dense_lr * factor
        if hasattr(run.model.embeddings, "lr"):
            run.model.embeddings.lr = self.lr * factor
        for group in run.emb_opt.param_groups if run.emb_opt is not None else []:
            group["lr"] = self.lr * factor

    def summary_fields(self, run: Run) -> dict[str, Any]:
        warmup, start, steps = self.steps
        return {"lr_schedule": {"warmup_steps": warmup, "decay_start": start, "decay_steps": steps}}
