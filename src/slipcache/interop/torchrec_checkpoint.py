"""The sharded tables' state_dict as TorchRec's: one `ShardedTensor` per table, for `torch.distributed.checkpoint`.

    state = model.state_dict()                                # DMP(model, sharders=[ours, ...])
    torch.distributed.checkpoint.save(state, checkpoint_id=DIR)
    ...
    state = model.state_dict()                                # any plan, any number of processes
    torch.distributed.checkpoint.load(state, checkpoint_id=DIR)
    model.load_state_dict(state)

Keys are TorchRec's (`embedding_bags.<table>.weight`, a sequence collection's `embeddings.<table>.weight`);
each rank's local shards are fp32 copies of the rows its shards hold, the rows the model reads (the cache
overlaid on storage: what a flush would write), with the placement TorchRec's sharding gave them. Loading
rounds them into each shard's storage precision and empties the caches. An INT8 table is saved as its stored
bytes (`int8_keys`: uint8 codes placed as the rows, fp16 biases and uint8 scale codes per row and column
cut, [rows, cuts]; the cache's rows rounded to nearest into them), which loading copies as they are: a round
trip gives back every byte, in a quarter of the fp32 size, into any plan with the same column cuts. One
process reads a checkpoint of fp32 rows into an unsharded collection through
`slipcache.interop.torchrec_weights` (`torchrec_state_dict`, then `load_torchrec_state_dict`).

The fused optimizer's state is TorchRec's too: `model.fused_optimizer.state_dict()` holds, per table,
`<table>.momentum1` (Adagrad's sums; Adam's first moment), `<table>.momentum2` (Adam's second moment) as
ShardedTensors placed as the rows are, and Adam's `<table>.step`; row-wise Adagrad's one value per row and
column cut is one dimension, a block of rows per cut, as TorchRec's fused tables keep it. Saved and loaded
with the rows, a resumed run continues as the saved one would: exactly with fp32 storage, and with INT8
storage without a cache and with nearest rounding (the stochastic-rounding generators are not saved);
otherwise within rounding (the rows the cache held in fp32 are rounded into storage, and the cache starts
empty).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from slipcache.errors import InvalidInputError
from slipcache.interop.torchrec_weights import PREFIX, torchrec_key
from slipcache.torch_private import (
    IncompatibleKeys,
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    sharded_tensor_from_local_shards,
)

logger = logging.getLogger(__name__)

# INT8 tables are saved as their stored bytes: the codes, and per row and column cut the bias and scale code
INT8_PARTS = {"payload": torch.uint8, "bias": torch.float16, "scale_code": torch.uint8}


def int8_keys(name: str, prefix: str = PREFIX) -> dict[str, str]:
    """The state_dict keys of an INT8 table: `<prefix><table>.weight_<part>` and its column cuts (`prefix`:
    `embedding_bags.` for a bag collection, `embeddings.` for a sequence collection)."""
    base = torchrec_key(name, prefix)
    return {**{part: f"{base}_{part}" for part in INT8_PARTS}, "cuts": f"{base}_cuts"}


def table_keys(module: Any, name: str) -> list[str]:
    """The state_dict keys of one table of the sharded `module`."""
    prefix = module.torchrec_prefix
    if module.table_precisions[name] == "int8":
        return list(int8_keys(name, prefix).values())
    return [torchrec_key(name, prefix)]


def sharded_state_dict(module: Any, destination: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Every table of the sharded `module` under `prefix`: a ShardedTensor of its fp32 rows, or for an INT8
    table its stored bytes (`int8_keys`)."""
    pieces = _local_rows(module)
    held = held_shards(module)
    key_prefix = prefix + module.torchrec_prefix
    for name, metadata in module.global_metadata().items():
        if module.table_precisions[name] == "int8":
            _int8_state(module, name, metadata, held.get(name, []), destination, prefix)
            continue
        if metadata is None:  # data-parallel: every rank holds the whole table, a plain (replicated) tensor
            destination[torchrec_key(name, key_prefix)] = next(rows for t, rows in pieces if t.name == name)
            continue
        shards = [Shard(rows, table.local_metadata) for table, rows in pieces if table.name == name]
        destination[torchrec_key(name, key_prefix)] = sharded_tensor_from_local_shards(
            shards, metadata, module.process_group
        )
    return destination


def _column_cuts(metadata: Any) -> list[int]:
    """The first column of each column cut of a table (one cut, [0], unless column-wise)."""
    if metadata is None:
        return [0]
    return sorted({int(m.shard_offsets[1]) for m in metadata.shards_metadata})


def _per_row(metadata: Any, dtype: torch.dtype) -> ShardedTensorMetadata:
    """[rows, cuts] placement of one value per row and column cut, each shard's at its rows and cut."""
    cuts = _column_cuts(metadata)
    shards = [
        ShardMetadata(
            [m.shard_offsets[0], cuts.index(m.shard_offsets[1])], [m.shard_sizes[0], 1], m.placement
        )
        for m in metadata.shards_metadata
    ]
    return ShardedTensorMetadata(shards, torch.Size([metadata.size[0], len(cuts)]), TensorProperties(dtype=dtype))


def _local_per_row(shard: Any, metadata: Any) -> ShardMetadata:
    cut = _column_cuts(metadata).index(shard.shard_offsets[1])
    return ShardMetadata([shard.shard_offsets[0], cut], [shard.shard_sizes[0], 1], shard.placement)


def _int8_state(
    module: Any, name: str, metadata: Any, held: list[Any], destination: dict[str, Any], prefix: str
) -> None:
    keys = int8_keys(name, prefix + module.torchrec_prefix)
    destination[keys["cuts"]] = torch.tensor(_column_cuts(metadata), dtype=torch.int64)
    local: dict[str, list[Shard]] = {part: [] for part in INT8_PARTS}
    for table, collection, index in held:
        payload, bias, scale_code = collection.stored_int8(index)
        if metadata is None:  # data-parallel: plain tensors, the same on every rank
            destination[keys["payload"]] = payload
            destination[keys["bias"]] = bias.unsqueeze(1)
            destination[keys["scale_code"]] = scale_code.unsqueeze(1)
            return
        per_row = _local_per_row(table.local_metadata, metadata)
        local["payload"].append(Shard(payload, table.local_metadata))
        local["bias"].append(Shard(bias.unsqueeze(1), per_row))
        local["scale_code"].append(Shard(scale_code.unsqueeze(1), per_row))
    for part, dtype in INT8_PARTS.items():
        if part == "payload":
            placed = ShardedTensorMetadata(metadata.shards_metadata, metadata.size, TensorProperties(dtype=dtype))
        else:
            placed = _per_row(metadata, dtype)
        destination[keys[part]] = sharded_tensor_from_local_shards(local[part], placed, module.process_group)


def _local_rows(module: Any) -> list[tuple[Any, Tensor]]:
    """(TorchRec's shard description, fp32 rows) of every shard this rank holds (lookups of INT8 tables
    alone are left out: those are saved as their bytes)."""
    pieces: list[tuple[Any, Tensor]] = []
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        if any(module.table_precisions[t.name] != "int8" for t in tables):
            pieces.extend(zip(tables, lookup.export_tables(), strict=True))
    return pieces


def load_sharded_state_dict(
    module: Any, state_dict: Mapping[str, Any], strict: bool = True
) -> IncompatibleKeys:
    """Rows of each shard this rank holds from TorchRec-keyed values: ShardedTensors (their local shard of
    the same placement) or whole fp32 tables (their columns of it). An INT8 table takes its stored bytes
    (`int8_keys`, copied as they are: exact) or fp32 rows under TorchRec's key (rounded to nearest)."""
    names = list(module.global_metadata())
    prefix = module.torchrec_prefix
    fp32_key = {name: torchrec_key(name, prefix) for name in names}
    expected = {key: name for name in names for key in table_keys(module, name)}
    given = {name for name in names if fp32_key[name] in state_dict}  # fp32 rows of an INT8 table too
    missing = [key for key, name in expected.items() if key not in state_dict and name not in given]
    unexpected = [key for key in state_dict if key not in expected and key not in {fp32_key[n] for n in given}]
    if strict and (missing or unexpected):
        detail = f"no {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise InvalidInputError(f"state_dict does not match these sharded tables: {detail}")
    for lookup, tables in zip(module.lookups, module.local_tables, strict=True):
        if not tables:
            continue
        stored = [t for t in tables if fp32_key[t.name] not in state_dict and _has_int8(state_dict, t.name, prefix)]
        if any(fp32_key[t.name] not in state_dict and t not in stored for t in tables):
            continue
        current = dict(zip(map(shard_name, tables), lookup.export_tables(), strict=True)) if stored else {}
        lookup.load_tables(
            [
                current[shard_name(t)] if t in stored else _shard_rows(state_dict[fp32_key[t.name]], t)
                for t in tables
            ]
        )  # empties the caches
        for table in stored:
            _load_int8(lookup, table, state_dict, prefix)
    return IncompatibleKeys(missing, unexpected)


def _has_int8(state_dict: Mapping[str, Any], name: str, prefix: str) -> bool:
    return all(key in state_dict for key in int8_keys(name, prefix).values())


def _load_int8(lookup: Any, table: Any, state_dict: Mapping[str, Any], prefix: str) -> None:
    """An INT8 shard's stored bytes, copied from the saved ones of the same rows and column cut."""
    keys = int8_keys(table.name, prefix)
    cuts = [int(c) for c in state_dict[keys["cuts"]].tolist()]
    here = _column_cuts(table.global_metadata)
    if cuts != here:
        raise InvalidInputError(
            f"table {table.name!r}: its INT8 bytes were saved with column cuts at {cuts}, this plan cuts it "
            f"at {here}; load into a plan with the same column cuts (any ranks, any row placement)"
        )
    where = {name: (c, i) for c in lookup.collections for i, name in enumerate(c.table_names)}
    collection, index = where[shard_name(table)]
    rows = int(table.local_rows)
    per_row = None if table.local_metadata is None else _local_per_row(table.local_metadata, table.global_metadata)
    values = []
    for name in INT8_PARTS:
        value = state_dict[keys[name]]
        if isinstance(value, ShardedTensor):
            value = _local_shard(value, table.local_metadata if name == "payload" else per_row, table.name)
        values.append(value if name == "payload" else value.squeeze(1))
    collection.load_int8(index, *values)
    logger.debug("table %r: loaded its INT8 bytes (%d rows)", table.name, rows)


def _local_shard(value: Any, wanted: Any, name: str) -> Tensor:
    for shard in value.local_shards():
        if list(shard.metadata.shard_offsets) == list(wanted.shard_offsets) and list(
            shard.metadata.shard_sizes
        ) == list(wanted.shard_sizes):
            return shard.tensor
    raise InvalidInputError(f"table {name!r}: the state_dict holds no local shard at {list(wanted.shard_offsets)}")


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


def held_shards(module: Any) -> dict[str, list[tuple[Any, Any, int]]]:
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


def _rowwise_metadata(table: Any) -> tuple[ShardMetadata, ShardedTensorMetadata]:
    """Row-wise state of a table as TorchRec lays it out: one value per row in one dimension; a table cut
    into c column shards keeps c values per row, cut i (by first column) at [i x rows, (i + 1) x rows),
    each shard at its rows within its cut."""
    metadata = table.global_metadata
    cuts, rows = _column_cuts(metadata), int(metadata.size[0])

    def placed(shard: Any) -> ShardMetadata:
        start = cuts.index(shard.shard_offsets[1]) * rows + shard.shard_offsets[0]
        return ShardMetadata([start], [shard.shard_sizes[0]], shard.placement)

    whole = ShardedTensorMetadata([placed(m) for m in metadata.shards_metadata], torch.Size([rows * len(cuts)]),
                                  TensorProperties(dtype=torch.float32))
    return placed(table.local_metadata), whole


def optimizer_state(module: Any) -> dict[str, dict[str, Any]]:
    """The fused optimizer's state of every table this rank holds a shard of, fp32 copies as
    ShardedTensors (TorchRec's state names), empty for SGD."""
    state: dict[str, dict[str, Any]] = {}
    for name, shards in held_shards(module).items():
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
                local, metadata = _rowwise_metadata(table)
                parts = {"momentum1": (rows, local)}
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
        return {f"{name}.momentum1": rows}
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
    for name, shards in held_shards(module).items():
        if name not in state:
            continue
        values = state[name]
        locals_ = {key: _local_values(values[key]) for key in values if key != f"{name}.step"}
        for position, (table, collection, index) in enumerate(shards):
            parts = [locals_[key][position] for key in sorted(locals_)]
            # Adam's two moments side by side; one state as it is (a shape of another optimizer is said next)
            loaded = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
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


def rank_state(module: Any) -> dict[str, Any]:
    """This rank's state beyond the rows and the optimizer state, per collection of its shards: the cache
    (its fp32 rows, which rows they are, their ages) and the step count and rounding generators. Saved
    beside `state_dict()` (merged into the top of the checkpoint's dict) it makes a resume exact with a
    cache and stochastic rounding, into the same plan on the same number of processes (`load_rank_state`)."""
    rank = module._env.rank
    state = {
        f"{i}.{j}": {
            "shards": list(collection.table_names),
            "cache": {key: value.clone() for key, value in collection.cache.state_dict().items()},
            "extra": collection.get_extra_state(),
        }
        for i, lookup in enumerate(module.lookups)
        for j, collection in enumerate(lookup.collections)
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    # one object per rank, under a key of its own: meant to sit at the top of the checkpoint's dict (DCP saves
    # a dict holding no tensor as one object, which one rank's would then stand for)
    return {f"slipcache_rank{rank}": buffer.getvalue()}


def load_rank_state(module: Any, state: Mapping[str, Any]) -> None:
    """Restore what `rank_state` saved, after `load_state_dict` (which empties the caches); refused in one
    line when it was saved by another plan or on another rank."""
    rank = module._env.rank
    packed = state.get(f"slipcache_rank{rank}")
    saved = None if not isinstance(packed, bytes) else torch.load(io.BytesIO(packed), weights_only=True)
    here = {
        f"{i}.{j}": collection
        for i, lookup in enumerate(module.lookups)
        for j, collection in enumerate(lookup.collections)
    }
    if saved is None or sorted(saved) != sorted(here):
        raise InvalidInputError(
            f"rank {rank}: the saved rank state is of another plan or number of processes; load only "
            "state_dict() and the optimizer's state to move to another plan"
        )
    for key, collection in here.items():
        if list(saved[key]["shards"]) != list(collection.table_names):
            raise InvalidInputError(
                f"rank {rank}: the saved rank state holds shards {list(saved[key]['shards'])}, this rank's "
                f"collection holds {list(collection.table_names)} (another plan)"
            )
        collection.cache.load_state_dict(saved[key]["cache"])
        collection.set_extra_state(saved[key]["extra"])
