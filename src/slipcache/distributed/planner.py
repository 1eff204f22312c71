"""Where each embedding table lives when N processes share them: the sharding plan.

Tables are model-parallel. `plan_sharding` places them on ranks so that every rank holds about the same
number of bytes (the hard constraint: memory) and, among the placements that keep bytes within the
tolerance, about the same number of expected lookups (the traffic and work each rank serves):

1. tables are taken largest first;
2. a table goes whole (table-wise) to the rank with the least lookups-plus-bytes load on which it still
   fits under `(1 + tolerance) * mean bytes`;
3. a table that fits nowhere is cut into contiguous row ranges (row-wise) by water-filling: the least
   loaded ranks are raised to one common level, each taking the rows that reach it.

Guarantee (tested): no rank holds more than `(1 + tolerance) * mean + one row per shard` bytes. A
water-filled level never exceeds the mean (the loads sum to N * mean), and a whole table is only placed
where it fits under the cap. Communication does not depend on the number of shards (ids go to their
owner whatever the cut), so cutting tables costs no traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from slipcache.errors import InvalidInputError

PLAN_FORMAT = "slipcache-sharding-plan"
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it.

    `bytes_per_row` is everything a row costs on its rank: storage, quantization parameters, its share
    of the cache and optimizer state. `row_histogram`, if known (from an id profile), is the lookup count
    of equal-width row buckets in row order; it makes the lookups of a row-wise shard exact instead of
    proportional to its rows.
    """

    name: str
    rows: int
    dim: int
    bytes_per_row: float
    lookups_per_sample: float = 1.0
    row_histogram: tuple[float, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0 or not self.bytes_per_row > 0:
            raise InvalidInputError(
                f"table {self.name!r}: rows, dim and bytes_per_row must be positive, "
                f"got {self.rows}, {self.dim}, {self.bytes_per_row}"
            )
        if not self.lookups_per_sample >= 0:
            raise InvalidInputError(f"table {self.name!r}: lookups_per_sample must be >= 0")
        if self.row_histogram is not None and (
            not self.row_histogram or min(self.row_histogram) < 0 or sum(self.row_histogram) <= 0
        ):
            raise InvalidInputError(f"table {self.name!r}: row_histogram must be non-negative counts")

    @property
    def bytes(self) -> float:
        return self.rows * self.bytes_per_row

    def lookup_share(self, row_start: int, row_end: int) -> float:
        """Share of this table's lookups that fall in rows [row_start, row_end)."""
        if self.row_histogram is None:
            return (row_end - row_start) / self.rows
        return (
            _mass_below(self.row_histogram, row_end / self.rows)
            - _mass_below(self.row_histogram, row_start / self.rows)
        ) / sum(self.row_histogram)

    def to_dict(self) -> dict[str, Any]:
        """The plan keeps the table's shape and costs, not its histogram."""
        return {k: v for k, v in asdict(self).items() if k != "row_histogram"}


def _mass_below(histogram: Sequence[float], fraction: float) -> float:
    """Histogram mass below `fraction` of the row range (uniform within a bucket)."""
    position = fraction * len(histogram)
    whole = min(int(position), len(histogram))
    mass = sum(histogram[:whole])
    if whole < len(histogram):
        mass += histogram[whole] * (position - whole)
    return mass


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_end) of table `table` (its index in the plan), held by `rank`."""

    table: int
    rank: int
    row_start: int
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass
class ShardingPlan:
    """Tables, the world size and the shards; `shards` are sorted by (table, row_start)."""

    world_size: int
    tables: list[TableSpec]
    shards: list[Shard]
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        self.shards = sorted(self.shards, key=lambda s: (s.table, s.row_start))
        self.validate()

    def validate(self) -> None:
        """Every row of every table belongs to exactly one shard on a rank that exists."""
        if self.world_size < 1:
            raise InvalidInputError(f"world size must be >= 1, got {self.world_size}")
        expected_start = [0] * len(self.tables)
        for shard in self.shards:
            if not 0 <= shard.table < len(self.tables) or not 0 <= shard.rank < self.world_size:
                raise InvalidInputError(f"shard {shard} names a table or rank outside the plan")
            if shard.row_start != expected_start[shard.table] or shard.row_end <= shard.row_start:
                raise InvalidInputError(
                    f"shards of table {self.tables[shard.table].name!r} must be contiguous, non-empty "
                    f"row ranges from 0; got {shard.row_start}:{shard.row_end}"
                )
            expected_start[shard.table] = shard.row_end
        for table, end in zip(self.tables, expected_start, strict=True):
            if end != table.rows:
                raise InvalidInputError(f"the plan covers {end} of the {table.rows} rows of {table.name!r}")

    def shards_of(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, in table order: the tables of its local collection."""
        return [s for s in self.shards if s.rank == rank]

    def shard_bytes(self, shard: Shard) -> float:
        return shard.rows * self.tables[shard.table].bytes_per_row

    def shard_lookups(self, shard: Shard) -> float:
        """Expected lookups per sample served by this shard."""
        table = self.tables[shard.table]
        return table.lookups_per_sample * table.lookup_share(shard.row_start, shard.row_end)

    def bytes_per_rank(self) -> list[float]:
        loads = [0.0] * self.world_size
        for shard in self.shards:
            loads[shard.rank] += self.shard_bytes(shard)
        return loads

    def lookups_per_rank(self) -> list[float]:
        """Expected lookups per (global) sample that each rank serves."""
        loads = [0.0] * self.world_size
        for shard in self.shards:
            loads[shard.rank] += self.shard_lookups(shard)
        return loads

    def imbalance(self) -> float:
        """max / mean bytes per rank (1.0 is perfect balance)."""
        loads = self.bytes_per_rank()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (TOML- and JSON-writable): a `tables` and a `shards` array of tables."""
        return {
            "format": PLAN_FORMAT,
            "world_size": self.world_size,
            "tolerance": self.tolerance,
            "tables": [t.to_dict() for t in self.tables],
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> ShardingPlan:
        if not isinstance(value, dict) or value.get("format") != PLAN_FORMAT:
            raise InvalidInputError(
                "not a slipcache sharding plan (missing format = slipcache-sharding-plan)"
            )
        try:
            tables = [TableSpec(**t) for t in value["tables"]]
            shards = [Shard(**s) for s in value["shards"]]
            return cls(int(value["world_size"]), tables, shards, float(value["tolerance"]))
        except (KeyError, TypeError) as exc:
            raise InvalidInputError(f"malformed sharding plan: {exc}") from exc

    def format_table(self) -> str:
        """The plan as a text table: one line per shard, then bytes and lookups per rank."""
        lines = [f"sharding plan: {len(self.tables)} tables on {self.world_size} ranks"]
        header = ("rank", "table", "rows", "MiB", "lookups/sample")
        body = []
        for shard in sorted(self.shards, key=lambda s: (s.rank, s.table, s.row_start)):
            table = self.tables[shard.table]
            rows = (
                f"{table.rows}"
                if shard.rows == table.rows
                else f"{shard.row_start}:{shard.row_end} of {table.rows}"
            )
            body.append(
                (
                    str(shard.rank),
                    table.name,
                    rows,
                    f"{self.shard_bytes(shard) / 2**20:.2f}",
                    f"{self.shard_lookups(shard):.3f}",
                )
            )
        for rank, (size, lookups) in enumerate(
            zip(self.bytes_per_rank(), self.lookups_per_rank(), strict=True)
        ):
            body.append((str(rank), "(all)", "", f"{size / 2**20:.2f}", f"{lookups:.3f}"))
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        for row in [header, *body]:
            lines.append(
                "  ".join(
                    cell.rjust(w) if i != 1 else cell.ljust(w)
                    for i, (cell, w) in enumerate(zip(row, widths, strict=True))
                )
            )
        lines.append(f"bytes: max/mean {self.imbalance():.3f} (tolerance {self.tolerance:g})")
        return "\n".join(lines)


def plan_sharding(
    tables: Sequence[TableSpec], world_size: int, *, tolerance: float = DEFAULT_TOLERANCE
) -> ShardingPlan:
    """Place `tables` on `world_size` ranks: table-wise where a table fits, row-wise where it does not."""
    if world_size < 1:
        raise InvalidInputError(f"world size must be >= 1, got {world_size}")
    if not tables:
        raise InvalidInputError("nothing to place: no tables")
    if not tolerance >= 0:
        raise InvalidInputError(f"tolerance must be >= 0, got {tolerance}")
    tables = list(tables)
    total_bytes = sum(t.bytes for t in tables)
    total_lookups = sum(t.lookups_per_sample for t in tables) or 1.0
    cap = total_bytes / world_size * (1 + tolerance)
    load_bytes = [0.0] * world_size
    load_lookups = [0.0] * world_size
    shards: list[Shard] = []

    def place(shard: Shard) -> None:
        table = tables[shard.table]
        shards.append(shard)
        load_bytes[shard.rank] += shard.rows * table.bytes_per_row
        load_lookups[shard.rank] += table.lookups_per_sample * table.lookup_share(
            shard.row_start, shard.row_end
        )

    for t in sorted(range(len(tables)), key=lambda i: (-tables[i].bytes, i)):
        table = tables[t]
        fits = [r for r in range(world_size) if load_bytes[r] + table.bytes <= cap]
        if fits:
            rank = min(fits, key=lambda r: (load_lookups[r] / total_lookups + load_bytes[r] / total_bytes, r))
            place(Shard(t, rank, 0, table.rows))
            continue
        pieces = _water_fill(load_bytes, table.bytes)
        row_start, filled = 0, 0.0
        for i, (rank, piece_bytes) in enumerate(pieces):
            filled += piece_bytes
            row_end = (
                table.rows if i == len(pieces) - 1 else min(table.rows, round(filled / table.bytes_per_row))
            )
            if row_end > row_start:
                place(Shard(t, rank, row_start, row_end))
                row_start = row_end
    return ShardingPlan(world_size, tables, shards, tolerance)


def _water_fill(loads: list[float], amount: float) -> list[tuple[int, float]]:
    """(rank, bytes) pieces that raise the least loaded ranks to one common level, using `amount`."""
    order = sorted(range(len(loads)), key=lambda r: (loads[r], r))
    filled = 0.0
    level = loads[order[0]]
    count = 0
    for count in range(1, len(order) + 1):
        filled += loads[order[count - 1]]
        level = (amount + filled) / count
        if count == len(order) or level <= loads[order[count]]:
            break
    return [(r, level - loads[r]) for r in sorted(order[:count]) if level > loads[r]]


def table_specs(
    table_sizes: Sequence[int],
    dim: int,
    *,
    precision: str = "int8",
    cache_size: float = 0.05,
    optimizer: str = "sgd",
    names: Sequence[str] | None = None,
    lookups_per_sample: Sequence[float] | None = None,
    row_histograms: Sequence[Sequence[float] | None] | None = None,
) -> list[TableSpec]:
    """TableSpecs of cached collection tables, costed by `CachedEmbeddingBagCollection.estimate_memory`.

    Each table is costed as a collection of its own (its cache fraction applies to it alone, as it does
    to every shard), so bytes_per_row counts storage, quantization parameters, cache and optimizer state.
    """
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

    names = list(names) if names is not None else [f"table {t}" for t in range(len(table_sizes))]
    specs = []
    for t, rows in enumerate(table_sizes):
        config = EmbeddingConfig(
            table_sizes=[int(rows)], dim=dim, precision=precision, cache_size=cache_size, optimizer=optimizer
        )
        total = CachedEmbeddingBagCollection.estimate_memory(config)["total_bytes"]
        histogram = row_histograms[t] if row_histograms is not None else None
        specs.append(
            TableSpec(
                name=names[t],
                rows=int(rows),
                dim=dim,
                bytes_per_row=total / int(rows),
                lookups_per_sample=float(lookups_per_sample[t]) if lookups_per_sample is not None else 1.0,
                row_histogram=tuple(float(x) for x in histogram) if histogram is not None else None,
            )
        )
    return specs
