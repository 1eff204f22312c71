"""TorchRec interop: our cached, low-precision tables where a TorchRec `EmbeddingBagCollection` goes.

`KeyedCachedEmbeddingBagCollection` is built from TorchRec `EmbeddingBagConfig`s, takes a
`KeyedJaggedTensor` and returns a `KeyedTensor`, and answers `embedding_bag_configs()` and `is_weighted()`,
so TorchRec models (`torchrec.models.dlrm.DLRM`, `SparseArch`) accept it in place of theirs. TorchRec's
training tables are fp32/fp16 only (pytorch/torchrec#1180, #2264); these are INT8/INT4 behind an fp32
cache and update themselves in backward (no optimizer over them: give the model's `parameters()` to a torch
optimizer; the collection's own are one empty slot per table, which take no gradient, for
`apply_optimizer_in_backward` to set the tables' optimizer through). How each config field is honoured:
`slipcache.interop.tables`.
Under `DistributedModelParallel` the tables are sharded by `KeyedCachedEmbeddingBagCollectionSharder`.

Tables of one embedding dim and pooling share one `CachedEmbeddingBagCollection` (`collections[g]`); tables
of several dims or poolings get one each, and their outputs are concatenated in TorchRec's key order.
Only the collections' public API is used (forward, export_tables, load_tables, stats, memory_report).

torchrec is optional (`pip install 'slipcache[torchrec]'`): it is imported only when a KJT is converted or a
KeyedTensor built, and only its public classes are used.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx
from torch import Tensor, nn

from slipcache.embedding.collection import CachedEmbeddingBagCollection, SparseFeatures, initial_rows
from slipcache.errors import InvalidInputError, SlipcacheError
from slipcache.interop.tables import (
    check_per_table_options,
    check_table_configs,
    custom_initial_rows,
    group_config,
    pooling_name,
)

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 (see README: Using slipcache with TorchRec)"
)


def import_torchrec() -> Any:
    """The torchrec module, or a one-line error saying how to install it."""
    try:
        import torchrec
    except ImportError as exc:
        raise SlipcacheError(f"torchrec is not installed: {INSTALL_HINT}") from exc
    return torchrec


def kjt_to_sparse(kjt: Any, feature_names: Sequence[str]) -> SparseFeatures:
    """A `KeyedJaggedTensor` as `SparseFeatures` with one group of bags per feature, in `feature_names` order."""
    _check_kjt(kjt, feature_names)
    lengths = _ordered(kjt, feature_names).lengths().view(len(feature_names), kjt.stride())
    return SparseFeatures.from_lengths(_ordered(kjt, feature_names).values(), lengths)


def _check_kjt(kjt: Any, feature_names: Sequence[str]) -> None:
    keys = list(kjt.keys())
    missing = [f for f in feature_names if f not in keys]
    if missing:
        raise InvalidInputError(f"KeyedJaggedTensor has no feature {missing[0]!r} (has: {', '.join(keys)})")
    if kjt.variable_stride_per_key():
        raise InvalidInputError("KeyedJaggedTensor with a batch size per feature is not supported")


def _ordered(kjt: Any, feature_names: Sequence[str]) -> Any:
    """The KJT with exactly `feature_names`, in that order (extra keys dropped)."""
    keys = list(kjt.keys())
    return kjt if keys == list(feature_names) else kjt.permute([keys.index(f) for f in feature_names])


class _Group:
    """Tables of one (dim, pooling): their collection's index, their global indices, their features."""

    def __init__(self, index: int, tables: list[int], features: list[list[int]]) -> None:
        self.index = index
        self.tables = tables
        self.features = features  # per table of the group: the global indices of the features reading it


class KeyedCachedEmbeddingBagCollection(nn.Module):
    """Cached low-precision tables that speak TorchRec: KJT in, `KeyedTensor` out.

    forward(KeyedJaggedTensor) -> KeyedTensor (keys: the features in table order, as TorchRec's collection
    orders them); with one dim and pooling, ids [B, T] or `SparseFeatures` still give the plain [B, T, D]
    tensor. `is_weighted=True` takes per-id weights from the KJT (sum pooling). Attributes the tables'
    collection answers (stats, memory_report, config, ...) are forwarded to it when there is one.

    `options` are `EmbeddingConfig` fields; `precision`, `cache_size` and `cache_rows` may be dicts by table
    name. `device`: where the cache lives (rows are stored in host memory); "meta" allocates nothing, for a
    model that `DistributedModelParallel` shards: each shard then draws its own rows, or, with
    `draw_like_one_process`, exactly the rows this collection would have drawn on the CPU, streamed so
    that a rank holds only its shards' rows.
    """

    torchrec_prefix = "embedding_bags."  # the keys of TorchRec's weights: embedding_bags.<table>.weight

    def __init__(
        self, tables: Sequence[Any], *, is_weighted: bool = False, device: Any = None,
        draw_like_one_process: bool = False, **options: Any
    ) -> None:
        super().__init__()
        self.draw_like_one_process = draw_like_one_process
        check_table_configs(tables)
        self._torchrec_tables = list(tables)
        self.options = dict(options)  # what the sharder builds each rank's shards with
        self._is_weighted = bool(is_weighted)
        self.table_names = [str(t.name) for t in tables]
        if len(set(self.table_names)) != len(self.table_names):
            raise SlipcacheError(f"a table is named twice: {self.table_names}")
        self.feature_names = [f for t in tables for f in t.feature_names]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise SlipcacheError(f"a feature is named twice: {self.feature_names}")
        check_per_table_options(options, self.table_names)
        if is_weighted and any(pooling_name(t.pooling) != "sum" for t in tables):
            raise SlipcacheError("per-id weights (is_weighted=True) need sum pooling on every table")
        feature_of: list[list[int]] = []
        start = 0
        for t in tables:
            feature_of.append(list(range(start, start + len(t.feature_names))))
            start += len(t.feature_names)
        keys: dict[tuple[int, str], list[int]] = {}
        for i, t in enumerate(tables):
            keys.setdefault((int(t.embedding_dim), pooling_name(t.pooling)), []).append(i)
        self._groups = [
            _Group(g, members, [feature_of[i] for i in members]) for g, members in enumerate(keys.values())
        ]
        # One collection whose tables each one feature reads, in table order: its [B, T, D] output is the
        # KeyedTensor's values without a copy per feature (and without their slices' backward).
        self._one_feature_per_table_in_order = len(self._groups) == 1 and self._groups[0].features == [
            [t] for t in range(len(tables))
        ]
        self.placement = _placement(device)
        collections = nn.ModuleList(
            CachedEmbeddingBagCollection(
                group_config([tables[i] for i in g.tables], options, **self.placement)
            )
            for g in self._groups
        )
        # A ModuleList (child modules: state dict, device moves); to a type checker, what it holds.
        self.collections = cast("Sequence[CachedEmbeddingBagCollection]", collections)
        if self.placement.get("storage_device") != "meta":
            self._draw_custom_rows(int(options.get("seed", 0)))
        self._feature_dims = [int(t.embedding_dim) for t in tables for _ in t.feature_names]
        self._ignored_keys: set[str] = set()  # extra KJT keys already warned about
        self.optimizer_slots = _OptimizerSlots([int(t.embedding_dim) for t in tables])
        self._slots_seen = [0] * len(tables)  # apply_optimizer_in_backward calls already followed, per table
        self.register_load_state_dict_post_hook(_load_torchrec_weights)

    def _draw_custom_rows(self, seed: int) -> None:
        """Tables whose config asks for its own initialization start from TorchRec's draw of it."""
        drawn = [custom_initial_rows(t, seed + i) for i, t in enumerate(self._torchrec_tables)]
        if any(rows is not None for rows in drawn):
            current = self.export_tables()
            self.load_tables([d if d is not None else c for d, c in zip(drawn, current, strict=True)])

    def __prepare_scriptable__(self) -> None:
        raise SlipcacheError(
            "torch.jit.script cannot compile these tables (their lookup is data-dependent Python); trace the "
            "model with torch.fx.symbolic_trace or torchrec.fx.symbolic_trace instead"
        )

    # ------------------------------------------------------------------------------ TorchRec's API
    def embedding_bag_configs(self) -> list[Any]:
        """The TorchRec configs it was built from (what `torchrec.models.dlrm.SparseArch` reads)."""
        return list(self._torchrec_tables)

    def is_weighted(self) -> bool:
        """Whether lookups take the KJT's per-id weights (as TorchRec's `is_weighted`)."""
        return self._is_weighted

    @property
    def table_sizes(self) -> list[int]:
        return [int(t.num_embeddings) for t in self._torchrec_tables]

    @property
    def lr(self) -> float:
        return self.collections[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for collection in self.collections:
            collection.lr = value

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            collections = self.__dict__.get("_modules", {}).get("collections")
            if collections is not None and len(collections) == 1 and not name.startswith("_"):
                return getattr(collections[0], name)
            raise

    # ------------------------------------------------------------------------------ state dict
    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """A TorchRec `EmbeddingBagCollection`'s weights (`embedding_bags.<table>.weight`, alone or inside a
        whole model's state_dict) load too: taken here, rounded into the tables once the load is done
        (`_load_torchrec_weights`). A state_dict of our own keys loads exactly, as saved."""
        weights = {k: v for k, v in state_dict.items() if k.startswith(prefix + self.torchrec_prefix)}
        ours = any(k.startswith(prefix + "collections.") for k in state_dict)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if weights and not ours:
            keys = {prefix + self.torchrec_prefix + f"{name}.weight": name for name in self.table_names}
            taken = {keys[k]: v for k, v in weights.items() if k in keys}
            unexpected_keys[:] = [k for k in unexpected_keys if k not in keys]
            self.__dict__["_torchrec_weights"] = (prefix, taken)

    # ------------------------------------------------------------------------------ quantization
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "qconfig":  # a quantization pass: TorchRec's refused unless it names this class
            from slipcache.interop.torchrec_quant import check_qconfig

            check_qconfig(value)
        super().__setattr__(name, value)

    @classmethod
    def from_float(cls, module: KeyedCachedEmbeddingBagCollection, **_: Any) -> KeyedCachedEmbeddingBagCollection:
        """TorchRec's module swap, when `quantize_embeddings` names this class: every table stored at the
        dtype the qconfig asks for (`torchrec_quant.py`); the module itself is kept."""
        from slipcache.interop.torchrec_quant import precisions_of

        module.store_at(precisions_of(module.qconfig, module.table_names))
        return module

    def store_at(self, precision: str | dict[str, str]) -> None:
        """Store the tables at `precision` (one, or one per table name): their current rows rounded to
        nearest into it, the optimizer state started again (for inference, as after TorchRec's quantization).
        The tables' configs take the matching data_type."""
        from slipcache.interop.tables import data_type_named
        from slipcache.interop.torchrec_quant import DATA_TYPE_OF_PRECISION

        if self.placement.get("storage_device") == "meta":
            raise SlipcacheError("tables on the meta device hold no rows to store at another precision")
        wanted = precision if isinstance(precision, dict) else dict.fromkeys(self.table_names, precision)
        current = {
            name: p for c in self.collections for name, p in zip(c.table_names, c.config.precisions, strict=True)
        }
        if wanted == current:
            logger.info("tables already stored at %s", wanted)
            return
        rows = self.export_tables()
        self._torchrec_tables = [
            dataclasses.replace(t, data_type=data_type_named(DATA_TYPE_OF_PRECISION[wanted[str(t.name)]]))
            for t in self._torchrec_tables
        ]
        self.options["precision"] = dict(wanted)
        collections = nn.ModuleList(
            CachedEmbeddingBagCollection(
                group_config([self._torchrec_tables[i] for i in g.tables], self.options, **self.placement),
                draw_rows=False,
            )
            for g in self._groups
        )
        self.collections = cast("Sequence[CachedEmbeddingBagCollection]", collections)
        self.load_tables(rows)
        logger.info("tables stored at %s (were %s)", wanted, current)

    # ----------------------------------------------------------------------------- the optimizer
    def in_backward_options(self) -> dict[str, Any] | None:
        """The optimizer `apply_optimizer_in_backward` attached to the tables' slots, as our options (None:
        it was not called). Tables of one collection share one optimizer: different ones are refused."""
        from slipcache.interop.torchrec_fused import in_backward_options

        per_table = [in_backward_options(p) for p in self.optimizer_slots]
        if all(options is None for options in per_table):
            return None
        if any(options != per_table[0] for options in per_table):
            described = ", ".join(
                f"{name}: {'none' if o is None else o['optimizer']}"
                for name, o in zip(self.table_names, per_table, strict=True)
            )
            raise SlipcacheError(
                "apply_optimizer_in_backward must give every table of slipcache's collection the same optimizer "
                f"and settings (it gave {described}); apply it to all of ebc.parameters() at once"
            )
        return per_table[0]

    def _follow_in_backward(self) -> None:
        """Set the tables' optimizer as `apply_optimizer_in_backward` asked, once per call of it."""
        seen = [len(getattr(p, "_optimizer_classes", ())) for p in self.optimizer_slots]
        if seen == self._slots_seen:
            return
        options = self.in_backward_options()
        self._slots_seen = seen
        if options is not None:
            for collection in self.collections:
                collection.set_optimizer(**options)
            logger.info("tables' optimizer set by apply_optimizer_in_backward: %s", options)

    # ---------------------------------------------------------------------------------- forward
    def forward(self, features: Any) -> Any:
        if isinstance(features, (Tensor, SparseFeatures)):
            if len(self.collections) != 1:
                raise InvalidInputError("tables of several dims or poolings take a KeyedJaggedTensor")
            self._follow_in_backward()
            return self.collections[0](features)
        return _keyed_lookup(self, features)

    def _read_input(self, kjt: Any, accepted: str) -> tuple[Any, Tensor]:
        """The KJT's features in table order and their lengths [features, batch], once it is checked (and
        the tables' optimizer follows `apply_optimizer_in_backward`). `accepted` names the inputs taken."""
        if not hasattr(kjt, "lengths") or not hasattr(kjt, "keys"):
            raise InvalidInputError(f"expected {accepted}, got {type(kjt).__name__}")
        _check_kjt(kjt, self.feature_names)
        self._follow_in_backward()
        self._warn_extra_keys(kjt)
        if kjt.weights_or_none() is not None and not self._is_weighted:
            raise InvalidInputError(
                "weighted KeyedJaggedTensor (per-id weights) given to tables built with is_weighted=False; "
                "build them with is_weighted=True"
            )
        ordered = _ordered(kjt, self.feature_names)
        return ordered, ordered.lengths().view(len(self.feature_names), kjt.stride())

    def _lookup(self, kjt: Any) -> Any:
        ordered, lengths = self._read_input(kjt, "a KeyedJaggedTensor, SparseFeatures or ids [batch, tables]")
        batch = kjt.stride()
        if not self._is_weighted and self._one_feature_per_table_in_order:  # the KJT is the group's input
            values = ordered.values()
            if values.numel() == lengths.numel() and bool((lengths == 1).all()):
                # one id per bag (Criteo's features): ids [B, T], whose lookups pool and unpool as views
                out = self.collections[0](values.view(len(self.feature_names), batch).t())
            else:
                out = self.collections[0](SparseFeatures.from_lengths(values, lengths))
            return _keyed_values(out.reshape(batch, -1), self.feature_names, int(out.shape[2]))
        values = torch.split(ordered.values(), lengths.sum(dim=1).tolist())
        weights = None
        if self._is_weighted:
            if ordered.weights_or_none() is None:
                raise InvalidInputError("tables built with is_weighted=True need a KJT with weights")
            weights = torch.split(ordered.weights(), lengths.sum(dim=1).tolist())
        pooled: list[Tensor | None] = [None] * len(self.feature_names)
        for group, collection in zip(self._groups, self.collections, strict=True):
            rounds = max(len(f) for f in group.features)
            for r in range(rounds):  # a table several features read is looked up once per feature
                members = [(t, f[r]) for t, f in enumerate(group.features) if r < len(f)]
                if weights is None:
                    out = collection(_round_features(values, lengths, members, len(group.tables), batch))
                    for t, f in members:
                        pooled[f] = out[:, t]
                else:
                    for f, rows in _weighted_round(
                        collection, values, weights, lengths, members, group, batch
                    ):
                        pooled[f] = rows
        return keyed_tensor_of(pooled, self.feature_names)  # type: ignore[arg-type]

    def _warn_extra_keys(self, kjt: Any) -> None:
        keys: list[str] = list(kjt.keys())
        extra = [k for k in keys if k not in self.feature_names and k not in self._ignored_keys]
        if extra:
            self._ignored_keys.update(extra)
            warnings.warn(
                f"KeyedJaggedTensor features {extra} are read by no table and ignored "
                f"(tables read: {', '.join(self.feature_names)})",
                stacklevel=3,
            )

    # ------------------------------------------------------------------------------------ tables
    def initial_rows(self) -> Iterator[tuple[int, int, Tensor]]:
        """(table in config order, its first row, fp32 values): the rows this collection draws on the CPU,
        chunk by chunk, also on meta (a sharded rank keeps its shards' part). The values tensor is reused."""
        for group, collection in zip(self._groups, self.collections, strict=True):
            for t, first, values in initial_rows(collection.table_sizes, collection.dim, collection.config.seed):
                yield group.tables[t], first, values

    def export_tables(self) -> list[Tensor]:
        """Current fp32 values of every table, in the order of the configs."""
        tables: list[Tensor | None] = [None] * len(self._torchrec_tables)
        for group, collection in zip(self._groups, self.collections, strict=True):
            for i, table in zip(group.tables, collection.export_tables(), strict=True):
                tables[i] = table
        return tables  # type: ignore[return-value]

    def load_tables(self, tables: Sequence[Tensor]) -> None:
        """Replace every row with fp32 `tables` (config order), rounded to nearest into storage precision."""
        if len(tables) != len(self._torchrec_tables):
            raise InvalidInputError(f"expected {len(self._torchrec_tables)} tables, got {len(tables)}")
        for group, collection in zip(self._groups, self.collections, strict=True):
            collection.load_tables([tables[i] for i in group.tables])


class KeyedCachedEmbeddingCollection(KeyedCachedEmbeddingBagCollection):
    """Cached low-precision tables where a TorchRec `EmbeddingCollection` goes (sequence features, no
    pooling): forward(KeyedJaggedTensor) -> {feature: JaggedTensor of its ids' rows [ids, D], the KJT's
    lengths}, as TorchRec's. Built from TorchRec `EmbeddingConfig`s; storage, cache, fused update, options
    and TorchRec's optimizer conventions are the bag collection's: every id is looked up as a bag of its
    own, so each row read trains. TorchRec's weights load from `embeddings.<table>.weight`. Tables of
    several dims are allowed (TorchRec's collection wants one). Under `DistributedModelParallel` the tables
    are sharded by `KeyedCachedEmbeddingCollectionSharder`."""

    torchrec_prefix = "embeddings."  # TorchRec's EmbeddingCollection: embeddings.<table>.weight

    def __init__(self, tables: Sequence[Any], *, device: Any = None, need_indices: bool = False,
                 **options: Any) -> None:
        torchrec = import_torchrec()
        if not tables:
            raise SlipcacheError("no tables: give at least one EmbeddingConfig")
        if options.get("is_weighted"):
            raise SlipcacheError("per-id weights are not supported for sequence features (TorchRec's "
                                 "EmbeddingCollection takes none either)")
        options.pop("is_weighted", None)
        pooled = [t.name for t in tables if hasattr(t, "pooling")]
        if pooled:
            raise SlipcacheError(f"table {pooled[0]!r} is an EmbeddingBagConfig (pooled): give EmbeddingConfigs, or "
                                 "use KeyedCachedEmbeddingBagCollection")
        fields = [f.name for f in dataclasses.fields(torchrec.EmbeddingBagConfig) if f.name != "pooling"]
        bags = [
            torchrec.EmbeddingBagConfig(**{name: getattr(t, name) for name in fields if hasattr(t, name)},
                                        pooling=torchrec.PoolingType.SUM)
            for t in tables
        ]
        for bag in bags:
            bag.feature_names = list(bag.feature_names) or [str(bag.name)]  # as TorchRec's collection names them
        super().__init__(bags, device=device, **options)
        self._sequence_tables = list(tables)
        self._need_indices = bool(need_indices)

    def embedding_configs(self) -> list[Any]:
        """The TorchRec configs it was built from."""
        return list(self._sequence_tables)

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(t.feature_names) for t in self._torchrec_tables]

    def embedding_dim(self) -> int:
        return int(self._torchrec_tables[0].embedding_dim)

    def need_indices(self) -> bool:
        """Whether each JaggedTensor carries its ids as weights (TorchRec's `need_indices`)."""
        return self._need_indices

    def forward(self, features: Any) -> Any:
        return _sequence_lookup(self, features)

    def _sequence(self, kjt: Any) -> dict[str, Any]:
        torchrec = import_torchrec()
        ordered, lengths = self._read_input(kjt, "a KeyedJaggedTensor")
        values = torch.split(ordered.values(), lengths.sum(dim=1).tolist())
        rows: list[Tensor | None] = [None] * len(self.feature_names)
        for group, collection in zip(self._groups, self.collections, strict=True):
            for r in range(max(len(f) for f in group.features)):  # a table several features read: once each
                members = [(t, f[r]) for t, f in enumerate(group.features) if r < len(f)]
                for f, looked_up in _each_id_alone(collection, values, members, len(group.tables)):
                    rows[f] = looked_up
        return {
            name: torchrec.JaggedTensor(values=rows[f], lengths=lengths[f],
                                        weights=values[f] if self._need_indices else None)
            for f, name in enumerate(self.feature_names)
        }


@torch.fx.wrap
def _sequence_lookup(module: KeyedCachedEmbeddingCollection, kjt: Any) -> Any:
    """One call in a traced graph, as `_keyed_lookup`."""
    return module._sequence(kjt)


def _load_torchrec_weights(module: nn.Module, incompatible: Any) -> None:
    """After a load of TorchRec-keyed weights: our own keys were not expected, the tables without a weight
    are (and keep their rows), and the weights are rounded into the tables' storage precision."""
    pending = module.__dict__.pop("_torchrec_weights", None)
    if pending is None or not isinstance(module, KeyedCachedEmbeddingBagCollection):
        return
    prefix, weights = pending
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(prefix)]
    incompatible.missing_keys.extend(
        f"{prefix}{module.torchrec_prefix}{name}.weight" for name in module.table_names if name not in weights
    )
    current = module.export_tables()
    with torch.no_grad():
        module.load_tables(
            [
                weights[name].detach().float().cpu() if name in weights else current[i]
                for i, name in enumerate(module.table_names)
            ]
        )
    logger.info("loaded TorchRec weights of tables %s", sorted(weights))


class _OptimizerSlots(nn.ParameterList):
    """One empty parameter per table ([0, dim]), for TorchRec's `apply_optimizer_in_backward(cls, ebc.parameters(),
    kwargs)` to attach the tables' optimizer to, as it does to an `EmbeddingBagCollection`'s weights (our
    rows are no parameters: their update is fused in backward). They never take a gradient (a torch optimizer
    given them skips them) and are not in the state dict."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__([nn.Parameter(torch.empty(0, dim)) for dim in dims])  # [0 rows, dim]: 2-D as a table

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        return None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None


def _placement(device: Any) -> dict[str, str]:
    """`EmbeddingConfig` device fields for `device=`: the cache on it, the rows in host memory (all on
    "meta" for a model built only to be sharded)."""
    if device is None:
        return {}
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise SlipcacheError(f"device must name a torch device (cpu, cuda:0, meta), got {device!r}") from exc
    if device.type == "meta":
        return {"storage_device": "meta", "cache_device": "meta"}
    return {"cache_device": str(device)}


@torch.fx.wrap
def _keyed_lookup(module: KeyedCachedEmbeddingBagCollection, kjt: Any) -> Any:
    """One call in a traced graph (`torch.fx` / `torchrec.fx.symbolic_trace`): the lookup is data-dependent
    Python (the KJT's lengths pick the bags), so tracing records it whole instead of stepping into it."""
    return module._lookup(kjt)


def _round_features(
    values: Sequence[Tensor], lengths: Tensor, members: list[tuple[int, int]], num_tables: int, batch: int
) -> SparseFeatures:
    """The bags of one feature per table (`members`: table in group, feature) as the group's input."""
    round_lengths = torch.zeros(num_tables, batch, dtype=lengths.dtype)
    for t, f in members:
        round_lengths[t] = lengths[f]
    return SparseFeatures.from_lengths(torch.cat([values[f] for _, f in members]), round_lengths)


def _weighted_round(
    collection: CachedEmbeddingBagCollection,
    values: Sequence[Tensor],
    weights: Sequence[Tensor],
    lengths: Tensor,
    members: list[tuple[int, int]],
    group: _Group,
    batch: int,
) -> list[tuple[int, Tensor]]:
    """Per-id weighted sums: every id looked up as its own bag (so gradients reach each row through the
    collection's update), then weighted and summed into its bag here."""
    out = []
    for f, rows in _each_id_alone(collection, values, members, len(group.tables)):
        bag = torch.repeat_interleave(torch.arange(batch), lengths[f])
        weighted = rows * weights[f][:, None].to(rows.dtype)
        out.append((f, rows.new_zeros(batch, rows.shape[-1]).index_add(0, bag, weighted)))
    return out


def _each_id_alone(
    collection: CachedEmbeddingBagCollection, values: Sequence[Tensor], members: list[tuple[int, int]],
    num_tables: int,
) -> list[tuple[int, Tensor]]:
    """(feature, rows [its ids, D]): every id of the `members` (table in group, feature) looked up as a bag
    of its own in one call of the group's collection, so each row read trains through its update."""
    counts = [values[f].numel() for _, f in members]
    single = torch.zeros(num_tables, max(counts + [1]), dtype=torch.int64)
    for (t, _), n in zip(members, counts, strict=True):
        single[t, :n] = 1
    rows = collection(SparseFeatures.from_lengths(torch.cat([values[f] for _, f in members]), single))
    return [(f, rows[:n, t]) for (t, f), n in zip(members, counts, strict=True)]


def keyed_tensor_of(pooled: Sequence[Tensor], feature_names: Sequence[str]) -> Any:
    """Pooled [B, D_f] per feature as a TorchRec `KeyedTensor` keyed by feature."""
    torchrec = import_torchrec()
    return torchrec.KeyedTensor(
        keys=list(feature_names),
        length_per_key=[int(p.shape[1]) for p in pooled],
        values=torch.cat(list(pooled), dim=1),
        key_dim=1,
    )


def _keyed_values(values: Tensor, feature_names: Sequence[str], dim: int) -> Any:
    """[B, F * dim] values, `dim` columns per feature, as a `KeyedTensor` keyed by feature."""
    torchrec = import_torchrec()
    return torchrec.KeyedTensor(
        keys=list(feature_names), length_per_key=[dim] * len(feature_names), values=values, key_dim=1
    )


def keyed_tensor(pooled: Tensor, feature_names: Sequence[str]) -> Any:
    """[B, F, D] pooled embeddings as a TorchRec `KeyedTensor` keyed by feature."""
    return keyed_tensor_of(list(pooled.unbind(1)), feature_names)


def sparse_to_kjt(ids: Tensor, feature_names: Sequence[str]) -> Any:
    """One id per feature ([B, F], as our datasets hold them) as a `KeyedJaggedTensor`."""
    torchrec = import_torchrec()
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=list(feature_names),
        values=ids.t().reshape(-1).to(torch.int64),
        lengths=torch.ones(ids.numel(), dtype=torch.int64),
    )
