"""The skipper a run's `--skip-rule` asks for; each offers the trainer the same hooks (start_epoch,
sample_filter, loss_weights, after_batch, after_eval, event_fields, summary, state_dict, skipped_inputs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slipcache.data.dataset import SplitArrays
from slipcache.model import DLRM
from slipcache.staleness.order import HotInputs
from slipcache.staleness.pruning import LossPruner
from slipcache.staleness.schedule import ScheduledSkipper


def make_skipper(config: Any, model: DLRM, split: SplitArrays, batches_per_epoch: int, run_dir: Path | None,
                 hot_inputs: HotInputs | None = None) -> ScheduledSkipper | LossPruner:
    """`stale` and `random` run Slipstream's cycle (random skips the same share of hot inputs at random),
    on the cold-first order's hot set when `hot_inputs` is given; `loss` prunes below-mean-loss inputs, its
    per-input bytes kept in the run directory."""
    if config.skipping.skip_rule == "loss":
        return LossPruner(config, len(split), None if run_dir is None else Path(run_dir) / "prune")
    return ScheduledSkipper(config, model, split, batches_per_epoch, hot_inputs)
