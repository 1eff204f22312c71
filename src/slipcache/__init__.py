"""slipcache: mixed-precision cached embeddings and stale-input skipping for recommendation training."""

from __future__ import annotations

import typing
from pathlib import Path

if typing.TYPE_CHECKING:
    import torch

__version__ = "0.1.0"


def load_model(path: str | Path) -> torch.nn.Module:
    """A trained model ready to score (eval mode), from an export directory (`slipcache export`) or a run
    directory or checkpoint: `model(dense, sparse)` gives click probabilities, `model.vocabulary` maps new
    raw rows as the run's data was mapped (`slipcache.serving`)."""
    from slipcache.serving import load_model as _load_model

    return _load_model(path)
