"""The private torch APIs slipcache uses, each behind one function with a fallback for a torch without it.

torch has no public way to run code once when a backward pass ends, to tell one backward pass from the
next, or to count the tensors sharing a storage. These come from torch's internals (`torch._C`, the autograd
engine), which any release may change or drop; nothing else in slipcache touches them (a test keeps it so).
Where an API is missing or raises, its function answers as if torch could not say, and slipcache trains on:

- `graph_task_id` gives None. The fused optimizer then cannot tell a backward pass that failed before its
  end from the next one, so the failed pass's gradients are applied with the next pass's (as torch's own
  `.grad` adds up across passes without `zero_grad`) instead of being dropped.
- `queue_callback` gives False. The optimizer then applies each forward's gradient as it arrives instead of
  once at the end of the backward pass: the same training with one forward per backward pass (the training
  loop's case); with several, a row several forwards read takes one step per forward, and the gradients of a
  pass that fails midway are applied.
- `storage_alone` gives False. Step buffers are then never reused: a new one each step (slower, same values).

Re-exported from here, without a fallback (what needs them cannot work without them):

- torch.distributed's sharded tensors (`Shard`, `ShardMetadata`, `ShardedTensor`, `ShardedTensorMetadata`,
  `TensorProperties`, `sharded_tensor_from_local_shards`), the form TorchRec's checkpoints take; imported
  when first used, so that the tables load without torch.distributed.
- `IncompatibleKeys`, what `nn.Module.load_state_dict` returns; `rebuild_tensor`, the function torch's own
  pickle rebuilds a tensor with (a file written with it loads with `torch.load`).
"""

from __future__ import annotations

import functools
import importlib
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys

if typing.TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

__all__ = [
    "IncompatibleKeys",
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TensorProperties",
    "graph_task_id",
    "queue_callback",
    "rebuild_tensor",
    "sharded_tensor_from_local_shards",
    "storage_alone",
]

_ERRORS = (AttributeError, RuntimeError, TypeError)  # missing, refused, or called differently now


def graph_task_id() -> int | None:
    """The id of the autograd graph task running now (-1 outside a backward pass); None where torch
    cannot say."""
    try:
        return int(torch._C._current_graph_task_id())
    except _ERRORS:
        return None


def queue_callback(callback: Callable[[], None]) -> bool:
    """Have the autograd engine call `callback` once the running backward pass has finished; False (nothing
    queued) outside a backward pass or where torch cannot do it: the caller then does the work now."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except _ERRORS:
        return False
    return True


def storage_alone(tensor: Tensor) -> bool:
    """Whether no other tensor (an output a caller kept, a view of it) shares `tensor`'s storage; False where
    torch cannot say, so that a buffer is reused only when it is known to be free."""
    count = _use_count(tensor)
    return count is not None and count <= _alone_count()


def _use_count(tensor: Tensor) -> int | None:
    """How many tensors share `tensor`'s storage (plus the temporary that asks); None where torch cannot
    say."""
    try:
        return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))
    except _ERRORS:
        return None


@functools.cache
def _alone_count() -> int:
    """The use count of a tensor nothing else shares (asked once `_use_count` answers; -1: no answer)."""
    count = _use_count(torch.empty(1))
    return -1 if count is None else count


_SHARDED_TENSOR_NAMES = {
    "Shard": "torch.distributed._shard.sharded_tensor",
    "ShardedTensor": "torch.distributed._shard.sharded_tensor",
    "ShardedTensorMetadata": "torch.distributed._shard.sharded_tensor",
    "TensorProperties": "torch.distributed._shard.sharded_tensor",
    "ShardMetadata": "torch.distributed._shard.sharding_spec",
}


def __getattr__(name: str) -> Any:
    """The sharded-tensor classes, imported at their first use."""
    module = _SHARDED_TENSOR_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def sharded_tensor_from_local_shards(
    shards: list[Shard], metadata: ShardedTensorMetadata, process_group: ProcessGroup | None
) -> ShardedTensor:
    """A ShardedTensor of this rank's `shards` placed as `metadata` says, without a collective (TorchRec's
    own state dicts are built this way)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=process_group
    )
