"""Is a verified checkpoint's content a training state this slipcache can continue from?

A checksum proves the bytes are the ones written, not that whoever wrote them was slipcache: a crafted
file with a valid checksum must not reach `restore` with a string for a sample count, a random-number
state of the wrong size or an optimizer group without parameters, where it would end in a traceback
after the run directory was already changed. So every part the loop reads is checked here, before
anything is written, and the first problem is one line naming the field. What depends on the model
(tensor shapes, parameter counts) is checked when it is loaded (`TrainingState.load_state_dict`), still before
anything is written.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipcache.errors import SlipcacheError
from slipcache.training.checkpoint import RawTensor, materialize
from slipcache.training.loop_state import Progress

PARTS = ("config", "table_sizes", "dense", "embeddings", "dense_optimizer", "progress", "rng")
_PROGRESS_TYPES = {f.name: f.type for f in fields(Progress) if f.name != "finished"}  # not saved


class MalformedCheckpointError(SlipcacheError):
    """A checkpoint whose checksum holds but whose content is not a state slipcache wrote."""


def _bad(path: Path, field: str, problem: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(f"checkpoint {path} is malformed: {field} {problem}")


def _shown(value: Any) -> str:
    text = f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_count(value: Any) -> bool:
    """A non-negative int (not a bool, which is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_amount(value: Any) -> bool:
    """A finite non-negative number."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def check_progress(progress: dict[str, Any], path: Path) -> None:
    for name, value in progress.items():
        kind = _PROGRESS_TYPES.get(name) if isinstance(name, str) else None
        if kind is None:
            raise _bad(path, "progress", f"holds an unknown field {_shown(name)}")
        if kind == "int" and not is_count(value):
            raise _bad(path, f"progress.{name}", f"must be a non-negative integer, got {_shown(value)}")
        if kind == "float" and not is_amount(value):
            raise _bad(path, f"progress.{name}", f"must be a finite non-negative number, got {_shown(value)}")
    events = progress.get("events", [])
    if not isinstance(events, list) or not all(
        isinstance(e, dict) and isinstance(e.get("event"), str) and is_count(e.get("samples")) for e in events
    ):
        raise _bad(path, "progress.events", "must be a list of events, each with its 'event' and 'samples'")
    try:
        json.dumps(events)
    except (TypeError, ValueError) as exc:
        raise _bad(path, "progress.events", f"cannot be written to metrics.jsonl ({exc})") from None


def check_rng(rng: dict[str, Any], path: Path) -> None:
    """Each generator state is put into a throwaway generator: what `restore` does to the real ones."""
    for name in ("torch", "numpy", "python"):
        if name not in rng:
            raise _bad(path, "rng", f"lacks the {name} generator's state")
    try:
        state = _small(rng["torch"], path, "rng.torch")
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"expected a tensor, got {_shown(state)}")
        torch.Generator().set_state(state)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise _bad(path, "rng.torch", f"is not a generator state ({str(exc).splitlines()[0][:80]})") from None
    try:
        kind, keys, *rest = rng["numpy"]
        np.random.RandomState().set_state((kind, _small(keys, path, "rng.numpy").numpy(), *rest))
    except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise _bad(path, "rng.numpy", f"is not a generator state ({str(exc).splitlines()[0][:80]})") from None
    try:
        version, words, gauss = rng["python"]
        random.Random().setstate((version, tuple(words), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        raise _bad(path, "rng.python", f"is not a generator state ({str(exc).splitlines()[0][:80]})") from None


def _small(value: Any, path: Path, field: str) -> Any:
    """A small tensor a lazily read checkpoint left on disk (`RawTensor`), read for the check."""
    if not isinstance(value, RawTensor):
        return value
    if value.nbytes > 1 << 20:
        raise _bad(path, field, f"is too large for a generator state ({value.nbytes} bytes)")
    return materialize(value)


def check_optimizer(state: Any, path: Path, field: str) -> None:
    """A torch optimizer's state_dict: numbered parameter states of tensors and numbers, and groups of
    distinct parameter numbers with finite non-negative hyperparameters."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or not isinstance(
        state.get("param_groups"), list
    ):
        raise _bad(path, field, "must hold 'state' (a dict) and 'param_groups' (a list)")
    seen: set[int] = set()
    for i, group in enumerate(state["param_groups"]):
        where = f"{field}.param_groups[{i}]"
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise _bad(path, where, "must be a dict with its 'params' list")
        if not all(is_count(p) for p in group["params"]) or seen & set(group["params"]):
            raise _bad(path, f"{where}.params", f"must be distinct parameter numbers, got {_shown(group['params'])}")
        seen.update(group["params"])
        for key, value in group.items():
            if key == "params" or value is None or isinstance(value, bool):
                continue
            if not is_amount(value) if not isinstance(value, tuple) else not all(is_amount(v) for v in value):
                raise _bad(path, f"{where}.{key}", f"must be a finite non-negative number, got {_shown(value)}")
        if "lr" not in group:
            raise _bad(path, where, "lacks its 'lr'")
    for key, value in state["state"].items():
        if key not in seen or not isinstance(value, dict):
            raise _bad(path, f"{field}.state", f"holds {_shown(key)}, which is no parameter of its groups")
        for name, item in value.items():
            if not (item is None or isinstance(item, (torch.Tensor, RawTensor)) or is_amount(item)):
                raise _bad(path, f"{field}.state[{key}].{name}", f"must be a tensor or a number, got {_shown(item)}")


def check_state(state: dict[str, Any], path: Path) -> None:
    """Every part of a training checkpoint the loop reads, before anything is written (see module doc)."""
    for part in PARTS:
        if part not in state:
            raise _bad(path, part, "is missing (a training checkpoint holds " + ", ".join(PARTS) + ")")
    sizes = state["table_sizes"]
    if not isinstance(sizes, list) or not sizes or not all(is_count(n) and n >= 1 for n in sizes):
        raise _bad(path, "table_sizes", f"must be a list of positive row counts, got {_shown(sizes)}")
    for part in ("dense", "embeddings"):
        if not isinstance(state[part], dict) or not all(isinstance(k, str) for k in state[part]):
            raise _bad(path, part, f"must be a state dict, got {_shown(state[part])}")
    check_optimizer(state["dense_optimizer"], path, "dense_optimizer")
    if state.get("embedding_optimizer") is not None:
        check_optimizer(state["embedding_optimizer"], path, "embedding_optimizer")
    if not isinstance(state["progress"], dict):
        raise _bad(path, "progress", f"must be a dict, got {_shown(state['progress'])}")
    check_progress(state["progress"], path)
    if not isinstance(state["rng"], dict):
        raise _bad(path, "rng", f"must be a dict, got {_shown(state['rng'])}")
    check_rng(state["rng"], path)
