"""Refuse to train a full copy of the tables per rank under `DistributedModelParallel` or DDP.

The collection updates its rows itself in backward, on the process that ran the step: nothing
all-reduces them. TorchRec's `DistributedModelParallel` has no sharder for it and so leaves a full copy on
every rank inside DDP, whose gradient all-reduce never sees these tables: the ranks' tables would drift
apart silently. slipcache shards its tables over ranks itself (`slipcache.distributed`, started by
`torchrun ... slipcache train`); its per-rank collections are marked `sharded_by_slipcache`.
"""

from __future__ import annotations

import sys
from types import CodeType
from typing import Any

import torch.distributed as dist

from slipcache.errors import SlipcacheError

REFUSAL = (
    "CachedEmbeddingBagCollection is not sharded by {wrapper}: every rank would train its own full copy of "
    "the tables and the copies would diverge; train on many processes with "
    "`torchrun --nproc-per-node N --no-python slipcache train ...`, which shards the tables itself "
    "(docs/scaling.md)"
)


def _wrapper_forwards() -> dict[CodeType, str]:
    """The forward code objects of the data-parallel wrappers that would replicate the tables."""
    from torch.nn.parallel import DistributedDataParallel

    codes = {DistributedDataParallel.forward.__code__: "DistributedDataParallel"}
    model_parallel = sys.modules.get("torchrec.distributed.model_parallel")
    if model_parallel is not None:  # only when the caller imported torchrec's DMP
        codes[model_parallel.DistributedModelParallel.forward.__code__] = "DistributedModelParallel"
    return codes


def refuse_replicated_training(collection: Any) -> None:
    """Raise if this training step runs inside DMP/DDP in a multi-process job on an unsharded collection.

    Cheap outside multi-process jobs (two calls); inside one it walks the Python stack once per step.
    """
    if getattr(collection, "sharded_by_slipcache", False):
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    codes = _wrapper_forwards()
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        name = codes.get(frame.f_code)
        if name is not None:
            found = name  # keep walking: DMP's frame sits above the DDP it wraps
        frame = frame.f_back
    if found is not None:
        raise SlipcacheError(REFUSAL.format(wrapper=found))
