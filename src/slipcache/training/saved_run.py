"""A saved run's checkpoint, found and read one way for `slipcache eval` and `slipcache export` (and, for
finding it, `--resume`): a run directory, its checkpoints directory, a checkpoint file, or the step
directories of a run of N processes (every rank's shards gathered into one process's tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipcache.model import DLRM
from slipcache.training import checkpoint as ckpt
from slipcache.training.backend import build_model
from slipcache.training.config import TrainConfig, config_from_saved
from slipcache.training.run_state import check_checkpoint, load_model_state
from slipcache.training.rundir import load_training_checkpoint, locate_checkpoint


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
    """What `name` designates (see `rundir.locate_checkpoint`): a checkpoint file or step directory named
    as such, else (a run directory, its checkpoints directory, its latest.pt) the newest complete
    checkpoint there, whether one process or N wrote it (`newest_checkpoint`)."""
    from slipcache.distributed.checkpoint import MANIFEST

    file, run_dir = locate_checkpoint(name, flag)
    if file.name == ckpt.LATEST:
        if (file.parent / MANIFEST).is_file():  # a step directory of N processes, named
            return SavedCheckpoint(file.parent, run_dir, sharded=True)
        newest = newest_checkpoint(file.parent)
        if newest is not None:
            return SavedCheckpoint(newest[0], run_dir, sharded=newest[1])
    return SavedCheckpoint(file, run_dir, sharded=False)


def newest_checkpoint(directory: Path) -> tuple[Path, bool] | None:
    """(the newest complete checkpoint of a run's checkpoints directory, whether N processes wrote it).

    A run can be continued by 1 process, then N, then 1 again: the newest is the one furthest in training
    (its samples), whoever wrote it; at equal samples, the later written. Complete means written to the
    end: a periodic file under its final name (written aside, then renamed), a step directory with its
    manifest (written last). `latest.pt` is the newest periodic file unless a kill fell between writing
    that file and linking it; then the newer periodic file wins. Damaged bytes are found when it is read
    (the error names the older complete ones)."""
    from slipcache.distributed.checkpoint import complete_steps

    if not directory.is_dir():
        return None
    candidates = [(samples, _written(step / "manifest.json"), step, True) for samples, step in complete_steps(directory)]
    periodic = ckpt.periodic_checkpoints(directory)  # (samples, path), newest last
    latest = directory / ckpt.LATEST
    single: tuple[int, Path] | None = periodic[-1] if periodic else None
    if latest.is_file():
        same = [item for item in periodic if _same_file(item[1], latest)]
        position = same[0][0] if same else (single[0] if single else -1)  # a copy (no hard links): the newest
        if single is None or position >= single[0]:
            single = (position, latest)
    if single is not None:
        candidates.append((single[0], _written(single[1]), single[1], False))
    if not candidates:
        return None
    _, _, path, sharded = max(candidates, key=lambda c: (c[0], c[1]))
    return path, sharded


def _written(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def saved_config(saved: SavedCheckpoint, state: dict[str, Any]) -> TrainConfig:
    config = config_from_saved(state["config"], f"checkpoint {saved.path}")
    config.progress = False
    return config


def load_saved_model(
    saved: SavedCheckpoint, state: dict[str, Any], num_dense: int, *, dense: bool = True
) -> DLRM:
    """The run's model with the checkpoint's tables (and, with `dense`, its MLPs) in one process."""
    if saved.sharded:
        model = build_model(saved_config(saved, state), state["table_sizes"], num_dense)
    else:
        from slipcache.embedding.collection import rows_loaded_next

        with rows_loaded_next():  # every row comes from the checkpoint: no initial draw to overwrite
            model = build_model(saved_config(saved, state), state["table_sizes"], num_dense)
    if saved.sharded:  # gather the ranks' shards into this process's tables
        from slipcache.distributed.checkpoint import unshard_into

        unshard_into(model.embeddings, saved.path)
        state = {**state, "embeddings": model.embeddings.state_dict()}
    load_model_state(state, model, dense=dense)
    return model
