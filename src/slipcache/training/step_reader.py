"""A checkpoint of N processes (a step directory) read in one process, without `training` knowing its format.

`slipcache.distributed` writes step directories and knows how one process reads them (every rank's shards
gathered into whole tables). `training` does not import `distributed`: the reader is registered here by
`slipcache/__init__.py`, the one module that knows both packages, and imports `distributed` only when a step
directory is read. `--resume` without torchrun, `slipcache eval` and `slipcache export` read them through
`read_step`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path

from slipcache.errors import SlipcacheError

if typing.TYPE_CHECKING:
    from slipcache.training.run_state import TrainingCheckpoint

StepReader = Callable[[Path], "TrainingCheckpoint"]

_registered: dict[str, StepReader] = {}


def register_step_reader(reader: StepReader) -> None:
    """Read step directories with `reader` from now on (it replaces the one registered before)."""
    _registered["step"] = reader


def read_step(step_dir: Path) -> TrainingCheckpoint:
    """The step directory `step_dir` read in this one process: rank 0's trainer state, and the tables
    gathered from every rank's shards when the checkpoint is loaded into a model."""
    reader = _registered.get("step")
    if reader is None:
        raise SlipcacheError(
            f"checkpoint {step_dir} was written by N processes, and no reader of such checkpoints is "
            "registered (slipcache registers slipcache.distributed's when it is imported)"
        )
    return reader(step_dir)
