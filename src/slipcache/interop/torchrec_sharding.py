"""`KeyedCachedEmbeddingBagCollection` sharded by TorchRec's `DistributedModelParallel`.

    model = DistributedModelParallel(model, sharders=[KeyedCachedEmbeddingBagCollectionSharder()])

TorchRec does the distributed work: its planner places every table, its shardings say which table shards
each rank holds, and their input and output distributions move the ids to the ranks that hold the rows and
the pooled embeddings back. Only the lookup in between is ours: each rank's shards are one
`KeyedCachedEmbeddingBagCollection` (its own storage precision, cache and fused optimizer per table),
whose backward updates the rows the rank holds. The sharding types, on CPU (gloo) as on GPUs:

- table-wise, column-wise and table-column-wise: TorchRec's `Tw`/`Cw`/`TwCwPooledEmbeddingSharding`
  (ids all-to-all to the table's rank, pooled embeddings all-to-all back);
- row-wise: TorchRec's `RwPooledEmbeddingSharding` (ids bucketized by row range and sent to the rank
  holding it, the ranks' partial pooled sums reduce-scattered back); mean pooling is a sum on the shards,
  divided by the bag lengths once the partial sums are combined;
- table-row-wise: TorchRec's `TwRwPooledEmbeddingSharding` (rows cut over the ranks of one host: ids
  bucketized within the host, partial sums reduce-scattered within it, then all-to-all across hosts), mean
  pooling as row-wise;
- data-parallel: every rank holds the whole table. The ranks' ids are all-gathered (TorchRec's KJT
  all-to-all, each rank sending its batch to every rank), every rank looks the global batch up and keeps
  its own samples, and backward all-gathers the output gradient: each replica applies the same update to
  the global batch, so the replicas stay identical (the equivalent of all-reducing the table gradient
  before the fused update), as one process would on the whole batch.

Grid sharding (and any other type) is refused in one line (REFUSAL).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
    KJTListSplitsAwaitable,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable, EmbeddingBagCollectionContext
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    ModuleSharder,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbeddingTableConfig,
    PoolingType,
)
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.embedding.config import EmbeddingConfig as SlipcacheConfig
from slipcache.errors import SlipcacheError
from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection, KeyedCachedEmbeddingCollection
from slipcache.interop.tables import table_precision
from slipcache.interop.torchrec_checkpoint import held_shards, load_sharded_state_dict, shard_name, sharded_state_dict
from slipcache.interop.torchrec_fused import fused_params_options
from slipcache.interop.torchrec_optim import CachedTablesOptimizer

TW, CW, TWCW = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)
RW, TWRW, DP = (
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
# the sharding types offered, in the order of the lookups (and of their output columns before reordering)
SHARDING_TYPES = (TW, CW, TWCW, RW, TWRW, DP)
ROW_CUTS = (RW, TWRW)  # a table's rows cut over ranks: partial sums combined after the lookup
REFUSAL = "table {table!r}: {kind} sharding is not offered for slipcache's tables; use one of " + ", ".join(
    SHARDING_TYPES
)


Tables = TypeVar("Tables", bound=KeyedCachedEmbeddingBagCollection)


class CachedTablesSharder(ModuleSharder[Tables]):
    """What the sharders of our bag and sequence collections share: fused_params, the tables' shapes for the
    planner, the sharding types offered (`offered`) and their compute kernels."""

    offered: tuple[str, ...] = SHARDING_TYPES

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        fused_params_options(fused_params)  # refused here, at once, rather than at sharding
        self._fused_params = dict(fused_params or {})

    @property
    def fused_params(self) -> dict[str, Any]:
        """The sharder's fused_params, as given (TorchRec's planner reads `cache_load_factor` from them)."""
        return dict(self._fused_params)

    def shard_overrides(self, module: KeyedCachedEmbeddingBagCollection) -> dict[str, Any]:
        """The options that replace the module's in every shard: fused_params, then what
        `apply_optimizer_in_backward` set on the module's parameters."""
        overrides = fused_params_options(self._fused_params)
        overrides.update(module.in_backward_options() or {})
        return overrides

    def shardable_parameters(self, module: Tables) -> dict[str, nn.Parameter]:
        """Each table's shape, for the planner (the rows are not parameters: no memory is allocated)."""
        return {
            str(t.name): nn.Parameter(
                torch.empty(int(t.num_embeddings), int(t.embedding_dim), device="meta"), requires_grad=False
            )
            for t in module.embedding_bag_configs()
        }

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(self.offered)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        # data-parallel as TorchRec's planner and `data_parallel()` plan it (the update is ours either way)
        if sharding_type == DP:
            return [EmbeddingComputeKernel.DENSE.value]
        return [EmbeddingComputeKernel.FUSED.value]


class KeyedCachedEmbeddingBagCollectionSharder(CachedTablesSharder[KeyedCachedEmbeddingBagCollection]):
    """TorchRec's sharder for `KeyedCachedEmbeddingBagCollection`: table-wise, column-wise,
    table-column-wise, row-wise, table-row-wise and data-parallel, on CPU and GPUs.

    `ParameterConstraints(cache_params=CacheParams(load_factor=s))` for a table sets its cache share `s`
    (our `cache_size`) in its shards; precision and the other options are the collection's own.
    `fused_params` (as TorchRec's `EmbeddingBagCollectionSharder`'s: optimizer, learning_rate, eps,
    weight_decay, weight_decay_mode L2, beta1, beta2, stochastic_rounding, cache_load_factor) override the
    collection's options in every shard, and what `apply_optimizer_in_backward` set on the collection's
    parameters overrides them (`torchrec_fused.py`); other keys are refused in one line.
    """

    @property
    def module_type(self) -> type[KeyedCachedEmbeddingBagCollection]:
        return KeyedCachedEmbeddingBagCollection

    def shard(
        self,
        module: KeyedCachedEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedKeyedCachedEmbeddingBagCollection:
        return ShardedKeyedCachedEmbeddingBagCollection(
            module, params, env, device or torch.device("cpu"), self.qcomm_codecs_registry,
            self.shard_overrides(module),
        )


class ShardedCachedTables:
    """What one rank's part of our sharded bag and sequence collections share: its lookups (one of our
    collections per sharding type, `_place_shards`), the fused optimizer, the checkpoint (TorchRec's
    ShardedTensors, `torchrec_checkpoint.py`) and the rows it holds."""

    _env: ShardingEnv
    _shardings: list[Any]
    _sharding_types: list[str]
    _configs: list[Any]
    _feature_names: list[str]
    _optimizer: CachedTablesOptimizer
    _input_order: list[int] | None  # the input KJT's features in the shardings' order, from the first batch
    _input_keys: list[str]
    local_tables: list[list[Any]]
    lookups: Sequence[KeyedCachedEmbeddingBagCollection | NoShards]
    table_precisions: dict[str, str]

    @property
    def unsharded_module_type(self) -> type[KeyedCachedEmbeddingBagCollection]:
        raise NotImplementedError

    @property
    def torchrec_prefix(self) -> str:
        """The checkpoint keys' prefix: the unsharded collection's, as TorchRec's sharded modules keep theirs."""
        return self.unsharded_module_type.torchrec_prefix

    def _plan_shardings(
        self,
        module: KeyedCachedEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        offered: tuple[str, ...],
        refusal: str,
        build: Callable[[str, list[Any]], Any],
    ) -> None:
        """The sharding types the plan uses (in `offered`'s order; others refused with `refusal`) and
        TorchRec's sharding of each, from `build(kind, infos)`."""
        self._env = env
        self._configs = module.embedding_bag_configs()
        self._feature_names = list(module.feature_names)
        infos = sharding_infos(module, params, offered, refusal)
        self._sharding_types = [kind for kind in offered if infos.get(kind)]
        self._shardings = [build(kind, infos[kind]) for kind in self._sharding_types]

    def _place_shards(
        self,
        module: KeyedCachedEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        device: torch.device,
        overrides: Mapping[str, Any],
    ) -> None:
        """This rank's shards of each sharding type as one of our collections, their rows the module's."""
        # per sharding type: TorchRec's description of each shard this rank holds, in its lookup's order
        self.local_tables = [
            _tables_of_rank(kind, sharding, self._env.rank)
            for kind, sharding in zip(self._sharding_types, self._shardings, strict=True)
        ]
        tables = _shard_rows_source(module, [t for mine in self.local_tables for t in mine])
        lookups = nn.ModuleList(
            _local_lookup(module, mine, params, device, tables, overrides, kind)
            for kind, mine in zip(self._sharding_types, self.local_tables, strict=True)
        )
        # A ModuleList (child modules: state dict, device moves); to a type checker, what it holds.
        self.lookups = cast("Sequence[KeyedCachedEmbeddingBagCollection | NoShards]", lookups)
        # each table's storage precision (an INT8 table's checkpoint holds its stored bytes)
        self.table_precisions = {str(t.name): table_precision(module.options, t) for t in self._configs}

    def _split_by_sharding(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """The features each sharding type reads, in its order (a column-wise table's once per column shard),
        once the KJT is checked: one batch size, every feature, the first batch's key order."""
        if features.variable_stride_per_key():
            raise SlipcacheError("KeyedJaggedTensor with a batch size per feature is not supported")
        keys = list(features.keys())
        if keys != self._input_keys:
            wanted = [f for s in self._shardings for f in s.feature_names()]
            missing = [f for f in wanted if f not in keys]
            if missing:
                raise SlipcacheError(f"KeyedJaggedTensor has no feature {missing[0]!r} (has: {', '.join(keys)})")
            if self._input_order is not None:
                raise SlipcacheError("every batch's KeyedJaggedTensor must list the same features in the same order")
            self._input_order = [keys.index(f) for f in wanted]
            self._input_keys = keys
        ordered = features.permute(self._input_order)
        return list(ordered.split([len(s.feature_names()) for s in self._shardings]))

    @property
    def fused_optimizer(self) -> CachedTablesOptimizer:
        return self._optimizer

    @property
    def process_group(self) -> Any:
        return self._env.process_group

    def global_metadata(self) -> dict[str, Any]:
        """Each table's shards over the ranks (TorchRec's ShardedTensorMetadata), in table order."""
        found = {t.name: t.global_metadata for s in self._shardings for t in _every_table(s)}
        # data-parallel tables: None (every rank holds the whole table, saved as a plain tensor)
        return {str(t.name): found[str(t.name)] for t in self._configs}

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """TorchRec's keys, one ShardedTensor of fp32 rows per table (`torchrec_checkpoint.py`)."""
        return sharded_state_dict(self, OrderedDict() if destination is None else destination, prefix)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return load_sharded_state_dict(self, state_dict, strict)

    def local_collections(self) -> list[Any]:
        """This rank's `CachedEmbeddingBagCollection`s (stats, memory_report, flush)."""
        return [c for lookup in self.lookups for c in lookup.collections]

    def set_lookahead(self, upcoming: list[Mapping[str, Tensor]], prefetch: bool = False) -> None:
        """The ids of the batches after the next step's, each as {table: ids of the global batch, in the
        table's own numbering}, for that step only (`CachedEmbeddingBagCollection.set_lookahead`): each of this
        rank's collections is given the rows of its shards that those ids read. Every rank gives the same
        global batches, so a row-wise or table-wise shard sees the ids TorchRec's input distribution will
        bring it; a data-parallel copy is shown every id of the global batch."""
        rows: dict[int, tuple[CachedEmbeddingBagCollection, list[list[Tensor]]]] = {}
        for collection in self.local_collections():
            rows[id(collection)] = (collection, [[] for _ in upcoming])
        for table, shards in held_shards(self).items():
            for shard, collection, index in shards:
                for step, ids_of in enumerate(upcoming):
                    _, local = _rows_in_shard(shard, collection, index, ids_of[table].to(torch.int64))
                    rows[id(collection)][1][step].append(local)
        for collection, steps in rows.values():
            window = [torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)
                      for parts in steps]
            collection.set_lookahead_rows(window, prefetch)

    def held_rows(self, table: str, rows: Tensor) -> list[tuple[Tensor, int, Tensor]]:
        """The parts of rows `rows` (of `table`, its own numbering) that this rank's shards hold, each as
        (positions in `rows`, first column, fp32 values [positions, columns]); a data-parallel table's only on
        rank 0, so that the ranks' parts cover each row once (`distributed.model.ShardedTables.read_rows`)."""
        parts = []
        for shard, collection, index in held_shards(self).get(table, []):
            if shard.local_metadata is None and self._env.rank != 0:
                continue
            positions, local = _rows_in_shard(shard, collection, index, rows)
            if positions.numel():
                parts.append((positions, _block(shard)[2], collection.read_rows(local).float()))
        return parts


class ShardedKeyedCachedEmbeddingBagCollection(
    ShardedCachedTables,
    ShardedModule[KJTList, list[Tensor], KeyedTensor, EmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """One rank's part of a sharded `KeyedCachedEmbeddingBagCollection`.

    `lookups[i]` holds this rank's shards of the i-th sharding type (in SHARDING_TYPES' order) as one
    `KeyedCachedEmbeddingBagCollection`; the output is the unsharded collection's: a KeyedTensor keyed by
    feature in table order, on this rank's slice of the batch. `fused_optimizer` carries the tables'
    learning rate and weight decay (`torchrec_optim.py`).
    """

    # buffers (register_buffer), declared for the type checker
    _columns: Tensor

    def __init__(
        self,
        module: KeyedCachedEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        """`overrides`: options that replace the module's in every shard (the sharder's fused_params)."""
        super().__init__(qcomm_codecs_registry)
        self._is_weighted = module.is_weighted()
        self._plan_shardings(module, params, env, SHARDING_TYPES, REFUSAL,
                             lambda kind, infos: _sharding(kind, infos, env, device, qcomm_codecs_registry))
        self._input_dists = nn.ModuleList(
            _input_dist(kind, s, env) for kind, s in zip(self._sharding_types, self._shardings, strict=True)
        )
        self._output_dists = nn.ModuleList(
            _output_dist(kind, s, env, device)
            for kind, s in zip(self._sharding_types, self._shardings, strict=True)
        )
        self._place_shards(module, params, device, overrides or {})
        self._input_order = None
        self._input_keys = []
        self._dist_names = [n for s in self._shardings for n in s.embedding_names()]
        self._kt_dims = [int(t.embedding_dim) for t in self._configs for _ in t.feature_names]
        self.register_buffer("_columns", _output_columns(self._shardings, self._configs), persistent=False)
        # the output distributions already deliver the columns in table order (a row-wise-only plan)
        self._columns_in_order = bool(torch.equal(self._columns, torch.arange(len(self._columns))))
        # row-wise features of mean-pooled tables: their shards sum, the combined sums are divided here
        self._mean_features = [
            (f, _feature_columns(self._configs, f))
            for t in self._configs
            if params[str(t.name)].sharding_type in ROW_CUTS and t.pooling == PoolingType.MEAN
            for f in t.feature_names
        ]
        self._optimizer = CachedTablesOptimizer(self)

    @property
    def unsharded_module_type(self) -> type[KeyedCachedEmbeddingBagCollection]:
        return KeyedCachedEmbeddingBagCollection

    def embedding_bag_configs(self) -> list[Any]:
        return list(self._configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext()

    # ------------------------------------------------------------------ input, lookup, output
    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        """The features grouped by sharding type, each sent by TorchRec's KJT all-to-all to its tables."""
        with torch.no_grad():
            splits = self._split_by_sharding(features)
            ctx.divisor = self._mean_divisor(features)
            awaitables = []
            for dist, part in zip(self._input_dists, splits, strict=True):
                awaitables.append(dist(part))
                ctx.sharding_contexts.append(_sharding_context(part))
        return KJTListSplitsAwaitable(awaitables, ctx)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> list[Tensor]:
        self._optimizer.follow_param_groups()  # a scheduler's lr applies from this step's backward on
        return [
            _local_pooled(lookup, features, sum(c.batch_size_per_rank), self.training)
            for lookup, features, c in zip(self.lookups, dist_input, ctx.sharding_contexts, strict=True)
        ]

    def output_dist(
        self, ctx: EmbeddingBagCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        """Pooled embeddings back through TorchRec's pooled all-to-all, as the unsharded module's KeyedTensor."""
        awaitables = [
            dist(embeddings, c)
            for dist, embeddings, c in zip(self._output_dists, output, ctx.sharding_contexts, strict=True)
        ]
        dims = [d for s in self._shardings for d in s.embedding_dims()]
        awaitable = EmbeddingBagCollectionAwaitable(
            awaitables, embedding_dims=dims, embedding_names=self._dist_names
        )
        divisor = ctx.divisor
        awaitable.callbacks.append(lambda keyed: self._in_table_order(keyed, divisor))
        return awaitable

    def _mean_divisor(self, features: KeyedJaggedTensor) -> Tensor | None:
        """[local batch, output columns]: the bag length (at least 1) in the columns of row-wise features of
        mean-pooled tables, 1 elsewhere; None without such features."""
        if not self._mean_features:
            return None
        divisor = torch.ones(features.stride(), len(self._columns))
        lengths = features.to_dict()
        for feature, (start, stop) in self._mean_features:
            divisor[:, start:stop] = lengths[feature].lengths().clamp_min(1).to(divisor.dtype).unsqueeze(1)
        return divisor

    def _in_table_order(self, keyed: KeyedTensor, divisor: Tensor | None = None) -> KeyedTensor:
        values = keyed.values() if self._columns_in_order else keyed.values().index_select(1, self._columns)
        if divisor is not None:
            values = values / divisor.to(values.device, values.dtype)
        return KeyedTensor(
            keys=list(self._feature_names),
            length_per_key=list(self._kt_dims),
            values=values,
            key_dim=1,
        )


def sharding_infos(
    module: KeyedCachedEmbeddingBagCollection,
    params: dict[str, ParameterSharding],
    offered: Sequence[str],
    refusal: str,
) -> dict[str, list[EmbeddingShardingInfo]]:
    """TorchRec's per-table sharding inputs, by sharding type (every table planned, each of a type in
    `offered`; another type is refused by `refusal`, formatted with the table and the type)."""
    infos: dict[str, list[EmbeddingShardingInfo]] = {}
    for config in module.embedding_bag_configs():
        sharding = params.get(str(config.name))
        if sharding is None:
            raise SlipcacheError(f"the sharding plan has no entry for table {config.name!r}")
        if sharding.sharding_type not in offered:
            raise SlipcacheError(refusal.format(table=config.name, kind=sharding.sharding_type))
        table = EmbeddingTableConfig(
            num_embeddings=int(config.num_embeddings),
            embedding_dim=int(config.embedding_dim),
            name=str(config.name),
            feature_names=list(config.feature_names),
            pooling=config.pooling,
            is_weighted=module.is_weighted(),
            embedding_names=list(config.feature_names),
        )
        shape = (int(config.num_embeddings), int(config.embedding_dim))
        info = EmbeddingShardingInfo(table, sharding, torch.empty(shape, device="meta"), {})
        infos.setdefault(sharding.sharding_type, []).append(info)
    return infos


def _sharding(
    kind: str, infos: list[EmbeddingShardingInfo], env: ShardingEnv, device: torch.device,
    codecs: dict[str, QuantizedCommCodecs] | None,
) -> Any:
    """TorchRec's sharding of `kind`; `codecs` (the sharder's qcomm_codecs_registry) encode the pooled
    embeddings and their gradients on the wire (a data-parallel table sends none)."""
    if kind == TW:
        return TwPooledEmbeddingSharding(infos, env, device, qcomm_codecs_registry=codecs)
    if kind == CW:
        return CwPooledEmbeddingSharding(infos, env, device, permute_embeddings=False, qcomm_codecs_registry=codecs)
    if kind == TWCW:
        return TwCwPooledEmbeddingSharding(infos, env, device, permute_embeddings=False,
                                           qcomm_codecs_registry=codecs)
    if kind == RW:
        return RwPooledEmbeddingSharding(infos, env, device, qcomm_codecs_registry=codecs)
    if kind == TWRW:
        return TwRwPooledEmbeddingSharding(infos, env, device, qcomm_codecs_registry=codecs)
    return DpPooledEmbeddingSharding(infos, env, device)


def _input_dist(kind: str, sharding: Any, env: ShardingEnv) -> nn.Module:
    if kind == DP:
        return ReplicatedFeaturesDist(env.process_group, len(sharding.feature_names()), env.world_size)
    return sharding.create_input_dist()


def _output_dist(kind: str, sharding: Any, env: ShardingEnv, device: torch.device) -> nn.Module:
    if kind == DP:
        return _ReplicaOutputDist(env.process_group, env.rank)
    return sharding.create_output_dist(device)


class ReplicatedFeaturesDist(nn.Module):
    """Data-parallel input distribution: every rank's features to every rank (the global batch, samples in
    rank order), by TorchRec's KJT all-to-all of the features repeated once per rank."""

    def __init__(self, pg: Any, num_features: int, world_size: int) -> None:
        super().__init__()
        self._world_size = world_size
        self._dist = KJTAllToAll(pg=pg, splits=[num_features] * world_size)

    def forward(self, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        copies = self._world_size
        weights = features.weights_or_none()
        repeated = KeyedJaggedTensor(
            keys=list(features.keys()) * copies,
            values=features.values().repeat(copies),
            lengths=features.lengths().repeat(copies),
            weights=None if weights is None else weights.repeat(copies),
            stride=features.stride(),
        )
        return self._dist(repeated)


class ReplicaSlice(torch.autograd.Function):
    """Forward: this rank's samples of the global batch's pooled rows; backward: the gradients of every
    rank's samples (all-gathered, divided by the ranks as TorchRec's output distributions divide them), so
    that every replica updates its rows by the same global gradient."""

    @staticmethod
    def forward(ctx: Any, pooled: Tensor, batch_per_rank: list[int], rank: int, pg: Any) -> Tensor:
        ctx.batch_per_rank, ctx.rank, ctx.pg = batch_per_rank, rank, pg
        start = sum(batch_per_rank[:rank])
        return pooled[start : start + batch_per_rank[rank]].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        sizes, world = ctx.batch_per_rank, len(ctx.batch_per_rank)
        grad = grad.contiguous()
        columns = grad.shape[1]
        gathered = grad.new_empty(sum(sizes), columns)
        dist.all_to_all_single(
            gathered,
            grad.repeat(world, 1),
            output_split_sizes=list(sizes),
            input_split_sizes=[sizes[ctx.rank]] * world,
            group=ctx.pg,
        )
        if get_gradient_division():
            gathered = gathered / world
        return gathered, None, None, None


class _ReplicaOutputDist(nn.Module):
    """Data-parallel output distribution: this rank's samples, the gradient all-gathered (`ReplicaSlice`)."""

    def __init__(self, pg: Any, rank: int) -> None:
        super().__init__()
        self._pg, self._rank = pg, rank

    def forward(
        self, pooled: Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[Tensor]:
        if sharding_ctx is None or not sharding_ctx.batch_size_per_rank:
            raise RuntimeError("data-parallel output distribution needs the batch size of every rank")
        sizes = [int(b) for b in sharding_ctx.batch_size_per_rank]
        return Done(ReplicaSlice.apply(pooled, sizes, self._rank, self._pg))


class Done(Awaitable[Tensor]):
    def __init__(self, value: Tensor) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> Tensor:
        return self._value


def _feature_columns(configs: list[Any], feature: str) -> tuple[int, int]:
    """The columns of `feature` in the unsharded module's output (features in table order)."""
    position = 0
    for table in configs:
        for name in table.feature_names:
            if name == feature:
                return position, position + int(table.embedding_dim)
            position += int(table.embedding_dim)
    raise KeyError(feature)


class NoShards(nn.Module):
    """The lookup of a rank that holds no table of a sharding type: it still takes part in the
    all-to-alls (and in their backward, so it answers with an empty output that takes gradients)."""

    collections: list[Any] = []
    feature_names: list[str] = []


def _local_pooled(
    lookup: KeyedCachedEmbeddingBagCollection | NoShards, features: KeyedJaggedTensor, batch: int, training: bool
) -> Tensor:
    """Pooled [global batch, this rank's columns] of the features the input distribution delivered."""
    if isinstance(lookup, NoShards):
        return torch.zeros(batch, 0).requires_grad_(training and torch.is_grad_enabled())
    return lookup(by_position(lookup, features)).values()


def by_position(lookup: KeyedCachedEmbeddingBagCollection, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The features an input distribution delivered, named as the lookup's (by position)."""
    return KeyedJaggedTensor(
        keys=list(lookup.feature_names),
        values=features.values(),
        lengths=features.lengths(),
        weights=features.weights_or_none(),
        stride=features.stride(),
    )


def _sharding_context(features: KeyedJaggedTensor) -> EmbeddingShardingContext:
    return EmbeddingShardingContext(batch_size_per_feature_pre_a2a=features.stride_per_key())


def _output_columns(shardings: list[Any], configs: list[Any]) -> Tensor:
    """For each column of the unsharded module's output (features in table order), its column in the
    output distributions' results (concatenated by sharding type, each in rank order)."""
    start, position = {}, 0
    for table in configs:
        for feature in table.feature_names:
            start[feature] = position
            position += int(table.embedding_dim)
    columns = torch.full((position,), -1, dtype=torch.int64)
    offset = 0
    for sharding in shardings:
        for name, dim, meta in zip(
            sharding.embedding_names(),
            sharding.embedding_dims(),
            sharding.embedding_shard_metadata(),
            strict=True,
        ):
            first = start[name] + (meta.shard_offsets[1] if meta is not None else 0)
            columns[first : first + dim] = torch.arange(offset, offset + dim)
            offset += dim
    if bool((columns < 0).any()):
        raise RuntimeError("the shardings do not cover every column of the output")
    return columns


def _shard_options(
    module: KeyedCachedEmbeddingBagCollection,
    mine: list[Any],
    params: dict[str, ParameterSharding],
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """The module's options for this rank's shards (`overrides` replacing them): per-table values keyed by
    shard name, each table's precision (its data_type or the precision option), and the cache share its plan
    entry gives."""
    configs = {str(t.name): t for t in module.embedding_bag_configs()}
    options = {**module.options, **overrides}
    options["precision"] = {shard_name(t): table_precision(module.options, configs[t.name]) for t in mine}
    for key in ("cache_size", "cache_rows"):
        if isinstance(options.get(key), Mapping):
            options[key] = {shard_name(t): options[key][t.name] for t in mine if t.name in options[key]}
    shares = {
        shard_name(t): params[t.name].cache_params.load_factor
        for t in mine
        if params[t.name].cache_params is not None and params[t.name].cache_params.load_factor is not None
    }
    if shares:
        default = options.get("cache_size", SlipcacheConfig.cache_size)
        per_table = default if isinstance(default, Mapping) else {shard_name(t): default for t in mine}
        options["cache_size"] = {**per_table, **shares}
    return options


def _every_table(sharding: Any) -> list[Any]:
    """Every shard a sharding places, on any rank (table-row-wise lists them by rank only)."""
    if isinstance(sharding, TwRwPooledEmbeddingSharding):
        return [
            t
            for rank in sharding._grouped_embedding_configs_per_rank
            for c in rank
            for t in c.embedding_tables
        ]
    return list(sharding.embedding_tables())


def _tables_of_rank(kind: str, sharding: Any, rank: int) -> list[Any]:
    """The shards `rank` holds, in the order the input distribution delivers their features."""
    if kind in (RW, DP):  # a shard (or the whole) of every table, the features in the sharding's order
        mine = list(sharding.embedding_tables())
        expected = sharding.feature_names()
    elif kind == TWRW:  # a row range of every table placed on this rank's host, in the host's order
        mine = [t for c in sharding._grouped_embedding_configs_per_rank[rank] for t in c.embedding_tables]
        node = sharding._grouped_embedding_configs_per_node[rank // sharding._local_size]
        expected = [f for config in node for f in config.feature_names()]
    else:
        mine = [t for t in sharding.embedding_tables() if t.local_metadata.placement.rank() == rank]
        expected = sharding.feature_names_per_rank()[rank]
    if [f for t in mine for f in t.feature_names] != expected:
        raise RuntimeError("shard order differs from the input distribution's feature order")
    return mine


ShardRows = Callable[[int, int, int, int, int], Tensor]  # (table, first row, rows, first column, columns)


def _rows_in_shard(shard: Any, collection: Any, index: int, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(positions in `ids` of the ids the shard holds, their rows in its collection, table `index` there)."""
    first, count, _, _ = _block(shard)
    positions = ((ids >= first) & (ids < first + count)).nonzero().squeeze(1)
    return positions, ids[positions] - first + int(collection.table_offsets[index])


def _block(table: Any) -> tuple[int, int, int, int]:
    """(first row, rows, first column, columns) of a shard in its whole table (a data-parallel copy: all)."""
    if table.local_metadata is None:
        return 0, int(table.num_embeddings), 0, int(table.embedding_dim)
    (first, start), (count, width) = table.local_metadata.shard_offsets, table.local_metadata.shard_sizes
    return int(first), int(count), int(start), int(width)


def _shard_rows_source(module: KeyedCachedEmbeddingBagCollection, shards: list[Any]) -> ShardRows | None:
    """Where this rank's shards take their rows from: the module's tables (drawn on the CPU); on meta, the
    one-process draw streamed chunk by chunk with only these shards' blocks kept (`draw_like_one_process`);
    otherwise None (each shard draws its own)."""
    if module.placement.get("storage_device") != "meta":
        whole = module.export_tables()
        return lambda t, first, count, start, width: whole[t][first : first + count, start : start + width]
    if not module.draw_like_one_process:
        return None
    names = [str(t.name) for t in module.embedding_bag_configs()]
    blocks: dict[tuple[int, int, int, int, int], Tensor] = {}
    for shard in shards:
        first, count, start, width = _block(shard)
        blocks[(names.index(shard.name), first, count, start, width)] = torch.empty(count, width)
    for table, chunk_first, values in module.initial_rows():
        for (t, first, count, start, width), rows in blocks.items():
            lo, hi = max(first, chunk_first), min(first + count, chunk_first + values.shape[0])
            if t == table and lo < hi:
                rows[lo - first : hi - first] = values[lo - chunk_first : hi - chunk_first, start : start + width]
    return lambda t, first, count, start, width: blocks[(t, first, count, start, width)]


def _local_lookup(
    module: KeyedCachedEmbeddingBagCollection,
    mine: list[Any],
    params: dict[str, ParameterSharding],
    device: torch.device,
    tables: ShardRows | None,
    overrides: Mapping[str, Any],
    kind: str = TW,
) -> nn.Module:
    """This rank's shards of one sharding type as our collection. Its features are named by position (a
    column-wise table split twice on one rank reads its features twice), in the order the input
    distribution delivers them; its rows are the module's (rounded per shard), or its own draw on meta.
    Row-wise shards of a mean-pooled table sum (the sharded module divides the combined sums). A sequence
    collection's shards are a sequence collection (rows per id, unpooled)."""
    names = [str(t.name) for t in module.embedding_bag_configs()]
    sequence = isinstance(module, KeyedCachedEmbeddingCollection)
    configs: list[Any] = []
    position = 0
    for table in mine:
        shape = dict(
            num_embeddings=int(table.local_rows),
            embedding_dim=int(table.local_cols),
            name=shard_name(table),
            feature_names=[str(p) for p in range(position, position + len(table.feature_names))],
        )
        if sequence:
            configs.append(EmbeddingConfig(**shape))
        else:
            configs.append(EmbeddingBagConfig(**shape, pooling=PoolingType.SUM if kind in ROW_CUTS else table.pooling))
        position += len(table.feature_names)
    if not configs:
        return NoShards()
    options = _shard_options(module, mine, params, overrides)
    lookup: KeyedCachedEmbeddingBagCollection
    if sequence:
        lookup = KeyedCachedEmbeddingCollection(configs, device=device, **options)
    else:
        lookup = KeyedCachedEmbeddingBagCollection(configs, is_weighted=module.is_weighted(), device=device, **options)
    for collection in lookup.collections:
        collection.sharded_by_slipcache = True  # one rank's shards: they differ by rank on purpose
    if tables is not None:
        lookup.load_tables([tables(names.index(table.name), *_block(table)) for table in mine])
    return lookup
