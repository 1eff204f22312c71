"""Refuse to train a full copy of the tables per process in a multi-process job (DMP, DDP, FSDP, ...).

The collection updates its rows itself in backward, on the process that ran the step: no wrapper's
gradient all-reduce sees these tables. TorchRec's `DistributedModelParallel` without our sharder
(`slipcache.interop.torchrec.KeyedCachedEmbeddingBagCollectionSharder`) leaves a full copy on every
rank; DDP, FSDP and hand-written wrappers replicate it the same way: the ranks' tables would drift apart
silently. Which wrapper is around the collection cannot be told reliably (a stack walk misses FSDP and
custom wrappers), so the rule is about the job instead: a collection that trains while
`torch.distributed` runs more than one process must be one rank's shards of slipcache's own sharded path
(`slipcache.distributed`, started by `torchrun ... slipcache train`) or of our TorchRec sharder (both mark
them `sharded_by_slipcache`), or be marked as an independent replica on purpose
(`allow_independent_replicas`).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

import torch.distributed as dist
from torch import nn

from slipcache.errors import SlipcacheError

Module = TypeVar("Module", bound=nn.Module)

REFUSAL = (
    "CachedEmbeddingBagCollection is training in a job of {world} processes without being sharded over "
    "them: under DistributedModelParallel without our sharder, DDP, FSDP or any wrapper every process would "
    "train its own full copy of the tables and the copies would diverge; shard them with "
    "DistributedModelParallel(model, sharders=[KeyedCachedEmbeddingBagCollectionSharder()]) "
    "(slipcache.interop.torchrec), train with `torchrun --nproc-per-node N --no-python slipcache train ...`, "
    "which shards the tables itself, or call "
    "slipcache.embedding.replicas.allow_independent_replicas(model) if every process trains its own tables "
    "on purpose (docs/scaling.md)"
)


@runtime_checkable
class _MayDiverge(Protocol):
    """A collection that declares the flag (its class sets `independent_replica = False`)."""

    independent_replica: bool


def allow_independent_replicas(module: Module) -> Module:
    """Mark every `CachedEmbeddingBagCollection` in `module` as a replica that may diverge on purpose
    (e.g. independent runs of a sweep inside one torchrun job); returns `module`."""
    # The collections are told by the flag their class declares (collection.py imports this module).
    found = [m for m in module.modules() if isinstance(m, _MayDiverge)]
    if not found:
        raise SlipcacheError(f"{type(module).__name__} holds no CachedEmbeddingBagCollection to mark")
    for collection in found:
        collection.independent_replica = True
    return module


def refuse_replicated_training(collection: Any) -> None:
    """Raise if this training step runs in a multi-process job on a collection that no one shards.

    Called at every training forward, before anything changes; three cheap calls outside such jobs.
    """
    if collection.sharded_by_slipcache or collection.independent_replica:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if world > 1:
        raise SlipcacheError(REFUSAL.format(world=world))
