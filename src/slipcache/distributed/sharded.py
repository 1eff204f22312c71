"""Embedding tables sharded over ranks: each rank's shards are one `CachedEmbeddingBagCollection`.

A step, on every rank at once (each holds its slice of the global batch):

1. every lookup (sample, table, id) is mapped to the shard that holds its row, hence to an owner rank;
   lookups are grouped by owner and encoded as one int64 each (position in the sender's slice and the
   row within the shard);
2. the per-owner counts and each rank's slice size are exchanged (`all_to_all_single`, 2 values per
   pair of ranks), then the encoded lookups themselves (`all_to_all_single` with those split sizes);
3. each owner looks every received lookup up in its local collection, as bags of the concatenated
   global batch (one bag per (sample, local table), empty where another rank holds the row), so its
   cache, storage and fused optimizer work exactly as in one process;
4. the looked-up rows return to their senders through `_AllToAll`, an autograd Function whose backward
   sends the gradients the reverse route; the owner's local backward then applies its fused update.

Uneven slices, ranks with an empty slice and owners that receive no lookup of a batch all go through
the same code (zero-length splits). Collectives run on the group given (a group of its own keeps them
apart from DistributedDataParallel's all-reduces on the default group).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slipcache.distributed.planner import Shard, ShardingPlan
from slipcache.embedding.collection import (
    CachedEmbeddingBagCollection,
    EmbeddingConfig,
    SparseFeatures,
    initial_rows,
)
from slipcache.embedding.tables import EmbeddingTables
from slipcache.errors import InvalidInputError

ID_BYTES = 8  # one int64 per routed lookup
TRAFFIC_KEYS = ("steps", "samples", "id_bytes", "embedding_bytes", "gradient_bytes")
_SUMMED_STATS: tuple[str, ...] = ("lookups", "hits", "misses", "evictions", "rows_in", "rows_out", "overflow_rows")
_SUMMED_STATS += ("bytes_in", "bytes_out", "cache_rows")


WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send_counts), D] out, rows [sum(recv_counts), D] in; backward is the reverse route.

    Rows and gradients travel as `wire` (fp32, or fp16 / bf16 to halve the bytes) and arrive as fp32; the
    chunk a rank keeps is rounded too, so results do not depend on which rank holds a row.
    """

    @staticmethod
    def forward(
        ctx: Any,
        values: Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        group: dist.ProcessGroup | None,
        traffic: dict[str, int],
        rank: int,
        wire: torch.dtype = torch.float32,
    ) -> Tensor:
        ctx.counts, ctx.group, ctx.traffic, ctx.rank, ctx.wire = (send_counts, recv_counts), group, traffic, rank, wire
        sent = values.to(wire)
        traffic["embedding_bytes"] += _remote(send_counts, rank) * values.shape[1] * sent.element_size()
        return _exchange(sent, send_counts, recv_counts, group).to(values.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        send_counts, recv_counts = ctx.counts
        sent = grad.to(ctx.wire)
        ctx.traffic["gradient_bytes"] += _remote(recv_counts, ctx.rank) * grad.shape[1] * sent.element_size()
        return _exchange(sent, recv_counts, send_counts, ctx.group).to(grad.dtype), None, None, None, None, None, None


def _remote(counts: list[int], rank: int) -> int:
    """Items that leave this rank (the chunk addressed to itself is a local copy)."""
    return sum(counts) - counts[rank]


def _exchange(
    values: Tensor, send_counts: list[int], recv_counts: list[int], group: dist.ProcessGroup | None
) -> Tensor:
    out = values.new_empty((sum(recv_counts), *values.shape[1:]))
    dist.all_to_all_single(out, values.contiguous(), recv_counts, send_counts, group=group)
    return out


class ShardedEmbeddingCollection(EmbeddingTables):
    """The tables of `config`, placed by `plan`; this process holds rank `rank`'s shards.

    forward(ids [b, T]) -> [b, T, D] for this rank's slice of the global batch; every rank of the group
    must call it (and backward) for the same step. The initial rows equal those of a single-process
    `CachedEmbeddingBagCollection(config)`: both take them from `initial_rows`, each rank keeping its
    shards' rows. Stochastic rounding draws from a stream per rank (seed + rank).
    """

    # buffers (register_buffer), declared for the type checker
    table_offsets: Tensor
    _shard_starts: Tensor
    _shard_rank: Tensor
    _shard_local_table: Tensor
    _local_tables_of_rank: Tensor

    fused_update = True

    def __init__(
        self,
        config: EmbeddingConfig,
        plan: ShardingPlan,
        rank: int,
        group: dist.ProcessGroup | None = None,
        wire_precision: str = "fp32",
        *,
        draw_rows: bool = True,
    ) -> None:
        super().__init__()
        if wire_precision not in WIRE_DTYPES:
            raise InvalidInputError(f"wire precision must be one of {', '.join(WIRE_DTYPES)}, got {wire_precision!r}")
        self.wire_precision = wire_precision
        if [t.rows for t in plan.tables] != list(config.table_sizes):
            raise InvalidInputError("the sharding plan was made for other tables than this collection's")
        self.config, self.plan, self.rank, self.group = config, plan, rank, group
        self.world_size = plan.world_size
        self.table_sizes = list(config.table_sizes)
        self.dim = config.dim
        self.shards = plan.shards_of(rank)
        names = config.table_names or [t.name for t in plan.tables]
        self.local: CachedEmbeddingBagCollection | None = None
        if self.shards:
            local_config = shard_config(config, self.shards, rank)
            local_config.table_names = [_shard_name(names[s.table], s, plan) for s in self.shards]
            self.local = CachedEmbeddingBagCollection(local_config, draw_rows=False)  # its rows: below
            self.local.sharded_by_slipcache = True  # its rows differ by rank by design, under DDP
            if draw_rows and torch.device(config.storage_device).type != "meta":
                self._keep_initial_rows()
        device = torch.device(config.cache_device)
        offsets = torch.zeros(len(self.table_sizes) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(self.table_sizes), 0, out=offsets[1:])
        self.register_buffer("table_offsets", offsets.to(device), persistent=False)
        local_index = {id(s): i for r in range(self.world_size) for i, s in enumerate(plan.shards_of(r))}
        starts = [int(offsets[s.table]) + s.row_start for s in plan.shards]
        self.register_buffer("_shard_starts", torch.tensor(starts, device=device), persistent=False)
        self.register_buffer(
            "_shard_rank", torch.tensor([s.rank for s in plan.shards], device=device), persistent=False
        )
        self.register_buffer(
            "_shard_local_table",
            torch.tensor([local_index[id(s)] for s in plan.shards], device=device),
            persistent=False,
        )
        self.register_buffer(
            "_local_tables_of_rank",
            torch.tensor([max(1, len(plan.shards_of(r))) for r in range(self.world_size)], device=device),
            persistent=False,
        )
        self._row_code = max(s.rows for s in plan.shards)  # code = position * _row_code + row in shard
        # a rank without shards still takes part in the backward exchange through this empty leaf
        self._anchor = torch.zeros(0, config.dim, device=device, requires_grad=True)
        self.traffic = dict.fromkeys(TRAFFIC_KEYS, 0)

    # ---------------------------------------------------------------------------------------- set-up
    def _keep_initial_rows(self) -> None:
        """The one-process collection's initial rows (`initial_rows`), this rank keeping its shards' rows."""
        assert self.local is not None
        local_offsets = self.local.table_offsets.tolist()
        for table, chunk_start, values in initial_rows(self.table_sizes, self.dim, self.config.seed):
            count = values.shape[0]
            for local_table, shard in enumerate(self.shards):
                lo, hi = max(shard.row_start, chunk_start), min(shard.row_end, chunk_start + count)
                if shard.table == table and lo < hi:
                    piece = values[lo - chunk_start : hi - chunk_start].to(self.local.storage_device)
                    dest = local_offsets[local_table] + lo - shard.row_start
                    self.local.storage.write_range(dest, piece, "nearest", None)

    def load_tables(self, tables: list[Tensor]) -> None:
        """Replace every row with the given global fp32 tables; each rank keeps its shards' rows."""
        if len(tables) != len(self.table_sizes):
            raise InvalidInputError(f"expected {len(self.table_sizes)} tables, got {len(tables)}")
        if self.local is not None:
            self.local.load_tables([tables[s.table][s.row_start : s.row_end] for s in self.shards])

    # -------------------------------------------------------------------------------------- forward
    @property
    def lr(self) -> float:
        return self.config.lr if self.local is None else self.local.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.config.lr = value
        if self.local is not None:
            self.local.lr = value

    def forward(self, features: Tensor | SparseFeatures) -> Tensor:
        """Pooled [b, T, D] of this rank's slice: ids [b, T] or multi-hot `SparseFeatures` bags."""
        values, lengths = self._validate(features)
        num_tables, batch = lengths.shape
        world, rank, group = self.world_size, self.rank, self.group
        device = values.device
        # 1. route: owner rank and code of every lookup; a lookup's position names its bag at the owner
        bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.reshape(-1))
        table, sample = bag_of_value // max(batch, 1), bag_of_value % max(batch, 1)
        rows = values + self.table_offsets[table]
        shard = torch.searchsorted(self._shard_starts, rows, right=True) - 1
        owner = self._shard_rank[shard]
        position = sample * self._local_tables_of_rank[owner] + self._shard_local_table[shard]
        codes = position * self._row_code + (rows - self._shard_starts[shard])
        key = owner * (batch * int(self._local_tables_of_rank.max()) + 1) + position
        order = torch.argsort(key, stable=True)  # by owner, then by bag: each owner's bags in one order
        bags, bag_index = torch.unique_consecutive(key[order], return_inverse=True)
        first = torch.zeros(bags.numel(), dtype=torch.int64, device=device)
        first[bag_index] = order  # one lookup of each bag (all of a bag share its owner, sample and table)
        send_counts = torch.bincount(owner, minlength=world)
        bags_per_owner = torch.bincount(owner[first], minlength=world).tolist()
        # 2. exchange split sizes (and slice sizes), then the lookups
        meta = torch.stack([send_counts, torch.full_like(send_counts, batch)], dim=1).reshape(-1)
        meta = _exchange(meta, [2] * world, [2] * world, group).view(world, 2).cpu()
        send_list, recv_list = send_counts.tolist(), meta[:, 0].tolist()
        slice_sizes = meta[:, 1]
        received = _exchange(codes[order], send_list, recv_list, group)
        training = self.training and torch.is_grad_enabled()
        if training:  # traffic counts training steps only (evaluation sends no gradients)
            self.traffic["id_bytes"] += (_remote(send_list, rank) + 2 * (world - 1)) * ID_BYTES
            self.traffic["steps"] += 1
            self.traffic["samples"] += batch
        # 3. serve the received bags from the local shards: one pooled row per (sender, bag)
        served, bags_per_sender = self._serve(received, recv_list, slice_sizes)
        # 4. send the rows back; autograd sends their gradients the reverse route
        traffic = self.traffic if training else dict.fromkeys(TRAFFIC_KEYS, 0)
        wire = WIRE_DTYPES[self.wire_precision]
        returned = _AllToAll.apply(served, bags_per_sender, bags_per_owner, group, traffic, rank, wire)
        # a bag cut over several owners (a row-wise split table) comes back as partial sums: add them up
        slot = sample[first] * num_tables + table[first]
        pooled = returned.new_zeros(batch * num_tables, self.dim).index_add(0, slot, returned)
        pooled = pooled.view(batch, num_tables, self.dim)
        if self.config.pooling == "mean":
            pooled = pooled / lengths.t().clamp_min(1).unsqueeze(-1).to(pooled.dtype)
        return pooled

    def _serve(self, received: Tensor, recv_counts: list[int], slice_sizes: Tensor) -> tuple[Tensor, list[int]]:
        """Summed rows [bags, D] of the received bags in the order received (differentiable when training),
        and how many bags came from each sender."""
        if self.local is None:
            if received.numel():
                raise RuntimeError(f"rank {self.rank} holds no shards but received lookups")
            anchor = self._anchor if self.training and torch.is_grad_enabled() else self._anchor.detach()
            return anchor, [0] * self.world_size
        device = received.device
        local_tables = len(self.shards)
        global_batch = int(slice_sizes.sum())
        starts = torch.zeros(self.world_size, dtype=torch.int64)
        torch.cumsum(slice_sizes[:-1], 0, out=starts[1:])
        source = torch.repeat_interleave(
            torch.arange(self.world_size, device=device), torch.tensor(recv_counts, device=device)
        )
        position = received // self._row_code
        sample = starts.to(device)[source] + position // local_tables
        table = position % local_tables
        bag = table * global_batch + sample
        lengths = torch.bincount(bag, minlength=local_tables * global_batch).view(local_tables, global_batch)
        values = (received % self._row_code)[torch.argsort(bag, stable=True)]
        pooled = self.local(SparseFeatures.from_lengths(values, lengths))  # [global batch, local tables, D]
        # senders sent each bag's lookups together: one row per run of equal (sender, bag)
        _, runs = torch.unique_consecutive(bag, return_counts=True)
        heads = torch.cumsum(runs, 0) - runs
        per_sender = torch.bincount(source[heads], minlength=self.world_size).tolist()
        return pooled.reshape(-1, self.dim)[sample[heads] * local_tables + table[heads]], per_sender

    def _validate(self, features: Tensor | SparseFeatures) -> tuple[Tensor, Tensor]:
        """Ids as (values, lengths [tables, batch]) on the tables' device, checked against the table sizes."""
        num_tables = len(self.table_sizes)
        device = self.table_offsets.device
        if isinstance(features, SparseFeatures):
            if features.num_tables != num_tables:
                raise InvalidInputError(f"SparseFeatures has {features.num_tables} tables, the collection {num_tables}")
            offsets = features.offsets.to(device, torch.int64)
            values = features.values.to(device, torch.int64)
            lengths = offsets.diff()
            if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != values.numel() or bool(
                (lengths < 0).any()
            ):
                raise InvalidInputError("offsets must start at 0, never decrease and end at len(values)")
            lengths = lengths.view(num_tables, features.batch_size)
        elif (
            not isinstance(features, Tensor)
            or features.dtype.is_floating_point
            or features.dim() != 2
            or features.shape[1] != num_tables
        ):
            raise InvalidInputError(
                f"ids must be an integer tensor [batch, {num_tables}] or SparseFeatures, "
                f"got {getattr(features, 'shape', type(features))}"
            )
        else:
            ids = features.to(device, torch.int64)
            values = ids.t().reshape(-1)
            lengths = torch.ones(num_tables, ids.shape[0], dtype=torch.int64, device=device)
        table = torch.repeat_interleave(torch.arange(num_tables, device=device), lengths.sum(dim=1))
        sizes = torch.tensor(self.table_sizes, device=device)
        bad = (values < 0) | (values >= sizes[table])
        if bool(bad.any()):
            t = int(table[torch.nonzero(bad)[0]])
            raise InvalidInputError(
                f"table {t} (size {self.table_sizes[t]}): an id is outside [0, {self.table_sizes[t]})"
            )
        if lengths.shape[1] * int(self._local_tables_of_rank.max()) * self._row_code >= 2**62:
            raise InvalidInputError("batch too large to encode its lookups in int64; use smaller batches")
        return values, lengths

    # ------------------------------------------------------------------------------ rows by id
    def _owned(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(mask of the global `rows` this rank holds, their rows in the local collection)."""
        rows = rows.to(self.table_offsets.device).reshape(-1).long()
        shard = torch.searchsorted(self._shard_starts, rows, right=True) - 1
        mine = self._shard_rank[shard] == self.rank
        if self.local is None:
            return mine, rows.new_empty(0)
        local_table = self._shard_local_table[shard[mine]]
        return mine, self.local.table_offsets[local_table] + rows[mine] - self._shard_starts[shard[mine]]

    def read_rows(self, rows: Tensor) -> Tensor:
        """fp32 values of global `rows` on every rank (a collective): each rank reads those it holds, the
        others are zero, and the sum over ranks is exact. Stale skipping reads its snapshots this way, so
        every rank sees the same values and takes the same decisions."""
        mine, local_rows = self._owned(rows)
        values = torch.zeros(mine.numel(), self.dim, device=self.table_offsets.device)
        if self.local is not None and local_rows.numel():
            values[mine] = self.local.read_rows(local_rows)
        dist.all_reduce(values, group=self.group)
        return values

    def release_rows(self, rows: Tensor) -> int:
        """Write the cached ones of global `rows` back and free their slots; the count over ranks (a collective)."""
        mine, local_rows = self._owned(rows)
        released = self.local.release_rows(local_rows) if self.local is not None and local_rows.numel() else 0
        count = torch.tensor([released], dtype=torch.int64)
        dist.all_reduce(count, group=self.group)
        return int(count)

    # ------------------------------------------------------------------------------- local state
    def flush(self) -> None:
        if self.local is not None:
            self.local.flush()

    def local_stats(self) -> dict[str, Any]:
        """This rank's cache statistics (the lookups its shards served)."""
        if self.local is None:
            return {"lookups": 0, "hits": 0, "hit_rate": None, "per_table": [], "cache_rows": 0}
        return self.local.stats()

    def local_memory_report(self) -> dict[str, Any]:
        """This rank's memory by component."""
        if self.local is None:
            return {"components": {}, "total_bytes": 0, "fp32_bytes": 0, "memory_ratio": 1.0}
        return self.local.memory_report()

    def stats(self) -> dict[str, Any]:
        """Cache statistics summed over ranks, with each rank's own (a collective: every rank calls it)."""
        per_rank = self._gather(self.local_stats())
        totals: dict[str, Any] = {k: sum(int(s.get(k) or 0) for s in per_rank) for k in _SUMMED_STATS}
        totals["hit_rate"] = totals["hits"] / totals["lookups"] if totals["lookups"] else None
        keep = ("lookups", "hits", "misses", "evictions", "hit_rate", "cache_rows")
        totals["per_rank"] = [{k: s.get(k) for k in keep} for s in per_rank]
        return totals

    def memory_report(self) -> dict[str, Any]:
        """The memory report summed over ranks, with each rank's own (a collective)."""
        per_rank = self._gather(self.local_memory_report())
        components: dict[str, int] = {}
        for report in per_rank:
            for name, size in report["components"].items():
                components[name] = components.get(name, 0) + size
        total = sum(r["total_bytes"] for r in per_rank)
        fp32 = sum(r["fp32_bytes"] for r in per_rank)
        return {
            "components": components,
            "total_bytes": total,
            "fp32_bytes": fp32,
            "memory_ratio": fp32 / total if total else 1.0,
            "per_rank": [{"total_bytes": r["total_bytes"], "components": r["components"]} for r in per_rank],
        }

    def combined_traffic(self) -> dict[str, Any]:
        """Bytes sent between ranks, summed over ranks, and per sample of the global batch."""
        per_rank = self._gather(dict(self.traffic))
        totals = {k: sum(t[k] for t in per_rank) for k in TRAFFIC_KEYS if k != "steps"}
        totals["steps"] = per_rank[0]["steps"]
        samples = totals["samples"] or 1
        for key in ("id_bytes", "embedding_bytes", "gradient_bytes"):
            totals[f"{key}_per_sample"] = totals[key] / samples
        return totals

    def _gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def export_tables(self) -> list[Tensor]:
        """Global fp32 tables gathered on every rank (for tests and small tables only)."""
        pieces = self.local.export_tables() if self.local is not None else []
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(
            gathered, [(s, p) for s, p in zip(self.shards, pieces, strict=True)], group=self.group
        )
        tables = [torch.empty(n, self.dim) for n in self.table_sizes]
        for rank_pieces in gathered:
            for shard, piece in rank_pieces:
                tables[shard.table][shard.row_start : shard.row_end] = piece
        return tables


def shard_config(config: EmbeddingConfig, shards: list[Shard], rank: int) -> EmbeddingConfig:
    """The local collection's config: the shards as its tables; a cache fraction applies per shard, a
    cache row count is shared in proportion to rows."""
    rows = sum(s.rows for s in shards)
    if isinstance(config.cache_rows, list):
        raise InvalidInputError("cache rows per table are not sharded over processes: give one count, or --cache-size")
    cache_rows = None if config.cache_rows is None else math.ceil(config.cache_rows * rows / config.num_rows)
    return dataclasses.replace(
        config,
        table_sizes=[s.rows for s in shards],
        table_names=None,
        cache_rows=cache_rows,
        seed=config.seed + rank,
        pooling="sum",  # a bag cut over several owners returns partial sums; the sender takes the mean
    )


def _shard_name(name: str, shard: Shard, plan: ShardingPlan) -> str:
    rows = plan.tables[shard.table].rows
    return name if shard.rows == rows else f"{name}[{shard.row_start}:{shard.row_end}]"
