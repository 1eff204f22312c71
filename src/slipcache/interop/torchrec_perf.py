"""TorchRec's perf estimate, with each shard's compute weighted by where its table's lookups fall.

TorchRec costs a shard's lookups as if they spread evenly over the table's rows, so the row-wise shards of a
table whose lookups crowd into some rows all cost the same, and its partitioner may stack the busy ones on
one rank. `SlipcachePerfEstimator` runs TorchRec's estimator, then scales each shard's `fwd_compute` and
`bwd_compute` by

    (share of the table's lookups in the shard's rows) / (shard's share of the rows)

from a row histogram of the table (`TableLookups`; `lookups_from_profile` makes them from `slipcache
plan`'s id profile). A bucket that a shard boundary cuts is taken as spread evenly over its rows; a uniform
histogram leaves TorchRec's estimate as it is. Whole tables and column-wise shards hold every row and keep
TorchRec's estimate, as do tables without a histogram and modules other than slipcache's collections.

Comms are left as TorchRec prices them: its model of a shard's output and gradient comms does not depend on
which rows the lookups read (a row-wise shard is priced for the whole batch's outputs), and the one term
priced by a shard's ids (routing them to the ranks that hold their rows, `input_dist_comms`) is not in the
total its partitioner balances.

A table's `lookups_per_sample` becomes its sharding options' pooling factors (`input_lengths`) before
TorchRec's estimate, so that TorchRec prices the ids' compute and comms by the sampled figure instead of
its default pooling factor of 1. Pooling factors a table's `ParameterConstraints` give (other than
TorchRec's default, which an unset field cannot be told from) are the user's word and are kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any

import numpy as np
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator
from torchrec.distributed.planner.types import ShardingOption

from slipcache.errors import SlipcacheError
from slipcache.interop.keyed import KeyedCachedEmbeddingBagCollection
from slipcache.planning.profile import IdProfile


@dataclass(frozen=True)
class TableLookups:
    """Where one table's lookups fall and how many a sample makes.

    `histogram`: lookups in B equal-width row buckets, in row order (any scale: only their shares count);
    bucket b of a table of N rows holds rows [b*N/B, (b+1)*N/B). `lookups_per_sample`: a sample's mean
    lookups into the table, over all its features (TorchRec's pooling factor), or None for TorchRec's."""

    histogram: Sequence[float] | np.ndarray
    lookups_per_sample: float | None = None


def lookups_from_profile(profile: IdProfile, names: Sequence[str]) -> dict[str, TableLookups]:
    """The `TableLookups` of a dataset's id profile (`planning.profile.profile_split`), its tables named in
    the profile's order."""
    if len(names) != len(profile.tables):
        raise SlipcacheError(f"{len(names)} table names for a profile of {len(profile.tables)} tables")
    return {
        name: TableLookups(tuple(table.histogram.tolist()), table.lookups_per_sample)
        for name, table in zip(names, profile.tables, strict=True)
    }


@dataclass(frozen=True)
class _LookupShares:
    """A table's validated lookups: the cumulative share of its lookups at each bucket edge."""

    cumulative: np.ndarray  # float64 [B + 1], from 0 to 1
    lookups_per_sample: float | None

    def weight(self, rows: int, start: int, size: int) -> float:
        """(Share of the lookups in rows [start, start + size)) / (their share of the table's rows), each
        bucket's lookups spread evenly over its rows; 0 for a shard without rows."""
        if not size:
            return 0.0
        edges = np.linspace(0.0, rows, self.cumulative.size)
        share = np.interp(start + size, edges, self.cumulative) - np.interp(start, edges, self.cumulative)
        return float(share) * rows / size


def check_lookups(lookups: Mapping[str, TableLookups]) -> dict[str, _LookupShares]:
    """`lookups` validated, or a one-line `SlipcacheError` naming the table."""
    if not isinstance(lookups, Mapping):
        raise SlipcacheError(f"lookups must map table names to TableLookups, got {type(lookups).__name__}")
    checked = {}
    for name, value in lookups.items():
        if not isinstance(name, str):
            raise SlipcacheError(f"lookups are keyed by table name, got {type(name).__name__} {name!r}")
        if not isinstance(value, TableLookups):
            raise SlipcacheError(f"table {name!r}: lookups must be a TableLookups, got {type(value).__name__}")
        histogram = _histogram(name, value.histogram)
        per_sample = value.lookups_per_sample
        if per_sample is not None and (
            isinstance(per_sample, bool) or not isinstance(per_sample, Real) or not 0 < per_sample < math.inf
        ):
            raise SlipcacheError(f"table {name!r}: lookups_per_sample must be a number > 0, got {per_sample!r}")
        cumulative = np.concatenate([[0.0], np.cumsum(histogram) / histogram.sum()])
        cumulative[-1] = 1.0  # exactly, whatever the rounding of the sum: a whole table's weight is 1
        checked[name] = _LookupShares(cumulative, None if per_sample is None else float(per_sample))
    return checked


def _histogram(name: str, values: object) -> np.ndarray:
    """`values` as float64 lookups per bucket (scaled to the largest), refused unless a non-empty 1-D
    sequence of finite numbers >= 0, not all zero."""
    try:
        histogram = np.asarray(values)
    except (TypeError, ValueError):  # ragged nesting
        histogram = np.asarray(None)
    if histogram.ndim != 1 or not histogram.size or histogram.dtype.kind not in "iuf":
        raise SlipcacheError(
            f"table {name!r}: the histogram must be a non-empty 1-D sequence of numbers, got {type(values).__name__}"
        )
    histogram = histogram.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(histogram) | (histogram < 0))
    if bad.size:
        raise SlipcacheError(
            f"table {name!r}: histogram bucket {bad[0]} holds {histogram[bad[0]]}; lookups must be finite and >= 0"
        )
    if not histogram.any():
        raise SlipcacheError(
            f"table {name!r}: the histogram holds no lookups (all zero); leave the table out for TorchRec's estimate"
        )
    return histogram / histogram.max()  # only shares count; scaled, the sum cannot overflow


class SlipcachePerfEstimator(EmbeddingPerfEstimator):
    """TorchRec's perf estimator, with the shards of slipcache's tables weighted by their row histograms (see
    the module doc)."""

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        lookups: Mapping[str, TableLookups] | None = None,
        is_inference: bool = False,
    ) -> None:
        super().__init__(topology=topology, constraints=constraints, is_inference=is_inference)
        self._lookups = check_lookups({} if lookups is None else lookups)

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Any = None) -> None:
        weighted = [
            (option, self._lookups[option.name])
            for option in sharding_options
            if isinstance(option.module[1], KeyedCachedEmbeddingBagCollection) and option.name in self._lookups
        ]
        for option, lookups in weighted:
            if lookups.lookups_per_sample is not None and not self._pooling_constrained(option.name):
                inputs = len(option.input_lengths)  # TorchRec's pooling factors are per input: split among them
                option.input_lengths = [lookups.lookups_per_sample / inputs] * inputs
        super().estimate(sharding_options, sharder_data_map)
        for option, lookups in weighted:
            rows = int(option.tensor.shape[0])
            for shard in option.shards:
                if (perf := shard.perf) is not None:
                    weight = lookups.weight(rows, int(shard.offset[0]), int(shard.size[0]))
                    shard.perf = replace(
                        perf, fwd_compute=perf.fwd_compute * weight, bwd_compute=perf.bwd_compute * weight
                    )

    def _pooling_constrained(self, table: str) -> bool:
        constraint = (self._constraints or {}).get(table)
        return constraint is not None and list(constraint.pooling_factors) != [POOLING_FACTOR]
