"""TorchRec's planner, costing slipcache's tables by what their shards hold and where their lookups fall.

TorchRec's own estimate counts a table as fp32 rows (and its optimizer state as TorchRec's optimizers
keep it). A slipcache shard holds its rows at their storage precision, plus its cache rows, the cache's
bookkeeping and the fused optimizer's state: `SlipcacheStorageEstimator` replaces the estimate of every
shard of a `KeyedCachedEmbeddingBagCollection` with that, computed by the same accounting as the
collection's `memory_report()` (on the meta device: nothing is allocated). Other modules' tables keep
TorchRec's estimate. The input and output buffers TorchRec adds per shard are left out of ours.

    planner = slipcache_planner(Topology(world_size=2, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(model, sharders, process_group)
    model = DistributedModelParallel(model, sharders=sharders, plan=plan)

A table's cache share comes from `ParameterConstraints(cache_params=CacheParams(load_factor=s))` when
given (it is then the shard's `cache_size` too), else from the collection's options.

`lookups` (a table's row histogram and lookups per sample, `TableLookups`) weight its shards' compute by
the lookups their rows take (`SlipcachePerfEstimator`, `torchrec_perf.py`), so that the partitioner does not
stack a table's busy row ranges on one rank:

    planner = slipcache_planner(topology, lookups=lookups_from_profile(profile, table_names))
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ShardingOption, Storage
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.errors import SlipcacheError
from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection
from slipcache.interop.tables import group_config
from slipcache.interop.torchrec_fused import fused_params_options
from slipcache.interop.torchrec_perf import SlipcachePerfEstimator, TableLookups

DEVICE_COMPONENTS = ("cache_rows", "cache_bookkeeping")  # on an accelerator, what lives in its memory
UNBUILDABLE = 2**60  # bytes: the storage of a shard our sharder cannot build, more than any machine has


def shard_bytes(
    module: KeyedCachedEmbeddingBagCollection,
    table: str,
    rows: int,
    columns: int,
    cache_share: float | None,
    fused_params: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Bytes of one shard ([rows, columns] of `table`) by component, as the collection accounts them, with
    the options the sharder's `fused_params` and `apply_optimizer_in_backward` give its shards."""
    config = next(t for t in module.embedding_bag_configs() if str(t.name) == table)
    options = {**module.options, **fused_params_options(fused_params), **(module.in_backward_options() or {})}
    if cache_share is not None:
        options["cache_size"] = cache_share
        options.pop("cache_rows", None)
    shard = group_config([config], options, table_sizes=[rows], dim=columns)
    return CachedEmbeddingBagCollection.estimate_memory(shard)["components"]


class SlipcacheStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, with slipcache's shards costed by our accounting."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Any = None) -> None:
        super().estimate(sharding_options, sharder_data_map)
        accelerator = self._topology.compute_device != "cpu"
        for option in sharding_options:
            module = option.module[1]
            if not isinstance(module, KeyedCachedEmbeddingBagCollection):
                continue
            data = sharder_data_map.get(option.module_type_key) if sharder_data_map else None
            fused = getattr(data, "fused_params", None)
            for shard in option.shards:
                rows, columns = int(shard.size[0]), int(shard.size[1])
                if not rows or not columns:  # a table of fewer rows than ranks cut row-wise: a shard without
                    # rows, which our sharder cannot build; priced beyond any machine, the option is never chosen
                    shard.storage = Storage(hbm=UNBUILDABLE if accelerator else 0, ddr=UNBUILDABLE)
                    continue
                components = shard_bytes(module, option.name, rows, columns, option.cache_load_factor, fused)
                on_device = sum(components[c] for c in DEVICE_COMPONENTS) if accelerator else 0
                shard.storage = Storage(hbm=on_device, ddr=sum(components.values()) - on_device)


class SlipcachePlanner(EmbeddingShardingPlanner):
    """TorchRec's planner that first refuses, in one line, what it would otherwise plan wrong or fail on
    without saying why: lookups given for a table that no slipcache collection of the module has (a misspelt
    name would leave that table at TorchRec's estimate), and a table of fewer rows than ranks whose
    constraints allow only row-wise cuts (each leaves a rank a shard without rows, which our sharder cannot
    build: `UNBUILDABLE`)."""

    def __init__(self, *args: Any, lookup_tables: Collection[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lookup_tables = sorted(lookup_tables)

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        self._check_tables(module)
        return super().plan(module, sharders)

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        self._check_tables(module)  # given the same lookups on every rank, none waits while rank 0 refuses
        return super().collective_plan(module, sharders, pg)

    def _check_tables(self, module: nn.Module) -> None:
        rows = {
            str(t.name): int(t.num_embeddings)
            for m in module.modules()
            if isinstance(m, KeyedCachedEmbeddingBagCollection)
            for t in m.embedding_bag_configs()
        }
        unknown = [name for name in self._lookup_tables if name not in rows]
        if unknown:
            raise SlipcacheError(
                f"lookups for table {unknown[0]!r}, which no slipcache collection of this model has "
                f"(its tables: {', '.join(sorted(rows)) or 'none'})"
            )
        ranks = {"row_wise": self._topology.world_size, "table_row_wise": self._topology.local_world_size}
        for name, constraint in (self._constraints or {}).items():
            allowed = constraint.sharding_types
            if name in rows and allowed and all(rows[name] < ranks.get(kind, 0) for kind in allowed):
                raise SlipcacheError(
                    f"table {name!r} has {rows[name]} rows, fewer than the ranks its constraints' sharding types "
                    f"({', '.join(allowed)}) cut it over: a rank would hold none of its rows; allow table_wise "
                    "or data_parallel for it"
                )


def slipcache_planner(
    topology: Topology,
    batch_size: int = BATCH_SIZE,
    constraints: dict[str, ParameterConstraints] | None = None,
    lookups: Mapping[str, TableLookups] | None = None,
    **planner_options: Any,
) -> SlipcachePlanner:
    """TorchRec's `EmbeddingShardingPlanner`, its storage estimate replaced by `SlipcacheStorageEstimator` and
    its perf estimate weighted by `lookups` (`SlipcachePerfEstimator`: each named table's row histogram and
    lookups per sample; `lookups_from_profile` makes them from an id profile). `planner_options` go to the
    planner."""
    perf = SlipcachePerfEstimator(topology=topology, constraints=constraints, lookups=lookups)
    estimators = [perf, SlipcacheStorageEstimator(topology=topology, constraints=constraints)]
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimators
    )
    return SlipcachePlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=enumerator,
        constraints=constraints,
        lookup_tables=list(lookups or ()),
        **planner_options,
    )
