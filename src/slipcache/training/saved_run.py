"""A saved run's checkpoint, found and read one way for `slipcache eval` and `slipcache export` (and, for
finding it, `--resume`): a run directory, its checkpoints directory, a checkpoint file, or the step
directories of a run of N processes (`step_checkpoint`: every rank's shards gathered into one process's
tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipcache.errors import SlipcacheError
from slipcache.model import DLRM
from slipcache.training.backend import build_model
from slipcache.training.config import TrainConfig, config_from_saved
from slipcache.training.run_state import TrainingCheckpoint
from slipcache.training.rundir import load_training_checkpoint, resolve_checkpoint
from slipcache.training.step_checkpoint import read_step


@dataclass(frozen=True)
class SavedCheckpoint:
    """Where a run's checkpoint is: one file, or (written by N processes) a complete step directory."""

    path: Path
    run_dir: Path | None  # the run directory holding it; None for a loose file
    sharded: bool  # written by N processes: `path` is a step directory with its manifest

    def read(self) -> TrainingCheckpoint:
        """The verified training state (for N processes: rank 0's, which holds the config and sizes) and
        how its tables load."""
        if self.sharded:
            return read_step(self.path)
        return TrainingCheckpoint(self.path, load_training_checkpoint(self.path, use="--checkpoint"))


def find_checkpoint(name: str | Path, flag: str = "--checkpoint") -> SavedCheckpoint:
    """What `name` designates: a checkpoint file or step named as such, else the newest complete checkpoint
    of the run, whichever number of processes wrote it (`rundir.resolve_checkpoint`)."""
    return SavedCheckpoint(*resolve_checkpoint(name, flag))


def saved_config(checkpoint: TrainingCheckpoint) -> TrainConfig:
    config = config_from_saved(checkpoint.state["config"], f"checkpoint {checkpoint.path}")
    config.schedule.progress = False
    return config


def _require_storage_dir(config: TrainConfig, where: Path) -> None:
    """The run's storage path (where its rows are mapped from files) must be a directory or missing: said in
    the terms of eval and export, which have no `--storage-path` of their own."""
    if not config.embeddings.storage_path:
        return
    directory = Path(config.embeddings.storage_path)
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where_file = "is a file" if existing == directory else f"lies under the file {existing}"
        raise SlipcacheError(
            f"the run's storage path {directory} (its --storage-path, recorded in {where}) {where_file}; the rows "
            "are mapped from files there while they are read: move that file away and run again"
        )


def load_saved_model(checkpoint: TrainingCheckpoint, num_dense: int, *, dense: bool = True,
                     huge_pages: str | None = None) -> DLRM:
    """The run's model with the checkpoint's tables (and, with `dense`, its MLPs) in one process;
    `huge_pages`: this process's choice (the command's flag) instead of the run's."""
    # every row comes from the checkpoint: no initial draw to overwrite
    state = checkpoint.state
    config = saved_config(checkpoint)
    if huge_pages is not None:
        config.process.huge_pages = huge_pages
    _require_storage_dir(config, checkpoint.path)
    model = build_model(config, state["table_sizes"], num_dense, draw_rows=False)
    checkpoint.load_into(model, dense=dense)
    return model


def dense_inputs(state: dict[str, Any]) -> int:
    """The number of dense features a checkpoint's bottom MLP takes."""
    try:
        return int(state["dense"]["bottom.0.weight"].shape[1])
    except (KeyError, AttributeError, IndexError) as exc:
        raise SlipcacheError("the checkpoint holds no dense layers (bottom.0.weight)") from exc
