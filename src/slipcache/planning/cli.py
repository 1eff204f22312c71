"""`slipcache plan`: profile a dataset, plan for the budget, print the plan and write it as a
`slipcache train --config` file (plus the hit-rate curves and, with `--world-size`, a sharding preview).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.embedding.config import OPTIMIZERS
from slipcache.errors import SlipcacheError
from slipcache.options import add_progress_flag, add_threads_flag, image_file, seed_arg
from slipcache.planning.planner import GB, PLAN_PRECISIONS, ROUNDING_STEP, Plan, make_plan, uniform_choice
from slipcache.planning.profile import IdProfile, profile_split
from slipcache.plotting import pyplot
from slipcache.training.cli import fmt_bytes


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
        f"total {fmt_bytes(plan.total_bytes)} of {fmt_bytes(plan.budget_bytes)} budget; expected: hit rate "
        f"{plan.hit_rate:.3f}, lookups reading fp32 rows {plan.full_precision_share:.3f}, rounding loss "
        f"{plan.loss:.2e}/sample, traffic {sum(c.traffic for c in plan.choices):.0f} B/sample (storage<->cache)"
    )
    return "\n".join(lines)


NAMED_CURVES = 8  # the largest tables get a colour and a name each; the rest share one grey


def plot_curves(plan: Plan, path: Path) -> None:
    """Hit rate against cache rows per table, the planned cache as a dot. Only the NAMED_CURVES largest
    tables are told apart (ten colours cannot keep 26 lines apart); the others are thin grey lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    by_size = sorted(range(len(plan.rows)), key=lambda t: -plan.rows[t])
    named = {t: colour for t, colour in zip(by_size[:NAMED_CURVES], plt.get_cmap("tab10").colors, strict=False)}
    rest = by_size[NAMED_CURVES:]
    label: str | None
    for t in by_size:  # the legend lists the named tables largest first
        (sizes, hits), choice = plan.curves[t], plan.choices[t]
        cached = sizes > 0
        if t in named:
            colour, width, label = named[t], 1.5, f"{plan.names[t]} ({plan.rows[t]:,} rows)"
        else:  # one legend entry for all of them
            colour, width, label = "0.7", 0.8, f"{len(rest)} smaller tables" if t == rest[0] else None
        ax.plot(sizes[cached], hits[cached], lw=width, color=colour, label=label, zorder=3 if t in named else 2)
        if choice.cache_rows:
            ax.plot(choice.cache_rows, choice.hit_rate, "o", color=colour, ms=4, zorder=4)
    ax.set_xscale("log")
    ax.set_xlabel("cache rows (log)")
    ax.set_ylabel("expected hit rate")
    ax.set_title(f"hit-rate curves per table ({plan.policy}); dots: planned cache")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLAN_HEADER = "# written by `slipcache plan`"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    if isinstance(value, str):
        return json.dumps(value)  # JSON's string escapes are TOML's basic-string escapes (newlines too)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(plan: Plan, train_values: dict[str, Any], sharding: dict[str, Any] | None = None) -> str:
    """`[train]` (what `slipcache train --config` reads), then the plan's figures for people."""
    lines = [
        f"{PLAN_HEADER}; `slipcache train --config FILE` reads the [train] table",
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
    add_threads_flag(parser)
    parser.add_argument(
        "--out", default=None, help="write the plan as a TOML config for `slipcache train --config`"
    )
    parser.add_argument(
        "--plot", type=image_file, default=None, help="PNG of the hit-rate curves (default: beside --out)"
    )
    parser.add_argument("--policy", choices=("lru", "lfu"), default="lru", help="cache policy (default lru)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument(
        "--precisions",
        default=",".join(PLAN_PRECISIONS),
        help="precisions to choose from (default fp32,fp16,int8,int4)",
    )
    parser.add_argument(
        "--sample-rows", type=int, default=1_000_000, help="training rows profiled (default 1,000,000)"
    )
    parser.add_argument("--seed", type=seed_arg, default=0, help="sampling seed")
    parser.add_argument(
        "--world-size", type=int, default=None, help="also preview table placement on N ranks"
    )
    parser.add_argument(
        "--table-sizes", default=None, help="external formats: rows per table (see slipcache train)"
    )
    parser.add_argument("--split-order", choices=("val-test", "test-val"), default=None)
    add_progress_flag(parser)


def check_plan_out(out: Path) -> None:
    """`--out` may replace a plan `slipcache plan` wrote (its first line says so), never another file."""
    if out.is_dir():
        raise SlipcacheError(f"--out {out} is a directory; name the plan's TOML file")
    if out.exists():
        with open(out, "rb") as f:
            ours = f.readline().startswith(PLAN_HEADER.encode())
        if not ours:
            raise SlipcacheError(f"--out {out} exists and is not a plan written by slipcache plan; choose another name")


def run_plan(args: argparse.Namespace) -> int:
    from slipcache.training.config import make_config
    from slipcache.training.datasets import open_dataset, prepare_data
    from slipcache.training.flags import int_list

    if args.out:
        check_plan_out(Path(args.out))
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
    dataset_dir = prepare_data(config)
    dataset = open_dataset(dataset_dir, config)
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
    fits_here(plan, args.budget_gb)
    print(
        f"uniform {compare[0]} + {100 * compare[1]:g} % shared cache: {fmt_bytes(uniform['bytes'])}; expected: "
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
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(to_toml(plan, train_values, sharding))
        tmp.replace(out)  # atomic: a reader never sees half a plan
        print(f"config: {out}  (slipcache train --config {out})")
    plot = Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png") if args.out else None)
    if plot is not None:
        plot_curves(plan, plot)
        print(f"curves: {plot}")
    return 0


def fits_here(plan: Plan, budget_gb: float | None) -> bool:
    """The memory pre-check `slipcache train --config` will run on this plan, run now: a plan this machine
    cannot hold, or a budget above what it has, is said in one warning line. Only a warning: a plan may be
    made here for a larger machine."""
    from slipcache.embedding.config import EmbeddingConfig
    from slipcache.memory import RUNTIME_BYTES, MemoryShortError, available_bytes, require_tables_fit

    available = available_bytes()
    tables = EmbeddingConfig(
        list(plan.rows), plan.dim, precision=[c.precision for c in plan.choices],
        cache_rows=[c.cache_rows for c in plan.choices], optimizer=plan.optimizer, policy=plan.policy,
    )
    try:
        require_tables_fit(tables, "plan", available=available)
    except MemoryShortError as exc:
        print(f"slipcache plan: warning: does not fit this machine: {exc}", file=sys.stderr)
        return False
    if budget_gb is not None and available is not None and budget_gb * GB + RUNTIME_BYTES > available:
        print(
            f"slipcache plan: warning: --budget-gb {budget_gb:g} is more than this machine has available for tables "
            f"({max(available - RUNTIME_BYTES, 0) / GB:.1f} GB); this plan still fits here, one that uses the "
            "whole budget would not",
            file=sys.stderr,
        )
    return True


def preview_sharding(plan: Plan, profile: IdProfile, world_size: int) -> dict[str, Any]:
    """Where TorchRec's planner places the planned tables on `world_size` ranks: each at its planned precision
    and cache, costed by what our shards hold, each shard's compute weighted by the lookups the profile puts
    in its rows (`SlipcachePerfEstimator`), as `torchrun ... slipcache train` plans them from a profile of
    its own (`distributed.model.plan_lookups`). Needs the torchrec extra (one line without it)."""
    import importlib.util
    import logging
    import warnings

    if importlib.util.find_spec("torchrec") is None:
        raise SlipcacheError("--world-size previews TorchRec's plan and needs the torchrec extra (README: Using "
                             "slipcache with TorchRec)")
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.planner import Topology

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection, KeyedCachedEmbeddingBagCollectionSharder
    from slipcache.interop.torchrec_perf import lookups_from_profile
    from slipcache.interop.torchrec_planner import slipcache_planner

    configs = [
        EmbeddingBagConfig(name=name, embedding_dim=plan.dim, num_embeddings=int(rows), feature_names=[f"f{t}"])
        for t, (name, rows) in enumerate(zip(plan.names, plan.rows, strict=True))
    ]
    module = KeyedCachedEmbeddingBagCollection(
        configs, device="meta", precision={n: c.precision for n, c in zip(plan.names, plan.choices, strict=True)},
        cache_rows={n: c.cache_rows for n, c in zip(plan.names, plan.choices, strict=True)},
        policy=plan.policy, optimizer=plan.optimizer,
    )
    torchrec_logger = logging.getLogger("torchrec")
    level = torchrec_logger.level
    with warnings.catch_warnings():  # TorchRec warns about GPU-only features on CPU
        warnings.simplefilter("ignore")
        torchrec_logger.setLevel(max(level, logging.ERROR))
        try:
            planner = slipcache_planner(Topology(world_size=world_size, compute_device="cpu"),
                                        lookups=lookups_from_profile(profile, plan.names))
            sharding = planner.plan(module, [KeyedCachedEmbeddingBagCollectionSharder()])
        finally:
            torchrec_logger.setLevel(level)
    shards: list[dict[str, Any]] = []
    lines = ["sharding plan (TorchRec's planner, shards weighted by the profile's lookups):",
             "| table | sharding | rank | rows |", "|---|---|---|---|"]
    for table, parameter in next(iter(sharding.plan.values())).items():
        placed = parameter.sharding_spec.shards if parameter.sharding_spec is not None else None
        if placed is None:  # data-parallel: the whole table on every rank
            entries = [(rank, 0, plan.rows[plan.names.index(table)]) for rank in range(world_size)]
        else:
            entries = [
                (m.placement.rank(), int(m.shard_offsets[0]), int(m.shard_offsets[0]) + int(m.shard_sizes[0]))
                for m in placed
            ]
        for rank, first, end in entries:
            shards.append({"table": table, "sharding": parameter.sharding_type, "rank": rank, "row_start": first,
                           "row_end": end})
            lines.append(f"| {table} | {parameter.sharding_type} | {rank} | {first}..{end} |")
    return {"world_size": world_size, "shards": shards, "text": "\n".join(lines)}
