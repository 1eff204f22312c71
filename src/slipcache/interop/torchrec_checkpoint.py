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

The fused optimizer's state is TorchRec's too: `model.fused_optimizer.state_dict()` holds, per table,
`<table>.momentum1` (Adagrad's sums; Adam's first moment), `<table>.momentum2` (Adam's second moment) as
ShardedTensors placed as the rows are, and Adam's `<table>.step`; row-wise Adagrad's one value per row and
column cut is a [rows, cuts] ShardedTensor. Saved and loaded with the rows, a resumed run continues as the
saved one would: exactly with fp32 storage, within rounding below it (loading rounds the rows the cache
held in fp32 into storage, and the cache starts empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from slipcache.errors import InvalidInputError
from slipcache.interop.torchrec_weights import torchrec_key
from slipcache.torch_private import (
    IncompatibleKeys,
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    sharded_tensor_from_local_shards,
)


def sharded_state_dict(module: Any, destination: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Every table of the sharded `module` as a ShardedTensor of its fp32 rows under `prefix`."""
    pieces = _local_rows(module)
    for name, metadata in module.global_metadata().items():
        if metadata is None:  # data-parallel: every rank holds the whole table, a plain (replicated) tensor
            destination[prefix + torchrec_key(name)] = next(rows for t, rows in pieces if t.name == name)
            continue
        shards = [Shard(rows, table.local_metadata) for table, rows in pieces if table.name == name]
        destination[prefix + torchrec_key(name)] = sharded_tensor_from_local_shards(
            shards, metadata, module.process_group
        )
    return destination


def _local_rows(module: Any) -> list[tuple[Any, Tensor]]:
    """(TorchRec's shard description, fp32 rows) of every shard this rank holds."""
    pieces: list[tuple[Any, Tensor]] = []
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        if tables:
            pieces.extend(zip(tables, lookup.export_tables(), strict=True))
    return pieces


def load_sharded_state_dict(
    module: Any, state_dict: Mapping[str, Any], strict: bool = True
) -> IncompatibleKeys:
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
    return IncompatibleKeys(missing, unexpected)


def _shard_rows(value: Any, table: Any) -> Tensor:
    """The rows of one shard (`table`: TorchRec's description of it) in a saved value."""
    if table.local_metadata is None:  # data-parallel: the whole table
        if isinstance(value, ShardedTensor) or not isinstance(value, Tensor) or value.dim() != 2:
            raise InvalidInputError(f"table {table.name!r}: expected a [rows, dim] tensor (data-parallel)")
        return value
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


def shard_name(table: Any) -> str:
    """A shard's table name: the table's, with its first column where it holds only some."""
    if table.local_metadata is None:  # data-parallel: the whole table
        return str(table.name)
    columns = table.local_metadata.shard_sizes[1]
    return (
        table.name
        if columns == table.embedding_dim
        else f"{table.name}@{table.local_metadata.shard_offsets[1]}"
    )


def _held_shards(module: Any) -> dict[str, list[tuple[Any, Any, int]]]:
    """Per table this rank holds a shard of: (TorchRec's shard description, its collection, its index
    there), in the order of the rank's local shards."""
    held: dict[str, list[tuple[Any, Any, int]]] = {}
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        where = {name: (c, i) for c in lookup.collections for i, name in enumerate(c.table_names)}
        for table in tables:
            held.setdefault(table.name, []).append((table, *where[shard_name(table)]))
    return held


def _state_rows(collection: Any, index: int, rows: int) -> Tensor:
    start = int(collection.table_offsets[index])
    return collection.optimizer_state[start : start + rows]


def _cut_metadata(table: Any) -> tuple[ShardMetadata, ShardedTensorMetadata]:
    """Row-wise state of a column-cut table: [rows, cuts], cut i (by first column) in column i."""
    shards = sorted(table.global_metadata.shards_metadata, key=lambda m: m.shard_offsets[1])
    rows = int(table.num_embeddings)
    cuts = [ShardMetadata([0, i], [rows, 1], m.placement) for i, m in enumerate(shards)]
    first = [m.shard_offsets[1] for m in shards].index(table.local_metadata.shard_offsets[1])
    properties = table.global_metadata.tensor_properties
    return cuts[first], ShardedTensorMetadata(cuts, torch.Size([rows, len(cuts)]), properties)


def optimizer_state(module: Any) -> dict[str, dict[str, Any]]:
    """The fused optimizer's state of every table this rank holds a shard of, fp32 copies as
    ShardedTensors (TorchRec's state names), empty for SGD."""
    state: dict[str, dict[str, Any]] = {}
    for name, shards in _held_shards(module).items():
        kind = shards[0][1].config.optimizer
        if kind == "sgd":
            continue
        values: dict[str, list[Shard]] = {}
        metadata = shards[0][0].global_metadata
        if metadata is None:  # data-parallel: plain tensors of the whole table's state
            table, collection, index = shards[0]
            rows = _state_rows(collection, index, int(table.local_rows)).detach().float().clone()
            state[name] = _replicated_state(name, kind, rows, int(table.local_cols))
            if kind == "adam":
                state[name][f"{name}.step"] = torch.tensor(collection.optimizer.steps, dtype=torch.int64)
            continue
        for table, collection, index in shards:
            rows = _state_rows(collection, index, int(table.local_rows)).detach().float().clone()
            if kind == "rowwise_adagrad":
                local, metadata = _cut_metadata(table)
                parts = {"momentum1": (rows.unsqueeze(1), local)}
            elif kind == "adam":  # the two moments side by side
                cols = int(table.local_cols)
                parts = {
                    "momentum1": (rows[:, :cols].contiguous(), table.local_metadata),
                    "momentum2": (rows[:, cols:].contiguous(), table.local_metadata),
                }
            else:
                parts = {"momentum1": (rows, table.local_metadata)}
            for key, (tensor, local_metadata) in parts.items():
                values.setdefault(key, []).append(Shard(tensor, local_metadata))
        state[name] = {
            f"{name}.{key}": sharded_tensor_from_local_shards(
                shards_of_key, metadata, module.process_group
            )
            for key, shards_of_key in values.items()
        }
        if kind == "adam":
            state[name][f"{name}.step"] = torch.tensor(shards[0][1].optimizer.steps, dtype=torch.int64)
    return state


def _replicated_state(name: str, kind: str, rows: Tensor, cols: int) -> dict[str, Any]:
    """A data-parallel table's optimizer state by TorchRec's names, as plain tensors (laid out as the
    ShardedTensors of a table in one shard)."""
    if kind == "rowwise_adagrad":
        return {f"{name}.momentum1": rows.unsqueeze(1)}
    if kind == "adam":
        return {
            f"{name}.momentum1": rows[:, :cols].contiguous(),
            f"{name}.momentum2": rows[:, cols:].contiguous(),
        }
    return {f"{name}.momentum1": rows}


def _local_values(value: Any) -> list[Tensor]:
    """A loaded state value's local pieces: a ShardedTensor's local shards, or a plain tensor itself."""
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    return [value]


def load_optimizer_state(module: Any, state: Mapping[str, Mapping[str, Any]]) -> None:
    """Write `optimizer_state(module)`-shaped values (loaded in place) back into the collections."""
    for name, shards in _held_shards(module).items():
        if name not in state:
            continue
        values = state[name]
        kind = shards[0][1].config.optimizer
        locals_ = {key: _local_values(values[key]) for key in values if key != f"{name}.step"}
        for position, (table, collection, index) in enumerate(shards):
            parts = [locals_[key][position] for key in sorted(locals_)]
            loaded = parts[0].squeeze(1) if kind == "rowwise_adagrad" else torch.cat(parts, dim=1)
            rows = _state_rows(collection, index, int(table.local_rows))
            if loaded.shape != rows.shape:
                raise InvalidInputError(
                    f"table {name!r}: the loaded optimizer state of its shard {shard_name(table)!r} is "
                    f"{list(loaded.shape)}, this shard's is {list(rows.shape)} (a checkpoint of another "
                    "optimizer, or of other column cuts)"
                )
            rows.copy_(loaded.to(rows.dtype))
            if f"{name}.step" in values:
                collection.optimizer.steps = int(values[f"{name}.step"])
