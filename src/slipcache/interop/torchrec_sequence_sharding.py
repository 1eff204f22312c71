"""`KeyedCachedEmbeddingCollection` (sequence features) sharded by TorchRec's `DistributedModelParallel`.

    model = DistributedModelParallel(model, sharders=[KeyedCachedEmbeddingCollectionSharder()])

As for the bag collection (`torchrec_sharding.py`, whose shard placement, lookups, checkpoint and fused
optimizer this module shares), TorchRec does the distributed work with its sequence shardings and only the
lookup between their input and output distributions is ours: each rank's shards of a sharding type are one
`KeyedCachedEmbeddingCollection`, which returns a row per id it was sent and updates the rows it holds in
backward. The sharding types are those TorchRec's `EmbeddingCollectionSharder` offers:

- table-wise and column-wise: TorchRec's `Tw`/`CwSequenceEmbeddingSharding` (ids all-to-all to the table's
  rank, one row per id all-to-all back; a column-wise table's column shards joined per feature);
- row-wise: TorchRec's `RwSequenceEmbeddingSharding` (ids bucketized by row range and sent to the rank
  holding them, their rows sent back and put in the ids' order by the bucketization's permutation);
- data-parallel: every rank holds the whole table and looks up the global batch (the ranks' ids
  all-gathered), keeping its own ids' rows; backward all-gathers their gradient, so every replica applies
  the same update, as one process would on the whole batch (as the bag collection's data-parallel tables).

Table-row-wise, table-column-wise and grid are refused in one line: TorchRec has no sequence sharding of
those types. A sharding type sends one [ids, width] tensor, so its tables (or column shards) must be of one
width; others are refused in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.distributed.embedding import EmbeddingCollectionAwaitable, EmbeddingCollectionContext
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo, KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardedModule,
    ShardingEnv,
)
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from slipcache.errors import SlipcacheError
from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection, KeyedCachedEmbeddingCollection
from slipcache.interop.torchrec_optim import CachedTablesOptimizer
from slipcache.interop.torchrec_sharding import (
    CW,
    DP,
    RW,
    TW,
    CachedTablesSharder,
    Done,
    NoShards,
    ReplicaSlice,
    ReplicatedFeaturesDist,
    ShardedCachedTables,
    by_position,
)

logger = logging.getLogger(__name__)

# TorchRec's EmbeddingCollectionSharder's types, in the order of the lookups
SEQUENCE_SHARDING_TYPES = (TW, CW, RW, DP)
REFUSAL = (
    "table {table!r}: {kind} sharding is not offered for sequence tables (TorchRec has no sequence sharding "
    "of that type); use one of " + ", ".join(SEQUENCE_SHARDING_TYPES)
)


class KeyedCachedEmbeddingCollectionSharder(CachedTablesSharder[KeyedCachedEmbeddingCollection]):
    """TorchRec's sharder for `KeyedCachedEmbeddingCollection`: table-wise, column-wise, row-wise and
    data-parallel (those of TorchRec's `EmbeddingCollectionSharder`), on CPU and GPUs. Cache shares
    (`CacheParams`), `fused_params` and `apply_optimizer_in_backward` act as for the bag collection's
    sharder (`KeyedCachedEmbeddingBagCollectionSharder`)."""

    offered = SEQUENCE_SHARDING_TYPES

    @property
    def module_type(self) -> type[KeyedCachedEmbeddingCollection]:
        return KeyedCachedEmbeddingCollection

    def shard(
        self,
        module: KeyedCachedEmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedKeyedCachedEmbeddingCollection:
        return ShardedKeyedCachedEmbeddingCollection(
            module, params, env, device or torch.device("cpu"), self.qcomm_codecs_registry,
            self.shard_overrides(module),
        )


class ShardedKeyedCachedEmbeddingCollection(
    ShardedCachedTables,
    ShardedModule[KJTList, list[Tensor], dict[str, JaggedTensor], EmbeddingCollectionContext],
    FusedOptimizerModule,
):
    """One rank's part of a sharded `KeyedCachedEmbeddingCollection`: the unsharded module's output
    ({feature: JaggedTensor of its ids' rows}, features in table order) on this rank's slice of the batch.

    `lookups[i]` holds this rank's shards of the i-th sharding type (in SEQUENCE_SHARDING_TYPES' order) as
    one `KeyedCachedEmbeddingCollection`; checkpoints and `fused_optimizer` are the bag collection's
    (`ShardedCachedTables`)."""

    def __init__(
        self,
        module: KeyedCachedEmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        """`overrides`: options that replace the module's in every shard (the sharder's fused_params)."""
        super().__init__(qcomm_codecs_registry)
        self._sequence_configs = module.embedding_configs()
        self._need_indices = module.need_indices()
        self._plan_shardings(
            module, params, env, SEQUENCE_SHARDING_TYPES, REFUSAL,
            lambda kind, infos: _sequence_sharding(kind, infos, env, device, qcomm_codecs_registry),
        )
        # the width of the rows each sharding type sends (one per type)
        self._widths = [_one_width(kind, s) for kind, s in zip(self._sharding_types, self._shardings, strict=True)]
        self._input_dists = nn.ModuleList(
            ReplicatedFeaturesDist(env.process_group, len(s.feature_names()), env.world_size)
            if kind == DP
            else s.create_input_dist()
            for kind, s in zip(self._sharding_types, self._shardings, strict=True)
        )
        self._output_dists = nn.ModuleList(
            _ReplicaRowsDist(env.process_group, env.rank) if kind == DP else s.create_output_dist(device)
            for kind, s in zip(self._sharding_types, self._shardings, strict=True)
        )
        self._place_shards(module, params, device, overrides or {})
        self._input_order = None
        self._input_keys = []
        # a column-wise feature's shards in column order, from their order in the output distribution's
        self._column_order = {
            name: order
            for kind, s in zip(self._sharding_types, self._shardings, strict=True)
            if kind == CW
            for name, order in _column_shard_order(s).items()
        }
        self._optimizer = CachedTablesOptimizer(self)
        logger.debug(
            "rank %d holds sequence shards %s",
            env.rank,
            {kind: [t.name for t in mine] for kind, mine in zip(self._sharding_types, self.local_tables, strict=True)},
        )

    @property
    def unsharded_module_type(self) -> type[KeyedCachedEmbeddingCollection]:
        return KeyedCachedEmbeddingCollection

    def embedding_configs(self) -> list[Any]:
        return list(self._sequence_configs)

    def need_indices(self) -> bool:
        return self._need_indices

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext(sharding_contexts=[])

    # ------------------------------------------------------------------ input, lookup, output
    def input_dist(
        self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        """The features grouped by sharding type, each sent by its input distribution to its tables; the
        context keeps them (the output is built on them) and row-wise's permutation of the bucketized ids."""
        with torch.no_grad():
            splits = self._split_by_sharding(features)
            awaitables = []
            for kind, dist, part in zip(self._sharding_types, self._input_dists, splits, strict=True):
                awaitables.append(dist(part))
                ctx.sharding_contexts.append(
                    SequenceShardingContext(
                        features_before_input_dist=part,
                        unbucketize_permute_tensor=dist.unbucketize_permute_tensor if kind == RW else None,
                    )
                )
        return KJTListSplitsAwaitable(awaitables, ctx)

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: KJTList) -> list[Tensor]:
        self._optimizer.follow_param_groups()  # a scheduler's lr applies from this step's backward on
        rows = []
        for lookup, features, c, width in zip(
            self.lookups, dist_input, ctx.sharding_contexts, self._widths, strict=True
        ):
            c.lengths_after_input_dist = features.lengths().view(-1, features.stride())
            rows.append(_local_rows(lookup, features, width, self.training))
        return rows

    def output_dist(
        self, ctx: EmbeddingCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        """The rows back through TorchRec's sequence all-to-alls, as TorchRec's JaggedTensor per feature."""
        awaitables = [
            dist(rows, c) for dist, rows, c in zip(self._output_dists, output, ctx.sharding_contexts, strict=True)
        ]
        awaitable = EmbeddingCollectionAwaitable(
            awaitables_per_sharding=awaitables,
            features_per_sharding=[c.features_before_input_dist for c in ctx.sharding_contexts],
            embedding_names_per_sharding=[s.embedding_names() for s in self._shardings],
            ctx=ctx,
            need_indices=self._need_indices,
            features_to_permute_indices=self._column_order,
        )
        awaitable.callbacks.append(self._in_table_order)
        return awaitable

    def _in_table_order(self, rows: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return {name: rows[name] for name in self._feature_names}


def _sequence_sharding(
    kind: str, infos: list[EmbeddingShardingInfo], env: ShardingEnv, device: torch.device,
    codecs: dict[str, QuantizedCommCodecs] | None,
) -> Any:
    """TorchRec's sequence sharding of `kind`; `codecs` encode the rows on the wire (data-parallel sends none)."""
    if kind == TW:
        return TwSequenceEmbeddingSharding(infos, env, device, qcomm_codecs_registry=codecs)
    if kind == CW:
        return CwSequenceEmbeddingSharding(infos, env, device, qcomm_codecs_registry=codecs)
    if kind == RW:
        return RwSequenceEmbeddingSharding(infos, env, device, qcomm_codecs_registry=codecs)
    return DpSequenceEmbeddingSharding(infos, env, device)


def _one_width(kind: str, sharding: Any) -> int:
    """The one width of the rows a sharding type sends, or a one-line refusal naming two that differ."""
    names, widths = sharding.embedding_names(), [int(w) for w in sharding.embedding_dims()]
    other = next((i for i, w in enumerate(widths) if w != widths[0]), None)
    if other is not None:
        raise SlipcacheError(
            f"features {names[0]!r} and {names[other]!r} are both {kind} with rows {widths[0]} and "
            f"{widths[other]} wide: a sequence sharding sends one [ids, width] tensor per sharding type; give "
            "their tables one width (and column shards one size), or other sharding types"
        )
    return widths[0]


def _column_shard_order(sharding: Any) -> dict[str, list[int]]:
    """Per feature of a column-wise sharding with several column shards: which of its shards, in the order
    the output distribution delivers them (rank order), holds its 1st, 2nd, ... columns (TorchRec's
    `features_to_permute_indices`)."""
    starts: dict[str, list[int]] = {}
    for name, meta in zip(sharding.embedding_names(), sharding.embedding_shard_metadata(), strict=True):
        starts.setdefault(name, []).append(int(meta.shard_offsets[1]))
    return {name: sorted(range(len(s)), key=s.__getitem__) for name, s in starts.items() if len(s) > 1}


def _local_rows(
    lookup: KeyedCachedEmbeddingBagCollection | NoShards, features: KeyedJaggedTensor, width: int, training: bool
) -> Tensor:
    """[ids, width]: the rows of the ids the input distribution delivered, in their order."""
    if isinstance(lookup, NoShards):
        return torch.zeros(0, width).requires_grad_(training and torch.is_grad_enabled())
    rows = lookup(by_position(lookup, features))
    return torch.cat([rows[name].values() for name in lookup.feature_names])


class _ReplicaRowsDist(nn.Module):
    """Data-parallel output distribution of rows: the global batch's rows (feature by feature, each in rank
    order) put rank by rank, this rank's kept and the gradient all-gathered (`ReplicaSlice`)."""

    def __init__(self, pg: Any, rank: int) -> None:
        super().__init__()
        self._pg, self._rank = pg, rank

    def forward(self, rows: Tensor, sharding_ctx: SequenceShardingContext | None = None) -> Awaitable[Tensor]:
        if sharding_ctx is None or not sharding_ctx.batch_size_per_rank:
            raise RuntimeError("data-parallel output distribution needs the batch size of every rank")
        batch_per_rank = [int(b) for b in sharding_ctx.batch_size_per_rank]
        lengths = sharding_ctx.lengths_after_input_dist  # [features, global batch]
        if lengths is None:
            raise RuntimeError("data-parallel output distribution needs the lengths after the input distribution")
        ids = torch.stack([part.sum(dim=1) for part in lengths.split(batch_per_rank, dim=1)], dim=1)  # [f, rank]
        starts = torch.cat([ids.new_zeros(1), ids.flatten().cumsum(0)[:-1]]).view_as(ids)
        order = torch.cat(
            [
                torch.arange(int(starts[f, r]), int(starts[f, r] + ids[f, r]))
                for r in range(len(batch_per_rank))
                for f in range(ids.shape[0])
            ]
            + [torch.zeros(0, dtype=torch.int64)]
        )
        by_rank = rows.index_select(0, order.to(rows.device))
        return Done(ReplicaSlice.apply(by_rank, ids.sum(dim=0).tolist(), self._rank, self._pg))
