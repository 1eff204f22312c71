"""A saved run's checkpoint, found and read one way for `slipcache eval` and `slipcache export` (and, for
finding it, `--resume`): a run directory, its checkpoints directory, a checkpoint file, or the step
directories of a run of N processes (every rank's shards gathered into one process's tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipcache.model import DLRM
from slipcache.training.backend import build_model
from slipcache.training.config import TrainConfig, config_from_saved
from slipcache.training.run_state import check_checkpoint, load_model_state
from slipcache.training.rundir import load_training_checkpoint, resolve_checkpoint


@dataclass(frozen=True)
class SavedCheckpoint:
    """Where a run's checkpoint is: one file, or (written by N processes) a complete step directory."""

    path: Path
    run_dir: Path | None  # the run directory holding it; None for a loose file
    sharded: bool  # written by N processes: `path` is a step directory with its manifest

    def read(self) -> dict[str, Any]:
        """The verified training state (for N processes: rank 0's, which holds the config and sizes)."""
        if not self.sharded:
            return load_training_checkpoint(self.path, use="--checkpoint")  # eval and export take it so
        from slipcache.distributed import checkpoint as sharded_ckpt

        sharded_ckpt.read_manifest(self.path)  # every rank's file present, with its recorded size
        state = sharded_ckpt.load_rank_state(self.path, 0)
        check_checkpoint(state, self.path)
        return state


def find_checkpoint(name: str | Path, flag: str = "--checkpoint") -> SavedCheckpoint:
    """What `name` designates: a checkpoint file or step named as such, else the newest complete checkpoint
    of the run, whichever number of processes wrote it (`rundir.resolve_checkpoint`)."""
    return SavedCheckpoint(*resolve_checkpoint(name, flag))


def saved_config(saved: SavedCheckpoint, state: dict[str, Any]) -> TrainConfig:
    config = config_from_saved(state["config"], f"checkpoint {saved.path}")
    config.progress = False
    return config


def load_saved_model(
    saved: SavedCheckpoint, state: dict[str, Any], num_dense: int, *, dense: bool = True
) -> DLRM:
    """The run's model with the checkpoint's tables (and, with `dense`, its MLPs) in one process."""
    # every row comes from the checkpoint: no initial draw to overwrite
    model = build_model(saved_config(saved, state), state["table_sizes"], num_dense, draw_rows=False)
    if saved.sharded:  # gather the ranks' shards into this process's tables
        from slipcache.distributed.checkpoint import unshard_into

        unshard_into(model.embeddings, saved.path)
        state = {**state, "embeddings": model.embeddings.state_dict()}
    load_model_state(state, model, dense=dense)
    return model
