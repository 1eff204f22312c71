"""What a training checkpoint holds (the file format is `checkpoint.py`): every piece of state the loop
reads, so a resumed run ends exactly where the uninterrupted run ends, and how it is put back.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.errors import SlipcacheError
from slipcache.model import DLRM
from slipcache.training import checkpoint as ckpt
from slipcache.training.state_check import check_state

if typing.TYPE_CHECKING:
    from slipcache.training.callbacks import Callbacks
    from slipcache.training.run import Run

CHECKPOINT_FORMAT = ckpt.MAGIC


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A checkpoint read to continue from or to evaluate: the trainer state, and how its tables go into a
    model. The reader of each layout says how (one file: as saved; another number of processes: re-sharded),
    so whoever loads it needs to know no layout and nothing is kept between reading and loading."""

    path: Path  # the file, or the step directory of N processes
    state: dict[str, Any]  # `checkpoint_state`'s; without "embeddings" when `load_tables` fills them
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


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the legacy form: a dict only for generators other than MT19937
    return {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))


def checkpoint_state(run: Run, callbacks: Callbacks) -> dict[str, Any]:
    """Every piece of state the loop reads, so a resumed run ends exactly where an uninterrupted one ends."""
    # The collection's own state_dict (cache contents, quantized storage, optimizer state, rounding RNG)
    # is saved through its method, not through the parent's, which would bypass an override.
    model = run.model
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    return {
        "format": CHECKPOINT_FORMAT,
        "version": ckpt.FORMAT_VERSION,
        "config": run.config_dict,
        "table_sizes": list(run.dataset.table_sizes),
        "dense": dense,
        "embeddings": model.embeddings.state_dict(),
        "dense_optimizer": run.dense_opt.state_dict(),
        "embedding_optimizer": run.emb_opt.state_dict() if run.emb_opt is not None else None,
        "progress": run.progress.state_dict(),
        "rng": _rng_state(),
        **callbacks.state_dict(),  # e.g. "skipping"
    }


def restore(checkpoint: TrainingCheckpoint, run: Run, callbacks: Callbacks) -> None:
    """Load what `checkpoint_state` saved (checked by `check_checkpoint`) into the run's freshly built
    objects; what does not fit them is one line, before the run writes anything."""
    checkpoint.load_into(run.model)
    state = checkpoint.state
    _load_optimizer(run.dense_opt, state["dense_optimizer"], "dense_optimizer")
    if run.emb_opt is not None and state["embedding_optimizer"] is not None:
        _load_optimizer(run.emb_opt, state["embedding_optimizer"], "embedding_optimizer")
    run.progress.load_state_dict(state["progress"])
    _set_rng_state(state["rng"])
    try:
        callbacks.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        raise SlipcacheError(f"checkpoint does not fit the run: a feature's state is malformed ({exc!r:.120})") from exc


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], field: str) -> None:
    """An optimizer's state, after checking its groups and per-parameter tensors against its parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise SlipcacheError(
            f"checkpoint does not fit the model: {field} has groups of {[len(g['params']) for g in groups]} "
            f"parameters, the model's optimizer {[len(g['params']) for g in optimizer.param_groups]}"
        )
    index = {number: params[i] for i, number in enumerate(n for g in groups for n in g["params"])}
    for number, values in saved["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != index[number].shape:
                raise SlipcacheError(
                    f"checkpoint does not fit the model: {field}.state[{number}].{name} has shape "
                    f"{list(value.shape)}, its parameter {list(index[number].shape)}"
                )
    optimizer.load_state_dict(saved)


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


def apply_settings(run: Run) -> None:
    """Put the run's settings back over what a checkpoint restored: the collection and the optimizers
    each keep their own copy of a learning rate, and a resume with `--allow-changes` must train with what
    config.json says, not with the checkpoint's copy. (A callback puts back its own in `on_start`.)"""
    config, model = run.config, run.model
    if hasattr(model.embeddings, "lr"):
        model.embeddings.lr = config.embeddings.lr
    for group in run.dense_opt.param_groups:
        group["lr"] = config.embeddings.lr if config.model.dense_lr is None else config.model.dense_lr
    for group in run.emb_opt.param_groups if run.emb_opt is not None else []:
        group["lr"] = config.embeddings.lr
