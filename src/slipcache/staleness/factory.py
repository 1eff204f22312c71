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
                 hot_inputs: HotInputs | None = None, rank: int = 0) -> ScheduledSkipper | LossPruner:
    """`stale` and `random` run Slipstream's cycle (random skips the same share of hot inputs at random),
    on the cold-first order's hot set when `hot_inputs` is given; `loss` prunes below-mean-loss inputs, its
    per-input bytes kept in the run directory (`prune_state_dir`)."""
    if config.skipping.skip_rule == "loss":
        if run_dir is None:
            return LossPruner(config, len(split), None)
        return LossPruner(config, len(split), prune_state_dir(Path(run_dir), rank),
                          seed_from=prune_state_dir(Path(run_dir), 0) if rank else None)
    return ScheduledSkipper(config, model, split, batches_per_epoch, hot_inputs)


def prune_state_dir(run_dir: Path, rank: int) -> Path:
    """Where a process keeps loss pruning's per-input bytes: `prune/`, and for rank r > 0 of a torchrun run
    its own copy in `prune-rank-<r>/`, started from rank 0's (every rank decides on the same bytes, and each
    writes its own copy of them)."""
    return run_dir / ("prune" if rank == 0 else f"prune-rank-{rank}")
