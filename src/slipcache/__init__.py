"""slipcache: mixed-precision cached embeddings and stale-input skipping for recommendation training."""

from __future__ import annotations

import typing
from pathlib import Path

if typing.TYPE_CHECKING:
    import torch

    from slipcache.training.run_state import TrainingCheckpoint

__version__ = "0.1.0"


def load_model(path: str | Path) -> torch.nn.Module:
    """A trained model ready to score (eval mode), from an export directory (`slipcache export`) or a run
    directory or checkpoint: `model(dense, sparse)` gives click probabilities, `model.vocabulary` maps new
    raw rows as the run's data was mapped (`slipcache.serving`)."""
    from slipcache.serving import load_model as _load_model

    return _load_model(path)


def _read_step_in_one_process(step_dir: Path) -> TrainingCheckpoint:
    """`slipcache.distributed`'s reader of its step directories for one process, imported when first used
    (torch loads slowly: `import slipcache` stays light)."""
    from slipcache.distributed.checkpoint import read_in_one_process

    return read_in_one_process(step_dir)


def _connect_packages() -> None:
    """The one place that knows both `training` and `distributed`: `distributed` imports `training`, never
    the reverse, so `training` reads a checkpoint of N processes through the reader registered here."""
    from slipcache.training.step_reader import register_step_reader

    register_step_reader(_read_step_in_one_process)


_connect_packages()
