"""The trainer's DLRM across N processes: TorchRec's `DistributedModelParallel` with slipcache's sharder.

    global batch [B] -> this rank's slice (`BatchIterator(part=(rank, N))`: the first B mod N ranks take
    one sample more) -> DLRM under DMP: the bottom and top MLPs data-parallel (DMP's DDP), the tables
    sharded by TorchRec's planner over the ranks (`KeyedCachedEmbeddingBagCollectionSharder`: each rank's
    shards are slipcache tables with their own precision, cache and fused update) -> this slice's logits
    -> every rank's logits gathered into [B]

so the loss, the logged figures and the validation and test metrics are computed over the whole batch or
split on every rank, identically. Backward keeps this rank's slice of the gradient of the global mean loss
times N: DDP's all-reduce and TorchRec's output distributions both divide by N, so every gradient (dense and
table) is the one-process gradient of the same global batch, up to float summation order, whatever the
slices' sizes.

`ShardedDLRM.embeddings` is what the loop asks of a collection (statistics, memory, the learning rate):
collectives over the ranks' shards, called at the same points on every rank. The tables' rows and
optimizer state are not in `state_dict()`: they go into the run's DCP checkpoint (`checkpoint.py`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slipcache.errors import SlipcacheError
from slipcache.model import DLRM, ModelConfig
from slipcache.training.step_checkpoint import table_names

if TYPE_CHECKING:
    from slipcache.data.formats import Dataset
    from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection
    from slipcache.interop.torchrec_perf import TableLookups

logger = logging.getLogger(__name__)

TABLES = "embeddings.tables"  # where the sharded collection sits in the DLRM (its state_dict keys' prefix)


def feature_names(count: int) -> list[str]:
    return [f"f{i}" for i in range(count)]


def bag_configs(table_sizes: list[int], dim: int) -> list[Any]:
    """TorchRec's configs of the trainer's tables: table t{i} read by feature f{i}, sum pooling."""
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=int(rows), feature_names=[feature])
        for name, feature, rows in zip(table_names(len(table_sizes)), feature_names(len(table_sizes)), table_sizes,
                                       strict=True)
    ]


class KeyedTables(nn.Module):
    """DLRM's collection interface (ids [B, T] -> pooled [B, T, D]) over a TorchRec-speaking collection
    (`tables`: KJT in, KeyedTensor out), which DMP replaces by its sharded module."""

    def __init__(self, tables: nn.Module, table_sizes: list[int], dim: int) -> None:
        super().__init__()
        self.tables = tables
        self.table_sizes = list(table_sizes)
        self.dim = dim
        self.features = feature_names(len(table_sizes))

    def forward(self, sparse: Tensor) -> Tensor:
        from slipcache.interop.keyed import sparse_to_kjt

        pooled = self.tables(sparse_to_kjt(sparse, self.features))  # a KeyedTensor (lazily awaited under DMP)
        return pooled.values().view(sparse.shape[0], len(self.features), self.dim)


class _GatherLogits(torch.autograd.Function):
    """Every rank's logits concatenated; backward keeps this rank's slice of the (identical) gradient,
    times the ranks (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, sizes: list[int], rank: int) -> Tensor:
        ctx.bounds = (sum(sizes[:rank]), sum(sizes[: rank + 1]))
        ctx.world = len(sizes)
        padded = local.new_zeros(max(sizes))
        padded[: local.numel()] = local
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        start, end = ctx.bounds
        return grad[start:end] * ctx.world, None, None


def slice_sizes(total: int, world: int) -> list[int]:
    """Each rank's share of a global batch of `total` (`data.batches.slice_bounds`)."""
    from slipcache.data.batches import slice_bounds

    return [end - start for start, end in (slice_bounds(total, world, r) for r in range(world))]


class ShardedTables:
    """The loop's view of the sharded tables: summed statistics and memory, the tables' learning rate."""

    fused_update = True  # the rows are updated in backward: no torch optimizer for them

    def __init__(self, sharded: Any, table_sizes: list[int], dim: int, group: Any = None) -> None:
        self.sharded = sharded  # this rank's ShardedKeyedCachedEmbeddingBagCollection
        self.table_sizes = list(table_sizes)
        self.dim = dim
        self.group = group
        # each table's first global row, as a collection's (what the hot-set profile and random skipping use)
        self.table_offsets = torch.cumsum(torch.tensor([0, *self.table_sizes], dtype=torch.int64), 0)

    def local_collections(self) -> list[Any]:
        return list(self.sharded.local_collections())

    def set_lookahead(self, upcoming: Sequence[Tensor], prefetch: bool = False) -> None:
        """The ids [B, T] of the global batches after the next step's (every rank gives the same ones): each
        shard's collection is shown the rows of them it holds (`set_lookahead` of the sharded module)."""
        names = table_names(len(self.table_sizes))
        self.sharded.set_lookahead([{name: ids[:, t] for t, name in enumerate(names)} for ids in upcoming], prefetch)

    def read_rows(self, rows: Tensor) -> Tensor:
        """The fp32 values [n, dim] of global rows [n], from whichever ranks hold them: each rank fills in
        what its shards hold and a sum over the ranks completes every row. A collective: every rank calls it
        with the same rows (as the staleness detector does, at the same points of the run)."""
        rows = rows.to(torch.int64)
        table = torch.searchsorted(self.table_offsets, rows, right=True) - 1
        local = rows - self.table_offsets[table]
        values = torch.zeros(rows.numel(), self.dim)
        for t, name in enumerate(table_names(len(self.table_sizes))):
            mine = (table == t).nonzero().squeeze(1)
            if mine.numel():
                for positions, start, part in self.sharded.held_rows(name, local[mine]):
                    values[mine[positions], start : start + part.shape[1]] = part
        dist.all_reduce(values, group=self.group)
        return values

    @property
    def lr(self) -> float:
        return float(next(iter(self.sharded.fused_optimizer.param_groups))["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        """The fused optimizer's group (which each step hands to the collections) and the collections."""
        for group in self.sharded.fused_optimizer.param_groups:
            group["lr"] = value
        self.sharded.fused_optimizer.follow_param_groups()

    def flush(self) -> None:
        for collection in self.local_collections():
            collection.flush()

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the sharded rows and their optimizer state are saved through DCP (`checkpoint.py`)."""
        return {}

    def _gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def stats(self) -> dict[str, Any]:
        """Cache statistics summed over every shard of every rank, per table and in total, with each
        rank's own (a collective)."""
        mine = [c.stats() for c in self.local_collections()]
        per_rank = self._gather(mine)
        tables: dict[str, dict[str, Any]] = {}
        for rank_stats in per_rank:
            for stats in rank_stats:
                for entry in stats["per_table"]:
                    name = str(entry["table"]).split("@")[0]  # a column shard counts for its table
                    total = tables.setdefault(name, {"table": name})
                    for key, value in entry.items():
                        if isinstance(value, int) and not isinstance(value, bool):
                            total[key] = total.get(key, 0) + value
        names = table_names(len(self.table_sizes))
        per_table = [tables.get(name, {"table": name, "lookups": 0, "hits": 0}) for name in names]
        for entry in per_table:
            entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry.get("lookups") else None
        totals: dict[str, Any] = {}
        for rank_stats in per_rank:
            for stats in rank_stats:
                for key, value in stats.items():
                    if isinstance(value, int) and not isinstance(value, bool):
                        totals[key] = totals.get(key, 0) + value
        totals.setdefault("lookups", 0)
        totals.setdefault("hits", 0)
        totals["hit_rate"] = totals["hits"] / totals["lookups"] if totals["lookups"] else None
        totals["per_table"] = per_table
        totals["per_rank"] = [
            {k: sum(int(s.get(k) or 0) for s in rank_stats) for k in ("lookups", "hits", "misses", "cache_rows")}
            for rank_stats in per_rank
        ]
        return totals

    def memory_report(self) -> dict[str, Any]:
        """The memory report summed over ranks, with each rank's own (a collective)."""
        mine: dict[str, Any] = {"components": {}, "total_bytes": 0, "fp32_bytes": 0}
        for collection in self.local_collections():
            report = collection.memory_report()
            for name, size in report["components"].items():
                mine["components"][name] = mine["components"].get(name, 0) + int(size)
            mine["total_bytes"] += int(report["total_bytes"])
            mine["fp32_bytes"] += int(report["fp32_bytes"])
        per_rank = self._gather(mine)
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


class ShardedDLRM(nn.Module):
    """DLRM over N ranks with DLRM's interface: this rank's slice in, the global batch's logits out."""

    plan: Any = None  # TorchRec's ShardingPlan it was sharded by

    def __init__(self, dmp: nn.Module, dlrm: DLRM, rank: int, world_size: int) -> None:
        super().__init__()
        self.dmp = dmp  # DistributedModelParallel over `dlrm` (which it shards in place)
        self.rank, self.world_size = rank, world_size
        tables = dlrm.embeddings
        assert isinstance(tables, KeyedTables)
        self.__dict__["dlrm"] = dlrm  # held by `dmp` too: not a second child (state dicts, .train())
        self.tables = ShardedTables(tables.tables, tables.table_sizes, tables.dim)

    @property
    def sharded(self) -> Any:
        """This rank's sharded collection (TorchRec's ShardedModule)."""
        return self.tables.sharded

    @property
    def embeddings(self) -> ShardedTables:
        return self.tables

    @property
    def config(self) -> ModelConfig:
        return self.__dict__["dlrm"].config

    def dense_parameters(self) -> list[nn.Parameter]:
        return self.__dict__["dlrm"].dense_parameters()

    def forward(self, dense: Tensor, sparse: Tensor, batch_size: int | None = None) -> Tensor:
        """Logits of the global batch. `batch_size` None: dense and sparse hold the whole global batch and
        this rank keeps its slice; else they hold only this rank's slice of a global batch of that size."""
        total = dense.shape[0] if batch_size is None else batch_size
        sizes = slice_sizes(total, self.world_size)
        start = sum(sizes[: self.rank])
        if batch_size is None:
            dense, sparse = dense[start : start + sizes[self.rank]], sparse[start : start + sizes[self.rank]]
        elif dense.shape[0] != sizes[self.rank] or sparse.shape[0] != sizes[self.rank]:
            raise SlipcacheError(
                f"rank {self.rank} got {dense.shape[0]} rows of a global batch of {total}; its slice holds "
                f"{sizes[self.rank]}"
            )
        local = self.dmp(dense, sparse)
        return _GatherLogits.apply(local, sizes, self.rank)

    def dense_state_dict(self) -> dict[str, Tensor]:
        """The MLPs' state (DLRM's keys)."""
        dlrm = self.__dict__["dlrm"]
        return {f"{name}.{k}": v for name in ("bottom", "top") for k, v in getattr(dlrm, name).state_dict().items()}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # torch's overloads
        """The MLPs only (the tables are saved through DCP)."""
        return dict(self.dense_state_dict())

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        dlrm = self.__dict__["dlrm"]
        mlps = {k: v for k, v in state.items() if not k.startswith("embeddings.")}
        return dlrm.load_state_dict(mlps, strict=False, assign=assign)


def wire_codecs(precision: str) -> dict[str, Any] | None:
    """TorchRec's codecs for `--wire-precision` (None for fp32): fp16 sends the pooled rows in fp16 and
    their gradients in bf16 (fp16's range is too narrow for gradients without loss scaling); bf16 sends
    both in bf16. Either halves the bytes of the embeddings' all-to-all."""
    if precision == "fp32":
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    forward = {"fp16": CommType.FP16, "bf16": CommType.BF16}[precision]
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=forward, backward_precision=CommType.BF16))


PLAN_PROFILE_ROWS = 100_000  # training rows whose ids the plan's lookups are counted on (about 0.1 s)


def plan_lookups(dataset: Dataset, tables: KeyedCachedEmbeddingBagCollection, seed: int) -> dict[str, TableLookups]:
    """Each table's row histogram and lookups per sample (`TableLookups`), counted on PLAN_PROFILE_ROWS
    rows of the training split drawn from `seed`, under the names of `tables` (the collection the trainer
    shards): what the planner weighs each shard's compute by."""
    from slipcache.interop.torchrec_perf import lookups_from_profile
    from slipcache.planning.profile import profile_split

    profile = profile_split(dataset.split("train"), list(dataset.table_sizes), sample_rows=PLAN_PROFILE_ROWS,
                            seed=seed)
    return lookups_from_profile(profile, tables.table_names)


def plan_tables(dlrm: DLRM, world_size: int, batch_size: int, device: torch.device | None = None,
                wire_precision: str = "fp32", lookups: Mapping[str, TableLookups] | None = None) -> tuple[Any, Any]:
    """(TorchRec's ShardingPlan, our sharder) for `dlrm`'s tables (a `KeyedTables` over a collection on meta
    or the CPU), planned by TorchRec's planner costing our shards (`slipcache_planner`, each shard's compute
    weighted by `lookups`, `plan_lookups`) on every rank together (`collective_plan`: rank 0's plan
    everywhere); `wire_precision` as `wire_codecs`. Nothing is allocated."""
    from torchrec.distributed.planner import Topology

    from slipcache.interop.torchrec_planner import slipcache_planner
    from slipcache.interop.torchrec_sharding import KeyedCachedEmbeddingBagCollectionSharder

    device = device or torch.device("cpu")
    sharder = KeyedCachedEmbeddingBagCollectionSharder(qcomm_codecs_registry=wire_codecs(wire_precision))
    with _quiet_torchrec():
        topology = Topology(world_size=world_size, compute_device=device.type)
        planner = slipcache_planner(topology, batch_size=max(1, batch_size // world_size), lookups=lookups)
        plan = planner.collective_plan(dlrm, [sharder], dist.group.WORLD)
    return plan, sharder


def shard_bytes_of_ranks(tables: Any, plan: Any, ranks: range, *, staged: bool) -> tuple[int, int]:
    """Bytes the shards of `tables` (a `KeyedCachedEmbeddingBagCollection`) that `plan` places on `ranks` will
    hold, as the planner costs them (`shard_bytes`: storage, cache, bookkeeping, optimizer state): (in
    memory, in the files under the tables' `storage_path`, 0 without one). `staged` adds to memory the fp32
    copy of those shards' rows that a new run streams in before they are stored."""
    from slipcache.interop.torchrec_planner import shard_bytes
    from slipcache.memory import STORAGE_COMPONENTS

    in_files = tables.options.get("storage_path") is not None
    sizes = {str(t.name): (int(t.num_embeddings), int(t.embedding_dim)) for t in tables.embedding_bag_configs()}
    memory = files = 0
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            if table not in sizes:
                continue
            if sharding.sharding_spec is None:  # data-parallel: the whole table on every rank
                blocks = [(sizes[table], rank) for rank in ranks]
            else:
                blocks = [(tuple(shard.shard_sizes), shard.placement.rank()) for shard in sharding.sharding_spec.shards]
            share = sharding.cache_params.load_factor if sharding.cache_params is not None else None
            for (rows, columns), rank in blocks:
                if rank in ranks:
                    parts = shard_bytes(tables, table, int(rows), int(columns), share)
                    stored = sum(parts[k] for k in STORAGE_COMPONENTS) if in_files else 0
                    memory += sum(parts.values()) - stored + (4 * int(rows) * int(columns) if staged else 0)
                    files += stored
    return memory, files


def shard_model(dlrm: DLRM, plan: Any, sharder: Any, rank: int, world_size: int,
                device: torch.device | None = None) -> ShardedDLRM:
    """`dlrm` under DistributedModelParallel by `plan` (`plan_tables`): this rank's shards are built here."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    with _quiet_torchrec():
        dmp = DistributedModelParallel(dlrm, device=device or torch.device("cpu"), sharders=[sharder], plan=plan)
    model = ShardedDLRM(dmp, dmp.module, rank, world_size)  # dmp.module: the DLRM, its tables sharded
    model.plan = plan
    return model


@contextlib.contextmanager
def _quiet_torchrec() -> Iterator[None]:
    """TorchRec's planner and DMP warn about GPU-only features on CPU: below errors, silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchrec_logger = logging.getLogger("torchrec")
        level = torchrec_logger.level
        torchrec_logger.setLevel(max(level, logging.ERROR))
        try:
            yield
        finally:
            torchrec_logger.setLevel(level)
