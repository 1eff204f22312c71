"""Per-table storage precision and cache rows that fit a memory budget (the command: `planning/cli.py`).

From the id profile (`slipcache.planning.profile`) every table gets a hit-rate curve. Each table then takes
one option (precision P in fp32 / fp16 / int8 / int4, cache rows C) so that the whole collection fits the
budget and the expected rounding loss per sample is smallest:

    loss_t(P, C)   = lookups_t * (1 - hit_t(C)) * step(P)      (+ a tie-break on traffic, below)
    memory_t(P, C) = rows_t * (row bytes(P) + optimizer state) + slots(C) * cache slot bytes

A hit reads and trains the fp32 row in the cache; a miss moves the row between storage and cache, and each
move rounds it to P (`step(P)`: the rounding step relative to the row's range: 0 for fp32, 2^-11 for fp16,
1/255 for int8, 1/15 for int4). So the hottest rows stay in full precision (cached), tables whose lookups
a small cache captures can be stored coarsely, and small tables are kept in fp32 without a cache. Among
options of equal loss the one with less storage<->cache traffic (misses * row bytes, in and out; none
without a cache, where storage serves every lookup in place) wins.

The choice is a multiple-choice knapsack, solved by Lagrangian relaxation (each table minimizes
loss + lambda * memory; lambda bisected to the budget) and then greedy use of what the budget has left.
Bytes per row and per cache slot come from the embedding modules themselves (`RowStorage`, `RowCache`),
so the plan's memory is the collection's own accounting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slipcache.errors import SlipcacheError
from slipcache.planning.profile import IdProfile, TableProfile

PLAN_PRECISIONS = ("fp32", "fp16", "int8", "int4")
ROUNDING_STEP = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8, "int8": 1 / 255, "int4": 1 / 15}
TRAFFIC_WEIGHT = 1e-9  # loss units per byte moved: only breaks ties between options of equal loss
GRID_POINTS = 40
GB = 1e9


@dataclass(frozen=True)
class CostModel:
    """Bytes of one stored row per precision, optimizer state per row, and one cache slot."""

    dim: int
    row_bytes: dict[str, int]
    optimizer_bytes: int
    slot_bytes: float
    ways: int

    @classmethod
    def from_modules(
        cls, dim: int, *, policy: str = "lru", optimizer: str = "sgd", ways: int = 16, total_rows: int = 1
    ) -> CostModel:
        from slipcache.embedding.cache import RowCache
        from slipcache.embedding.quant import PRECISIONS, RowStorage
        from slipcache.embedding.update import FusedOptimizer

        row_bytes = {p: RowStorage(1, dim, p, "meta").bytes_per_row for p in PRECISIONS}
        state_row = FusedOptimizer.state_row_shape(optimizer, dim)
        optimizer_bytes = 0 if state_row is None else 4 * math.prod(state_row)  # fp32
        slots = ways * 4
        cache = RowCache(slots, dim, policy, max(total_rows, 2), ways, device="meta")
        slot_bytes = (
            sum(b.numel() * b.element_size() for n, b in cache.named_buffers() if not n.startswith("_"))
            / slots
        )
        return cls(dim, row_bytes, optimizer_bytes, slot_bytes, ways)

    def memory(self, rows: int, precision: str, cache_rows: int) -> float:
        slots = math.ceil(cache_rows / self.ways) * self.ways if cache_rows else 0
        return rows * (self.row_bytes[precision] + self.optimizer_bytes) + slots * self.slot_bytes


@dataclass
class TableChoice:
    """One table's option: what it costs and what it is expected to do."""

    precision: str
    cache_rows: int
    bytes: float
    hit_rate: float
    loss: float  # expected rounding loss per sample
    traffic: float  # expected bytes moved between storage and cache per sample (in and out)


@dataclass
class Plan:
    """The chosen option of every table, against the budget."""

    names: list[str]
    rows: list[int]
    lookups_per_sample: list[float]
    choices: list[TableChoice]
    budget_bytes: float
    dim: int
    policy: str
    optimizer: str
    curves: list[tuple[np.ndarray, np.ndarray]] = field(
        default_factory=list
    )  # (cache rows, hit rate) per table

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.choices)

    @property
    def hit_rate(self) -> float:
        """Expected share of all lookups served by a cache (lookups of tables without one count as misses)."""
        total = sum(self.lookups_per_sample)
        return (
            sum(lk * c.hit_rate for lk, c in zip(self.lookups_per_sample, self.choices, strict=True)) / total
        )

    @property
    def full_precision_share(self) -> float:
        """Expected share of lookups that read an fp32 row: cache hits, and every lookup of an fp32 table."""
        total = sum(self.lookups_per_sample)
        pairs = zip(self.lookups_per_sample, self.choices, strict=True)
        return sum(lk * (1.0 if c.precision == "fp32" else c.hit_rate) for lk, c in pairs) / total

    @property
    def loss(self) -> float:
        return sum(c.loss for c in self.choices)

    def config_values(self) -> dict[str, Any]:
        """The `slipcache train` config keys this plan sets."""
        return {
            "embedding_dim": self.dim,
            "policy": self.policy,
            "optimizer": self.optimizer,
            "precision": [c.precision for c in self.choices],
            "cache_rows": [c.cache_rows for c in self.choices],
        }


def table_options(
    table: TableProfile, model: CostModel, precisions: tuple[str, ...], policy: str
) -> tuple[list[TableChoice], np.ndarray, np.ndarray]:
    """Every (precision, cache rows) option of a table, and its hit-rate curve."""
    cap = min(table.rows, max(table.distinct, 1))
    grid = np.unique(
        np.ceil(np.geomspace(model.ways, max(cap, model.ways), GRID_POINTS) / model.ways) * model.ways
    )
    sizes = np.concatenate([[0], np.minimum(grid, math.ceil(table.rows / model.ways) * model.ways)]).astype(
        np.int64
    )
    sizes = np.unique(sizes)
    hits = table.hit_rate(sizes, policy)
    options = []
    for precision in precisions:
        for c, h in zip(sizes.tolist(), hits.tolist(), strict=True):
            misses = table.lookups_per_sample * (1.0 - h)
            options.append(
                TableChoice(
                    precision=precision,
                    cache_rows=int(c),
                    bytes=model.memory(table.rows, precision, int(c)),
                    hit_rate=h,
                    loss=misses * ROUNDING_STEP[precision],
                    traffic=2 * misses * model.row_bytes[precision] if c else 0.0,
                )
            )
    return options, sizes, hits


def _objective(option: TableChoice) -> float:
    return option.loss + TRAFFIC_WEIGHT * option.traffic


def choose(options: list[list[TableChoice]], budget: float) -> list[TableChoice]:
    """One option per table, total bytes within `budget`, least total loss (Lagrangian + greedy fill)."""
    smallest = sum(min(o.bytes for o in opts) for opts in options)
    if smallest > budget:
        raise SlipcacheError(
            f"the budget {budget / GB:.4g} GB is below the smallest plan ({smallest / GB:.4g} GB: "
            "every table at its coarsest precision without a cache)"
        )

    def pick(lam: float) -> list[TableChoice]:
        return [min(opts, key=lambda o: (_objective(o) + lam * o.bytes, o.bytes)) for opts in options]

    chosen = pick(0.0)
    if sum(c.bytes for c in chosen) > budget:
        lo, hi = 0.0, 1.0
        while sum(c.bytes for c in pick(hi)) > budget:
            hi *= 10.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if sum(c.bytes for c in pick(mid)) > budget:
                lo = mid
            else:
                hi = mid
        chosen = pick(hi)
    # Greedy fill: spend what is left on the upgrade with the best loss saved per byte, while one fits.
    while True:
        left = budget - sum(c.bytes for c in chosen)
        best, best_gain = None, 0.0
        for t, opts in enumerate(options):
            current = chosen[t]
            for o in opts:
                extra = o.bytes - current.bytes
                saved = _objective(current) - _objective(o)
                if saved > 0 and extra <= left:
                    gain = saved / max(extra, 1.0)
                    if gain > best_gain:
                        best, best_gain = (t, o), gain
        if best is None:
            return chosen
        chosen[best[0]] = best[1]


def make_plan(
    profile: IdProfile,
    budget_bytes: float,
    dim: int,
    *,
    names: list[str] | None = None,
    policy: str = "lru",
    optimizer: str = "sgd",
    precisions: tuple[str, ...] = PLAN_PRECISIONS,
) -> Plan:
    """The plan for `budget_bytes`: per table the option (precision, cache rows) that the knapsack
    picks to minimize the expected rounding loss within the budget (see the module docstring)."""
    rows = [t.rows for t in profile.tables]
    model = CostModel.from_modules(dim, policy=policy, optimizer=optimizer, total_rows=sum(rows))
    options, curves = [], []
    for table in profile.tables:
        opts, sizes, hits = table_options(table, model, precisions, policy)
        options.append(opts)
        curves.append((sizes, hits))
    choices = choose(options, budget_bytes)
    return Plan(
        names=names or [f"table {t}" for t in range(len(rows))],
        rows=rows,
        lookups_per_sample=[t.lookups_per_sample for t in profile.tables],
        choices=choices,
        budget_bytes=budget_bytes,
        dim=dim,
        policy=policy,
        optimizer=optimizer,
        curves=curves,
    )


def uniform_choice(
    profile: IdProfile,
    dim: int,
    precision: str,
    cache_share: float,
    *,
    policy: str = "lru",
    optimizer: str = "sgd",
) -> dict[str, float]:
    """Bytes and expected hit rate of one precision for all tables behind one shared cache of `cache_share` of
    all rows."""
    rows = sum(t.rows for t in profile.tables)
    model = CostModel.from_modules(dim, policy=policy, optimizer=optimizer, total_rows=rows)
    cache_rows = max(1, round(cache_share * rows)) if cache_share else 0
    counts = np.sort(np.concatenate([t.counts for t in profile.tables]))[::-1]
    lookups = sum(t.lookups for t in profile.tables)
    shared = TableProfile(
        rows, lookups, counts, np.zeros(1), sum(t.lookups_per_sample for t in profile.tables)
    )
    bytes_ = sum(model.memory(t.rows, precision, 0) for t in profile.tables) + model.memory(
        0, precision, cache_rows
    )
    hit_rate = float(shared.hit_rate(cache_rows, policy)[0])
    loss = shared.lookups_per_sample * (1 - hit_rate) * ROUNDING_STEP[precision]
    return {"bytes": bytes_, "hit_rate": hit_rate, "cache_rows": cache_rows, "loss": loss}
