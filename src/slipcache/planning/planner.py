"""`slipcache plan`: per-table storage precision and cache rows that fit a memory budget.

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

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.errors import SlipcacheError
from slipcache.planning.profile import IdProfile, TableProfile, profile_split

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

        row_bytes = {p: RowStorage(1, dim, p, "meta").bytes_per_row for p in PRECISIONS}
        optimizer_bytes = {"sgd": 0, "adagrad": 4 * dim, "rowwise_adagrad": 4}[optimizer]
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
    """Bytes and expected hit rate of one precision for all tables behind one shared cache of `cache_share` of all rows."""
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


# ------------------------------------------------------------------------------------- presentation
def _fmt_bytes(n: float) -> str:
    from slipcache.training.cli import fmt_bytes as fmt

    return fmt(n)


def format_plan(plan: Plan) -> str:
    header = ("table", "rows", "precision", "cache rows", "MiB", "hit rate", "lookups/sample")
    body = [
        (
            name,
            f"{rows:,}",
            c.precision,
            f"{c.cache_rows:,}",
            f"{c.bytes / 2**20:.2f}",
            f"{c.hit_rate:.3f}" if c.cache_rows else "-",
            f"{lk:.2f}",
        )
        for name, rows, lk, c in zip(
            plan.names, plan.rows, plan.lookups_per_sample, plan.choices, strict=True
        )
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"total {_fmt_bytes(plan.total_bytes)} of {_fmt_bytes(plan.budget_bytes)} budget; expected: hit rate "
        f"{plan.hit_rate:.3f}, lookups reading fp32 rows {plan.full_precision_share:.3f}, rounding loss "
        f"{plan.loss:.2e}/sample, traffic {sum(c.traffic for c in plan.choices):.0f} B/sample (storage<->cache)"
    )
    return "\n".join(lines)


def plot_curves(plan: Plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for t, ((sizes, hits), choice) in enumerate(zip(plan.curves, plan.choices, strict=True)):
        cached = sizes > 0
        (line,) = ax.plot(sizes[cached], hits[cached], lw=1, label=plan.names[t])
        if choice.cache_rows:
            ax.plot(choice.cache_rows, choice.hit_rate, "o", color=line.get_color(), ms=4)
    ax.set_xscale("log")
    ax.set_xlabel("cache rows (log)")
    ax.set_ylabel("expected hit rate")
    ax.set_title(f"hit-rate curves per table ({plan.policy}); dots: planned cache")
    ax.legend(fontsize=5, ncol=3, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(plan: Plan, train_values: dict[str, Any], sharding: dict[str, Any] | None = None) -> str:
    """`[train]` (what `slipcache train --config` reads), then the plan's figures for people."""
    lines = [
        "# written by `slipcache plan`; `slipcache train --config FILE` reads the [train] table",
        "[train]",
    ]
    lines += [
        f"{k} = {_toml_value(v)}"
        for k, v in {**train_values, **plan.config_values()}.items()
        if v is not None
    ]
    lines += ["", "[plan]"]
    lines += [
        f"budget_bytes = {int(plan.budget_bytes)}",
        f"planned_bytes = {int(plan.total_bytes)}",
        f"expected_hit_rate = {plan.hit_rate!r}",
        f"expected_fp32_share = {plan.full_precision_share!r}",
        f"expected_rounding_loss = {plan.loss!r}",
    ]
    for name, rows, c in zip(plan.names, plan.rows, plan.choices, strict=True):
        lines += [
            "",
            "[[plan.tables]]",
            f"name = {_toml_value(name)}",
            f"rows = {rows}",
            f"precision = {_toml_value(c.precision)}",
            f"cache_rows = {c.cache_rows}",
            f"bytes = {int(c.bytes)}",
            f"expected_hit_rate = {c.hit_rate!r}",
        ]
    if sharding is not None:
        lines += ["", "[sharding]", f"world_size = {sharding['world_size']}"]
        for shard in sharding["shards"]:
            lines += ["", "[[sharding.shards]]"] + [f"{k} = {_toml_value(v)}" for k, v in shard.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ command
def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", default=None, help="dataset as `slipcache train --data` takes it (default: synthetic)"
    )
    parser.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="memory for all embedding tables, in GB (1e9 bytes); default: what the --compare config takes",
    )
    parser.add_argument(
        "--compare",
        default="int8:0.05",
        metavar="PRECISION:SHARE",
        help="the uniform config to compare with: one precision, one shared cache of SHARE of all rows "
        "(default int8:0.05)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the --quick synthetic dataset of slipcache train"
    )
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension (default 16)")
    parser.add_argument(
        "--out", default=None, help="write the plan as a TOML config for `slipcache train --config`"
    )
    parser.add_argument("--plot", default=None, help="PNG of the hit-rate curves (default: beside --out)")
    parser.add_argument("--policy", choices=("lru", "lfu"), default="lru", help="cache policy (default lru)")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad", "rowwise_adagrad"), default="sgd")
    parser.add_argument(
        "--precisions",
        default=",".join(PLAN_PRECISIONS),
        help="precisions to choose from (default fp32,fp16,int8,int4)",
    )
    parser.add_argument(
        "--sample-rows", type=int, default=1_000_000, help="training rows profiled (default 1,000,000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--world-size", type=int, default=None, help="also preview table placement on N ranks"
    )
    parser.add_argument(
        "--table-sizes", default=None, help="external formats: rows per table (see slipcache train)"
    )
    parser.add_argument("--split-order", choices=("val-test", "test-val"), default=None)
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run_plan(args: argparse.Namespace) -> int:
    from slipcache.training import trainer
    from slipcache.training.cli import int_list
    from slipcache.training.config import make_config

    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    unknown = [p for p in precisions if p not in ROUNDING_STEP]
    if unknown or not precisions:
        raise SlipcacheError(
            f"--precisions: unknown {unknown[0] if unknown else 'empty list'} (fp32, fp16, bf16, int8, int4)"
        )
    if (args.budget_gb is not None and not args.budget_gb > 0) or args.dim < 1 or args.sample_rows < 1:
        raise SlipcacheError("--budget-gb, --dim and --sample-rows must be positive")
    try:
        compare_precision, compare_share = args.compare.split(":")
        compare = (compare_precision, float(compare_share))
    except ValueError as exc:
        raise SlipcacheError(
            f"--compare must be PRECISION:SHARE, e.g. int8:0.05; got {args.compare!r}"
        ) from exc
    if compare[0] not in ROUNDING_STEP or not 0 <= compare[1] <= 1:
        raise SlipcacheError(f"--compare: unknown precision or share outside [0, 1]: {args.compare!r}")
    flags: dict[str, Any] = {"data": args.data, "progress": args.progress}
    if args.quick:
        flags["quick"] = True
    if args.table_sizes:
        flags["table_sizes"] = int_list(args.table_sizes)
    if args.split_order:
        flags["split_order"] = args.split_order
    config = make_config({}, flags)
    dataset_dir = trainer.prepare_data(config)
    dataset = trainer.open_dataset(dataset_dir, config)
    profile = profile_split(
        dataset.split("train"), dataset.table_sizes, sample_rows=args.sample_rows, seed=args.seed
    )
    uniform = uniform_choice(profile, args.dim, *compare, policy=args.policy, optimizer=args.optimizer)
    plan = make_plan(
        profile,
        args.budget_gb * GB if args.budget_gb is not None else uniform["bytes"],
        args.dim,
        names=[f"C{t + 1}" for t in range(dataset.num_tables)],
        policy=args.policy,
        optimizer=args.optimizer,
        precisions=precisions,
    )
    print(f"profiled {profile.sampled_rows:,} of {profile.split_rows:,} training rows of {dataset_dir}")
    print(format_plan(plan))
    print(
        f"uniform {compare[0]} + {100 * compare[1]:g} % shared cache: {_fmt_bytes(uniform['bytes'])}; expected: "
        f"hit rate {uniform['hit_rate']:.3f}, rounding loss {uniform['loss']:.2e}/sample"
    )
    sharding = None
    if args.world_size is not None:
        sharding = preview_sharding(plan, profile, args.world_size)
        print(sharding["text"])
    train_values = {k: v for k, v in flags.items() if k != "progress"}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_toml(plan, train_values, sharding))
        print(f"config: {out}  (slipcache train --config {out})")
    plot = Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png") if args.out else None)
    if plot is not None:
        plot_curves(plan, plot)
        print(f"curves: {plot}")
    return 0


def preview_sharding(plan: Plan, profile: IdProfile, world_size: int) -> dict[str, Any]:
    """The distributed planner's placement of the planned tables, costed with this profile's lookups."""
    try:
        from slipcache.distributed.planner import TableSpec, plan_sharding
    except ImportError as exc:  # the scale-out branch not merged yet
        raise SlipcacheError("--world-size needs slipcache.distributed (the sharding planner)") from exc
    specs = [
        TableSpec(
            name=name,
            rows=rows,
            dim=plan.dim,
            bytes_per_row=choice.bytes / rows,
            lookups_per_sample=table.lookups_per_sample,
            row_histogram=tuple(float(v) for v in table.histogram),
        )
        for name, rows, choice, table in zip(plan.names, plan.rows, plan.choices, profile.tables, strict=True)
    ]
    sharding = plan_sharding(specs, world_size)
    shards = [
        {"table": plan.names[s.table], "rank": s.rank, "row_start": s.row_start, "row_end": s.row_end}
        for s in sharding.shards
    ]
    return {"world_size": world_size, "shards": shards, "text": sharding.format_table()}
