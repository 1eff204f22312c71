"""A training checkpoint as read (the file format is `checkpoint.py`): `TrainingCheckpoint`, the state and how
its tables go into a model, checked (`check_checkpoint`) and loaded (`load_model_state`). What a checkpoint
holds of a run, and how it is put back into one, is `snapshot.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.errors import SlipcacheError
from slipcache.model import DLRM
from slipcache.training import checkpoint as ckpt
from slipcache.training.state_check import check_state

CHECKPOINT_FORMAT = ckpt.MAGIC


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A checkpoint read to continue from or to evaluate: the trainer state, and how its tables go into a
    model. The reader of each layout says how (one file: as saved; another number of processes: re-sharded),
    so whoever loads it needs to know no layout and nothing is kept between reading and loading."""

    path: Path  # the file, or the step directory of N processes
    state: dict[str, Any]  # `TrainingState.state_dict()`'s; without "embeddings" when `load_tables` fills them
    # Fills a freshly built model's embedding collection from the checkpoint; None: `state["embeddings"]`.
    load_tables: Callable[[Any], None] | None = None
    resharding: str | None = None  # one line saying how the tables are re-sharded as they load

    def load_into(self, model: DLRM, *, dense: bool = True) -> None:
        """Dense state (unless `dense` is False) and the tables into `model`, built for this checkpoint."""
        if self.load_tables is None:
            load_model_state(self.state, model, dense=dense)
            return
        load_model_state(self.state, model, dense=dense, embeddings=False)
        self.load_tables(model.embeddings)


def load_model_state(state: dict[str, Any], model: DLRM, *, dense: bool = True, embeddings: bool = True) -> None:
    """Dense and embedding state (each unless told not to) into `model`; a checkpoint of another shape is
    named as such. Tables a lazy checkpoint left on disk are read straight into the model's buffers."""
    files = model.embeddings.storage_files() if isinstance(model.embeddings, CachedEmbeddingBagCollection) else []
    ckpt.materialize(state, {"embeddings": model.embeddings.state_dict()} if embeddings else None, files)
    try:
        if dense:
            missing, unexpected = model.load_state_dict(state["dense"], strict=False)
            missing = [k for k in missing if not k.startswith("embeddings.")]
            if missing or unexpected:
                raise RuntimeError(f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        if embeddings:
            model.embeddings.load_state_dict(state["embeddings"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        raise SlipcacheError(f"checkpoint does not fit the model: {str(exc).splitlines()[0]}") from exc


def check_checkpoint(state: dict[str, Any], path: Path) -> None:
    """The file verified (see `checkpoint.load_checkpoint`); is it a training checkpoint of this version,
    whole and well-formed (`state_check`)? One line naming the first problem."""
    if state.get("format") != CHECKPOINT_FORMAT or state.get("version") != ckpt.FORMAT_VERSION:
        if "format" not in state and "version" not in state:
            raise SlipcacheError(
                f"{path} is not a slipcache training checkpoint (it holds no format and version; "
                f"its keys: {', '.join(map(str, list(state)[:8])) or 'none'})"
            )
        raise SlipcacheError(
            f"{path} is not a slipcache training checkpoint of format version {ckpt.FORMAT_VERSION} "
            f"(it holds format {state.get('format')!r}, version {state.get('version')!r})"
        )
    check_state(state, path)
