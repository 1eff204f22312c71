"""`KeyedCachedEmbeddingBagCollection` sharded by TorchRec's `DistributedModelParallel`.

    model = DistributedModelParallel(model, sharders=[KeyedCachedEmbeddingBagCollectionSharder()])

TorchRec does the distributed work: its planner places every table (table-wise or column-wise), its
`TwPooledEmbeddingSharding` / `CwPooledEmbeddingSharding` say which table shards each rank holds, and their
input and output distributions (`KJTAllToAll`, `PooledEmbeddingsAllToAll`) move the ids to the ranks that
hold the tables and the pooled embeddings back. Only the lookup in between is ours: each rank's shards
are one `KeyedCachedEmbeddingBagCollection` (its own storage precision, cache and fused optimizer per
table), whose backward updates the rows the rank holds.

Row-wise sharding is refused: TorchRec itself offers it for CUDA devices only (its sharders leave it out
on CPU), and it is untested here until a GPU is at hand. gloo has the collectives it would use
(all-to-all and reduce-scatter).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
    KJTListSplitsAwaitable,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable, EmbeddingBagCollectionContext
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
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
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingTableConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from slipcache.embedding.config import EmbeddingConfig
from slipcache.errors import SlipcacheError
from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection
from slipcache.interop.tables import table_precision
from slipcache.interop.torchrec_checkpoint import load_sharded_state_dict, shard_name, sharded_state_dict
from slipcache.interop.torchrec_fused import fused_params_options
from slipcache.interop.torchrec_optim import CachedTablesOptimizer

SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value)
ROW_WISE_REFUSAL = (
    "table {table!r}: {kind} sharding is not offered for slipcache's tables (TorchRec offers it on CUDA "
    "only, and it is untested here until a GPU is at hand); use table_wise or column_wise"
)


class KeyedCachedEmbeddingBagCollectionSharder(ModuleSharder[KeyedCachedEmbeddingBagCollection]):
    """TorchRec's sharder for `KeyedCachedEmbeddingBagCollection`: table-wise and column-wise.

    `ParameterConstraints(cache_params=CacheParams(load_factor=s))` for a table sets its cache share `s`
    (our `cache_size`) in its shards; precision and the other options are the collection's own.
    `fused_params` (as TorchRec's `EmbeddingBagCollectionSharder`'s: optimizer, learning_rate, eps,
    weight_decay, weight_decay_mode L2, beta1, beta2, stochastic_rounding, cache_load_factor) override the
    collection's options in every shard, and what `apply_optimizer_in_backward` set on the collection's
    parameters overrides them (`torchrec_fused.py`); other keys are refused in one line.
    """

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
        overrides = fused_params_options(self._fused_params)
        overrides.update(module.in_backward_options() or {})
        return ShardedKeyedCachedEmbeddingBagCollection(
            module, params, env, device or torch.device("cpu"), self.qcomm_codecs_registry, overrides
        )

    def shardable_parameters(self, module: KeyedCachedEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        """Each table's shape, for the planner (the rows are not parameters: no memory is allocated)."""
        return {
            str(t.name): nn.Parameter(
                torch.empty(int(t.num_embeddings), int(t.embedding_dim), device="meta"), requires_grad=False
            )
            for t in module.embedding_bag_configs()
        }

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]


class ShardedKeyedCachedEmbeddingBagCollection(
    ShardedModule[KJTList, list[Tensor], KeyedTensor, EmbeddingBagCollectionContext], FusedOptimizerModule
):
    """One rank's part of a sharded `KeyedCachedEmbeddingBagCollection`.

    `lookups[i]` holds this rank's shards of the i-th sharding type (table-wise, then column-wise) as one
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
        self._env = env
        self._configs = module.embedding_bag_configs()
        self._feature_names = list(module.feature_names)
        self._is_weighted = module.is_weighted()
        infos = _sharding_infos(module, params)
        self._sharding_types = [kind for kind in SHARDING_TYPES if infos.get(kind)]
        self._shardings = [_sharding(kind, infos[kind], env, device) for kind in self._sharding_types]
        self._input_dists = nn.ModuleList(s.create_input_dist() for s in self._shardings)
        self._output_dists = nn.ModuleList(s.create_output_dist(device) for s in self._shardings)
        tables = None if module.placement.get("storage_device") == "meta" else module.export_tables()
        # per sharding type: TorchRec's description of each shard this rank holds, in its lookup's order
        self.local_tables = [_tables_of_rank(sharding, env.rank) for sharding in self._shardings]
        lookups = nn.ModuleList(
            _local_lookup(module, mine, params, device, tables, overrides or {}) for mine in self.local_tables
        )
        # A ModuleList (child modules: state dict, device moves); to a type checker, what it holds.
        self.lookups = cast("Sequence[KeyedCachedEmbeddingBagCollection | _NoShards]", lookups)
        self._input_order: list[int] | None = None  # the input KJT's features in the shardings' order
        self._input_keys: list[str] = []
        self._dist_names = [n for s in self._shardings for n in s.embedding_names()]
        self._kt_dims = [int(t.embedding_dim) for t in self._configs for _ in t.feature_names]
        self.register_buffer("_columns", _output_columns(self._shardings, self._configs), persistent=False)
        self._optimizer = CachedTablesOptimizer(self)

    @property
    def fused_optimizer(self) -> CachedTablesOptimizer:
        return self._optimizer

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
        if features.variable_stride_per_key():
            raise SlipcacheError("KeyedJaggedTensor with a batch size per feature is not supported")
        if self._input_order is None:
            keys = list(features.keys())
            wanted = [f for s in self._shardings for f in s.feature_names()]
            missing = [f for f in wanted if f not in keys]
            if missing:
                raise SlipcacheError(
                    f"KeyedJaggedTensor has no feature {missing[0]!r} (has: {', '.join(keys)})"
                )
            self._input_order = [keys.index(f) for f in wanted]
            self._input_keys = keys
        elif list(features.keys()) != self._input_keys:
            raise SlipcacheError(
                "every batch's KeyedJaggedTensor must list the same features in the same order"
            )
        with torch.no_grad():
            ordered = features.permute(self._input_order)
            splits = ordered.split([len(s.feature_names()) for s in self._shardings])
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
        awaitable.callbacks.append(self._in_table_order)
        return awaitable

    def _in_table_order(self, keyed: KeyedTensor) -> KeyedTensor:
        return KeyedTensor(
            keys=list(self._feature_names),
            length_per_key=list(self._kt_dims),
            values=keyed.values().index_select(1, self._columns),
            key_dim=1,
        )

    # ------------------------------------------------------------------------- tables
    @property
    def process_group(self) -> Any:
        return self._env.process_group

    def global_metadata(self) -> dict[str, Any]:
        """Each table's shards over the ranks (TorchRec's ShardedTensorMetadata), in table order."""
        found = {t.name: t.global_metadata for s in self._shardings for t in s.embedding_tables()}
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


def _sharding_infos(
    module: KeyedCachedEmbeddingBagCollection, params: dict[str, ParameterSharding]
) -> dict[str, list[EmbeddingShardingInfo]]:
    """TorchRec's per-table sharding inputs, by sharding type (every table planned, row-wise refused)."""
    infos: dict[str, list[EmbeddingShardingInfo]] = {}
    for config in module.embedding_bag_configs():
        sharding = params.get(str(config.name))
        if sharding is None:
            raise SlipcacheError(f"the sharding plan has no entry for table {config.name!r}")
        if sharding.sharding_type not in SHARDING_TYPES:
            raise SlipcacheError(ROW_WISE_REFUSAL.format(table=config.name, kind=sharding.sharding_type))
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


def _sharding(kind: str, infos: list[EmbeddingShardingInfo], env: ShardingEnv, device: torch.device) -> Any:
    if kind == ShardingType.TABLE_WISE.value:
        return TwPooledEmbeddingSharding(infos, env, device)
    return CwPooledEmbeddingSharding(infos, env, device, permute_embeddings=False)


class _NoShards(nn.Module):
    """The lookup of a rank that holds no table of a sharding type: it still takes part in the
    all-to-alls (and in their backward, so it answers with an empty output that takes gradients)."""

    collections: list[Any] = []
    feature_names: list[str] = []


def _local_pooled(
    lookup: KeyedCachedEmbeddingBagCollection | _NoShards, features: KeyedJaggedTensor, batch: int, training: bool
) -> Tensor:
    """Pooled [global batch, this rank's columns] of the features the input distribution delivered."""
    if isinstance(lookup, _NoShards):
        return torch.zeros(batch, 0).requires_grad_(training and torch.is_grad_enabled())
    renamed = KeyedJaggedTensor(
        keys=list(lookup.feature_names),
        values=features.values(),
        lengths=features.lengths(),
        weights=features.weights_or_none(),
        stride=features.stride(),
    )
    return lookup(renamed).values()


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
        default = options.get("cache_size", EmbeddingConfig.cache_size)
        per_table = default if isinstance(default, Mapping) else {shard_name(t): default for t in mine}
        options["cache_size"] = {**per_table, **shares}
    return options


def _tables_of_rank(sharding: Any, rank: int) -> list[Any]:
    """The shards `rank` holds, in the order the input distribution delivers their features."""
    mine = [t for t in sharding.embedding_tables() if t.local_metadata.placement.rank() == rank]
    if [f for t in mine for f in t.feature_names] != sharding.feature_names_per_rank()[rank]:
        raise RuntimeError("shard order differs from the input distribution's feature order")
    return mine


def _local_lookup(
    module: KeyedCachedEmbeddingBagCollection,
    mine: list[Any],
    params: dict[str, ParameterSharding],
    device: torch.device,
    tables: list[Tensor] | None,
    overrides: Mapping[str, Any],
) -> nn.Module:
    """This rank's shards of one sharding type as our collection. Its features are named by position (a
    column-wise table split twice on one rank reads its features twice), in the order the input
    distribution delivers them; its rows are the module's (rounded per shard), or its own draw on meta."""
    names = [str(t.name) for t in module.embedding_bag_configs()]
    configs, position = [], 0
    for table in mine:
        count = len(table.feature_names)
        configs.append(
            EmbeddingBagConfig(
                num_embeddings=int(table.local_rows),
                embedding_dim=int(table.local_cols),
                name=shard_name(table),
                feature_names=[str(p) for p in range(position, position + count)],
                pooling=table.pooling,
            )
        )
        position += count
    if not configs:
        return _NoShards()
    options = _shard_options(module, mine, params, overrides)
    lookup = KeyedCachedEmbeddingBagCollection(
        configs, is_weighted=module.is_weighted(), device=device, **options
    )
    for collection in lookup.collections:
        collection.sharded_by_slipcache = True  # one rank's shards: they differ by rank on purpose
    if tables is not None:
        rows = []
        for table in mine:
            full = tables[names.index(table.name)]
            start, width = table.local_metadata.shard_offsets[1], table.local_metadata.shard_sizes[1]
            rows.append(full[:, start : start + width])
        lookup.load_tables(rows)
    return lookup
