"""The sharded tables' state_dict as TorchRec's: one `ShardedTensor` per table, for `torch.distributed.checkpoint`.

    state = model.state_dict()                                # DMP(model, sharders=[ours, ...])
    torch.distributed.checkpoint.save(state, checkpoint_id=DIR)
    ...
    state = model.state_dict()                                # any plan, any number of processes
    torch.distributed.checkpoint.load(state, checkpoint_id=DIR)
    model.load_state_dict(state)

Keys are TorchRec's (`embedding_bags.<table>.weight`); each rank's local shards are fp32 copies of the rows
its shards hold, the rows the model reads (the cache overlaid on storage: what a flush would write), with
the placement TorchRec's sharding gave them. Loading rounds them into each shard's storage precision and
empties the caches. One process reads the same checkpoint into an unsharded collection through
`slipcache.interop.torchrec_weights` (`torchrec_state_dict`, then `load_torchrec_state_dict`).

Only the rows are saved: the cache's contents and the fused optimizer's state (Adagrad's sums, Adam's
moments) start afresh on load; with SGD a resumed run continues as the saved one would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.nn.modules.module import _IncompatibleKeys

from slipcache.errors import InvalidInputError
from slipcache.interop.torchrec_weights import torchrec_key


def sharded_state_dict(module: Any, destination: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Every table of the sharded `module` as a ShardedTensor of its fp32 rows under `prefix`."""
    pieces = _local_rows(module)
    for name, metadata in module.global_metadata().items():
        shards = [Shard(rows, table.local_metadata) for table, rows in pieces if table.name == name]
        destination[prefix + torchrec_key(name)] = ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=module.process_group
        )
    return destination


def _local_rows(module: Any) -> list[tuple[Any, Tensor]]:
    """(TorchRec's shard description, fp32 rows) of every shard this rank holds."""
    pieces = []
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        if tables:
            pieces.extend(zip(tables, lookup.export_tables(), strict=True))
    return pieces


def load_sharded_state_dict(
    module: Any, state_dict: Mapping[str, Any], strict: bool = True
) -> _IncompatibleKeys:
    """Rows of each shard this rank holds from TorchRec-keyed values: ShardedTensors (their local shard of
    the same placement) or whole fp32 tables (their columns of it)."""
    expected = {torchrec_key(name): name for name in module.global_metadata()}
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    if strict and (missing or unexpected):
        detail = f"no {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise InvalidInputError(f"state_dict does not match these sharded tables: {detail}")
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        if not tables or any(torchrec_key(t.name) not in state_dict for t in tables):
            continue
        lookup.load_tables([_shard_rows(state_dict[torchrec_key(t.name)], t) for t in tables])
    return _IncompatibleKeys(missing, unexpected)


def _shard_rows(value: Any, table: Any) -> Tensor:
    """The rows of one shard (`table`: TorchRec's description of it) in a saved value."""
    offsets, sizes = table.local_metadata.shard_offsets, table.local_metadata.shard_sizes
    if isinstance(value, ShardedTensor):
        for shard in value.local_shards():
            if list(shard.metadata.shard_offsets) == list(offsets) and list(
                shard.metadata.shard_sizes
            ) == list(sizes):
                return shard.tensor
        raise InvalidInputError(
            f"table {table.name!r}: the state_dict holds no local shard at {list(offsets)}"
        )
    if not isinstance(value, Tensor) or value.dim() != 2:
        raise InvalidInputError(f"table {table.name!r}: expected a ShardedTensor or a [rows, dim] tensor")
    return value[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
