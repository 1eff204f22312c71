"""TorchRec table configs as our settings: pooling, storage precision, per-table options, initial rows.

Everything a TorchRec `EmbeddingBagConfig` says is either honoured or refused in one line:

- `data_type` other than FP32 sets the table's storage precision (FP16, BF16, INT8/UINT8, INT4); FP32,
  the field's default, leaves it to our `precision` option (INT8 unless given). An explicit `precision`
  that contradicts a table's non-FP32 `data_type` is refused;
- `weight_init_min`/`weight_init_max` and `init_fn` draw the table's first rows as TorchRec would
  (uniform in [min, max], or `init_fn` on an fp32 tensor), rounded into the storage precision;
- a sequence (unpooled) `EmbeddingConfig` is refused: these tables pool.

Options that vary per table (`precision`, `cache_size`, `cache_rows`) are given as one value for all
tables or a dict {table name: value}.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from slipcache.embedding.config import EmbeddingConfig
from slipcache.errors import InvalidInputError, SlipcacheError

PER_TABLE_OPTIONS = ("precision", "cache_size", "cache_rows")
# TorchRec's DataType value -> our storage precision (FP32 is the field's default: see `table_precision`)
DATA_TYPES = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16", "INT8": "int8", "UINT8": "int8", "INT4": "int4"}


def data_type_named(name: str) -> Any:
    """TorchRec's `DataType` of that name (INT8, INT4, FP16, BF16, FP32)."""
    from torchrec.modules.embedding_configs import DataType

    return DataType[name]


def pooling_name(pooling: Any) -> str:
    name = str(getattr(pooling, "value", pooling)).lower()
    if name not in ("sum", "mean"):
        raise SlipcacheError(f"pooling {name!r} is not supported (sum or mean)")
    return name


def check_table_configs(tables: Sequence[Any]) -> None:
    """Refuse, in one line, configs these pooled tables cannot honour."""
    if not tables:
        raise SlipcacheError("no tables: give at least one EmbeddingBagConfig")
    for table in tables:
        if not hasattr(table, "pooling"):
            raise SlipcacheError(
                f"table {getattr(table, 'name', '?')!r} is a sequence (unpooled) {type(table).__name__}: "
                "slipcache's tables pool their bags; give EmbeddingBagConfigs (sum or mean pooling)"
            )
        pooling_name(table.pooling)
        if getattr(table, "need_pos", False):
            raise SlipcacheError(
                f"table {table.name!r}: position-weighted tables (need_pos) are not supported"
            )
        if getattr(table, "num_embeddings_post_pruning", None) is not None:
            raise SlipcacheError(f"table {table.name!r}: num_embeddings_post_pruning is not supported")


def table_value(options: Mapping[str, Any], name: str, table: Any, default: Any) -> Any:
    """The value of per-table option `name` for `table`: its dict entry, or the one value, or `default`."""
    value = options.get(name, default)
    return value.get(str(table.name), default) if isinstance(value, Mapping) else value


def check_per_table_options(options: Mapping[str, Any], table_names: Sequence[str]) -> None:
    """A dict of per-table values names only tables that exist."""
    for name in PER_TABLE_OPTIONS:
        value = options.get(name)
        unknown = [k for k in value if k not in table_names] if isinstance(value, Mapping) else []
        if unknown:
            raise SlipcacheError(
                f"{name} names no table here: {unknown[0]!r} (tables: {', '.join(table_names)})"
            )


def table_precision(options: Mapping[str, Any], table: Any) -> str:
    """The storage precision of `table`: its non-FP32 data_type, else the `precision` option (int8)."""
    data_type = str(getattr(getattr(table, "data_type", None), "value", "FP32"))
    if data_type not in DATA_TYPES:
        raise SlipcacheError(
            f"table {table.name!r}: data_type {data_type} has no storage precision here "
            f"(one of {', '.join(DATA_TYPES)})"
        )
    given = table_value(options, "precision", table, None)
    if data_type == "FP32":  # the field's default: the precision option decides
        default = EmbeddingConfig.precision  # one precision for every table
        assert isinstance(default, str)
        return given if given is not None else default
    if given is not None and given != DATA_TYPES[data_type]:
        raise SlipcacheError(
            f"table {table.name!r}: precision={given!r} contradicts its data_type {data_type}; give one of them"
        )
    return DATA_TYPES[data_type]


def group_config(tables: Sequence[Any], options: Mapping[str, Any], **overrides: Any) -> EmbeddingConfig:
    """Our `EmbeddingConfig` for TorchRec tables of one dim and pooling. `options` are `EmbeddingConfig`
    fields, the per-table ones as one value or a dict by table name; `overrides` replace fields."""
    dims = {int(t.embedding_dim) for t in tables}
    poolings = {pooling_name(t.pooling) for t in tables}
    if len(dims) != 1 or len(poolings) != 1:
        raise SlipcacheError(
            f"tables must share one embedding_dim and pooling, got {sorted(dims)}, {sorted(poolings)}"
        )
    fields = {k: v for k, v in options.items() if k not in PER_TABLE_OPTIONS}
    per_table: dict[str, Any] = {"precision": [table_precision(options, t) for t in tables]}
    for name in ("cache_size", "cache_rows"):
        if isinstance(options.get(name), Mapping):
            default = getattr(EmbeddingConfig, name)
            per_table[name] = [table_value(options, name, t, default) for t in tables]
        elif name in options:
            per_table[name] = options[name]
    if len(set(per_table["precision"])) == 1:
        per_table["precision"] = per_table["precision"][0]
    settings = {
        "table_sizes": [int(t.num_embeddings) for t in tables],
        "dim": dims.pop(),
        "pooling": poolings.pop(),
        "table_names": [str(t.name) for t in tables],
        **fields,
        **per_table,
        **overrides,
    }
    try:
        return EmbeddingConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(str(exc)) from exc


def custom_initial_rows(table: Any, seed: int) -> Tensor | None:
    """A table's first rows as TorchRec draws them where its config asks for its own initialization
    (`init_fn`, `weight_init_min`/`max`); None when it asks for the default, which ours equals
    (uniform in +-sqrt(1/rows); TorchRec's configs spell it as a default `init_fn`). A uniform range is
    drawn from `seed`; a custom `init_fn` draws as it does (from torch's global generator)."""
    rows, dim = int(table.num_embeddings), int(table.embedding_dim)
    bound = math.sqrt(1 / rows)
    init_fn = getattr(table, "init_fn", None)
    low, high = getattr(table, "weight_init_min", None), getattr(table, "weight_init_max", None)
    if isinstance(init_fn, functools.partial) and init_fn.func is torch.nn.init.uniform_ and not init_fn.args:
        low, high = init_fn.keywords.get("a", low), init_fn.keywords.get("b", high)
        init_fn = None
    low = -bound if low is None else float(low)
    high = bound if high is None else float(high)
    if init_fn is None and (low, high) == (-bound, bound):
        return None
    weight = torch.empty(rows, dim)
    if init_fn is not None:
        drawn = init_fn(weight)
        return (drawn if isinstance(drawn, Tensor) else weight).float()
    if not low <= high:
        raise SlipcacheError(f"table {table.name!r}: weight_init_min {low} is above weight_init_max {high}")
    return weight.uniform_(low, high, generator=torch.Generator().manual_seed(seed))
