"""What a training checkpoint holds of a run, and how it is put back: every piece of state the loop reads
(model, optimizers, `Progress`, random generators, the callbacks' own states), so a resumed run ends
exactly where the uninterrupted run ends. Only the trainer uses it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slipcache.errors import SlipcacheError
from slipcache.training import checkpoint as ckpt
from slipcache.training.callbacks import Callbacks
from slipcache.training.run import Run
from slipcache.training.run_state import CHECKPOINT_FORMAT, TrainingCheckpoint


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


@dataclass(frozen=True)
class TrainingState:
    """The training state of a run, one object: the model, the optimizers, `Progress`, the random generators
    and the callbacks' own states. `state_dict` is what a checkpoint holds; `load_state_dict` puts it back and
    the run's settings over it, so a resumed run ends exactly where the uninterrupted one ends."""

    run: Run
    callbacks: Callbacks

    def state_dict(self) -> dict[str, Any]:
        run = self.run
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
            **self.callbacks.state_dict(),  # e.g. "skipping"
        }

    def load_state_dict(self, checkpoint: TrainingCheckpoint) -> None:
        """What `state_dict` saved (checked by `check_checkpoint`), into the run's freshly built objects; what
        does not fit them is one line, before the run writes anything. Then the run's own settings go back
        over the restored copies (`_apply_settings`); a callback puts back its own in `on_start`."""
        run, state = self.run, checkpoint.state
        checkpoint.load_into(run.model)
        _load_optimizer(run.dense_opt, state["dense_optimizer"], "dense_optimizer")
        if run.emb_opt is not None and state["embedding_optimizer"] is not None:
            _load_optimizer(run.emb_opt, state["embedding_optimizer"], "embedding_optimizer")
        run.progress.load_state_dict(state["progress"])
        _set_rng_state(state["rng"])
        try:
            self.callbacks.load_state_dict(state)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
            raise SlipcacheError(
                f"checkpoint does not fit the run: a feature's state is malformed ({exc!r:.120})"
            ) from exc
        _apply_settings(run)


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


def _apply_settings(run: Run) -> None:
    """Put the run's settings back over what a checkpoint restored: the collection and the optimizers
    each keep their own copy of a learning rate, and a resume with `--allow-changes` must train with what
    config.json says, not with the checkpoint's copy. (A callback puts back its own in `on_start`.)"""
    config, model = run.config, run.model
    if hasattr(model.embeddings, "lr"):
        model.embeddings.lr = config.embeddings.lr
    for group in run.dense_opt.param_groups:
        group["lr"] = config.mlp_lr()
    for group in run.emb_opt.param_groups if run.emb_opt is not None else []:
        group["lr"] = config.embeddings.lr
