"""`slipcache bench embedding`: our cached mixed-precision embeddings side by side with the peers.

One process, one Criteo-Kaggle-shaped workload (26 tables, power-law ids, batch 2048), the same id batches and
gradients for every implementation, forward + backward + update per step. Each configuration is built, warmed
up, timed and freed before the next, so a run fits in the machine's memory; configurations whose estimated
footprint exceeds the memory budget are reported as skipped instead of being allocated.

The parts: `bench_workload` (tables and id batches), `bench_peers` (the implementations), `bench_timing`
(build, warm up, time, profile), `bench_report` (targets and tables); this module is the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import shlex
import sys
from typing import Any

import torch

from slipcache.bench.bound import AccessCosts, Popularity, attach_bounds, unique_share
from slipcache.bench.machine import describe_machine, physical_memory_bytes, probe_memory
from slipcache.bench.peers import CONFIGS, BenchConfig
from slipcache.bench.report import (
    _attach_ratios,
    _markdown,
    evaluate_targets,
    format_profile,
    format_table,
    format_targets,
    progress,
)
from slipcache.bench.timing import (
    GB,
    PREFILL_OVERSUBSCRIPTION,
    PROFILE_STEPS,
    _load_average,
    combine_rounds,
    measure,
)
from slipcache.bench.workload import make_workload
from slipcache.data.kaggle import SMALL_TABLE, kaggle_table_sizes
from slipcache.embedding.hostmem import uses_huge_pages
from slipcache.errors import SlipcacheError
from slipcache.memory import RUNTIME_BYTES, available_bytes
from slipcache.options import add_huge_pages_flag, add_threads_flag, float_in, seed_arg, torch_threads

__all__ = ["add_bench_arguments", "run_bench", "run_embedding_bench"]

DEFAULT_DIMS = (16, 64, 128)
# (full, quick) run shapes: quick shrinks the big tables and the step counts.
# Cached configurations warm up longer: a 5 % cache of the Kaggle tables holds 1.7 M rows and only fills
# after some 10 M lookups; timing it before that would report a cold-start hit rate.
# Each configuration runs its timed batches once by default, in each of `rounds` rounds that visit every
# configuration in turn, so a neighbour's burst of load hits one round of every configuration rather than
# every round of one. Only `--min-seconds` replays timed batches (a cache then finds their rows: flagged).
FULL = {"scale": 1.0, "warmup": 20, "cache_warmup": 150, "steps": 200, "rounds": 3}
QUICK = {"scale": 0.01, "warmup": 3, "cache_warmup": 20, "steps": 8, "rounds": 3}


def default_budget_gb() -> float:
    """What the machine has available now, less the runtime's share (60 % of physical memory where unknown)."""
    available = available_bytes()
    if available is None:
        return 0.6 * (physical_memory_bytes() or 16 * 1024**3) / GB
    return max(available - RUNTIME_BYTES, 0) / GB


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `slipcache bench`: one sub-command per target."""
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    add_embedding_arguments(
        targets.add_parser("embedding", help="embedding step throughput: ours against torch and FBGEMM")
    )
    from slipcache.bench.cache import add_cache_arguments

    cache = targets.add_parser("cache", help="cache hit rate against size: LRU, LFU, lookahead and offline OPT")
    add_cache_arguments(cache)
    add_threads_flag(cache)
    from slipcache.bench.train import add_train_bench_arguments

    train = targets.add_parser("train", help="the DLRM trainer (fp32, INT8 + 5 %% cache) against TorchRec + FBGEMM")
    add_train_bench_arguments(train)
    add_threads_flag(train)
    add_huge_pages_flag(train)
    from slipcache.bench.quantize import add_quantize_arguments

    quantize = targets.add_parser("quantize", help="the compiled quantize pass and table creation, in M values/s")
    add_quantize_arguments(quantize)
    add_threads_flag(quantize)
    add_huge_pages_flag(quantize)
    from slipcache.bench.disk import add_disk_arguments

    disk_help = "the disk under a --storage-path: random page reads/s, write MB/s"
    add_disk_arguments(targets.add_parser("disk", help=disk_help))


def add_embedding_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `slipcache bench embedding`."""
    parser.add_argument("--out", required=True, help="directory for bench.json and bench.md")
    parser.add_argument(
        "--quick", action="store_true", help="big tables x0.01 and fewer steps (about a minute)"
    )
    parser.add_argument(
        "--dims", nargs="+", default=None, help="embedding dims, e.g. 16 64 or 16,64 (default 16 64 128)"
    )
    parser.add_argument("--configs", default=None, help="comma-separated configuration names (default all)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="untimed steps before timing, configurations without a cache",
    )
    parser.add_argument(
        "--cache-warmup-steps",
        type=int,
        default=None,
        help="untimed steps before timing configurations with a cache, so it is full (default 150, quick 20)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="report configurations estimated above this as not fitting (default: the memory available now)",
    )
    parser.add_argument(
        "--prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fill each cache with the most probable rows before its warm-up, so timing sees steady-state "
        "evictions, as in a long run (default on; --no-prefill: caches start empty)",
    )
    parser.add_argument("--zipf", type=float_in(0, 100), default=1.05, help="power-law exponent of the ids")
    add_threads_flag(parser)
    add_huge_pages_flag(parser)
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds over all configurations, interleaved (default 3)"
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="replay the timed batches until each configuration's timed section lasts this long (default 0: no "
        "batch is replayed; a replayed batch finds its rows cached, so its row in bench.json counts "
        "replayed_batches and a warning says so)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=PROFILE_STEPS,
        help=f"steps of ours timed phase by phase after the last round (default {PROFILE_STEPS}; 0: none)",
    )
    parser.add_argument(
        "--profile-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="the phase profile's clock: wall time, or this process's CPU time (a machine shared with other "
        "jobs) (default: wall)",
    )
    # Hidden knobs for tests and experiments.
    parser.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--min-rows", type=int, default=SMALL_TABLE, help=argparse.SUPPRESS)
    parser.add_argument("--skip-probes", action="store_true", help=argparse.SUPPRESS)


def _parse_dims(values: list[str] | None) -> list[int]:
    if not values:
        return list(DEFAULT_DIMS)
    dims: list[int] = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                dim = int(part)
            except ValueError:
                raise SlipcacheError(f"--dims: not an integer: {part!r}") from None
            if dim <= 0:
                raise SlipcacheError(f"--dims: dims must be positive, got {dim}")
            if dim not in dims:
                dims.append(dim)
    if not dims:
        raise SlipcacheError("--dims: no dims given")
    return dims


def _parse_configs(value: str | None) -> list[BenchConfig]:
    if not value:
        return list(CONFIGS)
    known = {c.name: c for c in CONFIGS}
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SlipcacheError(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[n] for n in names]


def _command(args: argparse.Namespace, dims: list[int], configs: list[BenchConfig]) -> str:
    """The effective command line, rebuilt from the parsed options (argv differs under tests and -m)."""
    parts = ["slipcache", "bench", args.target]
    if args.quick:
        parts.append("--quick")
    parts += ["--dims", ",".join(map(str, dims))]
    if args.configs:
        parts += ["--configs", ",".join(c.name for c in configs)]
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--warmup-steps", args.warmup_steps),
        ("--cache-warmup-steps", args.cache_warmup_steps),
        ("--steps", args.steps),
        ("--memory-budget-gb", args.memory_budget_gb),
        ("--scale", args.scale),
        ("--seed", args.seed),
        ("--zipf", args.zipf),
        ("--threads", args.threads),
        ("--rounds", args.rounds),
        ("--min-seconds", args.min_seconds),
        ("--profile-clock", None if args.profile_clock == "wall" else args.profile_clock),
        ("--huge-pages", None if args.huge_pages == "off" else args.huge_pages),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if not args.prefill:
        parts.append("--no-prefill")
    if args.min_rows != SMALL_TABLE:
        parts += ["--min-rows", str(args.min_rows)]
    if args.skip_probes:
        parts.append("--skip-probes")
    parts += ["--out", str(args.out)]
    # torch's allocator reads it at start-up: the peers' tables on huge pages (see the warning in `_run_bench`)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    return ("" if thp in ("", "0") else f"THP_MEM_ALLOC_ENABLE={shlex.quote(thp)} ") + shlex.join(parts)


def run_bench(args: argparse.Namespace) -> int:
    """`slipcache bench TARGET`."""
    if args.target == "cache":
        from slipcache.bench.cache import run_cache_bench

        return run_cache_bench(args)
    if args.target == "train":
        from slipcache.bench.train import run_train_bench

        return run_train_bench(args)
    if args.target == "quantize":
        from slipcache.bench.quantize import run_quantize_bench

        return run_quantize_bench(args)
    if args.target == "disk":
        from slipcache.bench.disk import run_disk_bench

        return run_disk_bench(args)
    return run_embedding_bench(args)


def run_embedding_bench(args: argparse.Namespace) -> int:
    """Run every configuration at every dim, print the table and targets, write bench.json and bench.md."""
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise SlipcacheError(f"--threads must be positive, got {threads}")
    with torch_threads(threads):  # torch's and the compiled loops'; a library caller keeps its own setting
        return _run_bench(args)


def _run_bench(args: argparse.Namespace) -> int:
    dims = _parse_dims(args.dims)
    configs = [dataclasses.replace(c, huge_pages=args.huge_pages) for c in _parse_configs(args.configs)]
    shape = QUICK if args.quick else FULL
    scale = shape["scale"] if args.scale is None else args.scale
    warmup = int(shape["warmup"] if args.warmup_steps is None else args.warmup_steps)
    steps = int(shape["steps"] if args.steps is None else args.steps)
    if not 0 < scale <= 1:
        raise SlipcacheError(f"--scale must be in (0, 1], got {scale}")
    cache_warmup = int(shape["cache_warmup"] if args.cache_warmup_steps is None else args.cache_warmup_steps)
    if warmup < 0 or cache_warmup < 0 or steps < 1:
        raise SlipcacheError("--warmup-steps and --cache-warmup-steps must be >= 0 and --steps >= 1")
    if args.batch_size < 1:
        raise SlipcacheError(f"--batch-size must be positive, got {args.batch_size}")
    if args.min_rows < 1:
        raise SlipcacheError(f"--min-rows must be positive, got {args.min_rows}")
    if args.zipf <= 0:
        raise SlipcacheError(f"--zipf must be positive, got {args.zipf}")
    rounds = int(shape["rounds"] if args.rounds is None else args.rounds)
    min_seconds = 0.0 if args.min_seconds is None else args.min_seconds
    if rounds < 1 or min_seconds < 0 or args.profile_steps < 0:
        raise SlipcacheError("--rounds must be >= 1, --min-seconds and --profile-steps >= 0")
    budget_gb = args.memory_budget_gb if args.memory_budget_gb is not None else default_budget_gb()
    if budget_gb <= 0:
        raise SlipcacheError(f"--memory-budget-gb must be positive, got {budget_gb}")
    out_dir = str(args.out)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SlipcacheError(f"--out {out_dir} exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)

    machine = describe_machine()
    load = _load_average()
    cores = machine.get("usable_cores") or machine.get("logical_cores") or 1
    if load is not None and load > cores and torch.get_num_threads() > 1:
        progress(
            f"note: load average {load:.1f} on {cores} cores; with {torch.get_num_threads()} threads per op, "
            "timings on a shared CPU collapse (threads wait for descheduled peers): consider --threads 1"
        )
    probes: dict[str, Any] | None = None
    if not args.skip_probes:
        progress("probing memory (sequential copy, random 64-byte row gathers from 1 GB) ...")
        probes = probe_memory(seconds=0.5 if args.quick else 1.0)
        progress(
            f"  copy {probes['sequential_copy']['copy_gb_s']:.1f} GB/s, "
            f"gather {probes['random_gather']['rows_per_s'] / 1e6:.1f} M rows/s"
        )
    sizes = kaggle_table_sizes(scale, min_rows=args.min_rows)
    progress(
        f"generating ids: {len(sizes)} tables, {sum(sizes):,} rows, {max(warmup, cache_warmup)}+{steps} steps "
        f"of {args.batch_size}"
    )
    # The rows a prefill may need: the largest cache's, oversubscribed, with room for its sets' rounding.
    largest = max((c.cache_fraction for c in configs), default=0.0) if args.prefill else 0.0
    hot_rows = math.ceil(1.25 * PREFILL_OVERSUBSCRIPTION * largest * sum(sizes))
    work = make_workload(
        sizes, args.batch_size, warmup, steps, args.zipf, args.seed, cache_warmup, hot_rows, args.profile_steps
    )
    progress(f"  done in {work.generate_s:.1f} s")

    keys = [(dim, cfg) for dim in dims for cfg in configs]
    per_key: dict[tuple[int, str], list[dict[str, Any]]] = {(dim, cfg.name): [] for dim, cfg in keys}
    budget = int(budget_gb * GB)
    threads = torch.get_num_threads()
    for r in range(rounds):
        for n, (dim, cfg) in enumerate(keys):
            if per_key[(dim, cfg.name)] and per_key[(dim, cfg.name)][0]["status"] != "ok":
                continue  # skipped or not installed: the same in every round
            progress(f"[round {r + 1}/{rounds}, {n + 1}/{len(keys)}] dim {dim} {cfg.name} ...")
            profile_steps = args.profile_steps if r == rounds - 1 else 0
            row = measure(
                cfg, dim, work, budget, min_seconds=min_seconds, profile_steps=profile_steps,
                profile_clock=args.profile_clock,
            )
            row["load_avg_1m_after"] = _load_average()
            per_key[(dim, cfg.name)].append(row)
            if row["status"] == "ok":
                extra = "" if row["hit_rate"] is None else f", hit rate {row['hit_rate']:.3f}"
                if row.get("evictions_per_step") is not None:
                    extra += f", {row['evictions_per_step']:,.0f} evictions/step"
                progress(
                    f"    init {row['init_s']:.1f} s, {row['timed_steps']} steps in {row['timed_s']:.1f} s: "
                    f"{row['samples_per_s']:,.0f} samples/s ({row['samples_per_cpu_s'] or 0:,.0f} per CPU-s), "
                    f"{row['bytes'] / GB:.3f} GB "
                    f"({row['memory_ratio']:.2f}x){extra}"
                )
            else:
                progress(f"    {row['status']}")
    rows = [combine_rounds(per_key[(dim, cfg.name)]) for dim, cfg in keys]
    _attach_ratios(rows)
    share = unique_share(work.batches[work.first_timed :], sizes)
    if probes is not None:
        progress("probing random accesses at each configuration's working-set sizes (the bound) ...")
        costs = AccessCosts(
            0.2 if args.quick else 0.5, int(min(2 * GB, budget / 4)),
            copy_bytes_per_s=probes["sequential_copy"]["copy_gb_s"] * 1e9,
        )
        popularity = Popularity(work.batches[work.first_timed :], sizes)
        attach_bounds(rows, sizes, share, costs, popularity)
        probes["access_costs"] = costs.describe()
        probes["last_level_cache_bytes"] = costs.cache_bytes
    targets = evaluate_targets(rows)
    warnings = []
    loads = [
        x
        for rounds_rows in per_key.values()
        for r in rounds_rows
        for x in (r.get("load_avg_1m"), r.get("load_avg_1m_after"))
        if x is not None
    ]
    # In steady state nearly every row admitted to the cache evicts one (rows that overflow a full set are
    # read and written in place, not admitted); far fewer evictions means the cache is still filling.
    cold = [
        f"{r['name']}@{r['dim']}"
        for r in rows
        if r["status"] == "ok"
        and r["cache_fraction"]
        and (r.get("evictions") or 0) < 0.5 * ((r.get("rows_in") or 0) - (r.get("overflow_rows") or 0))
    ]
    if cold:
        warnings.append(
            "fewer evictions than half the rows admitted to the cache during the timed steps of "
            + ", ".join(cold)
            + ": the cache was still filling, so their hit rate is a cold-start figure, not the steady state "
            "(--prefill, more --cache-warmup-steps or a smaller --scale show capacity misses)"
        )
    # Past `--steps` the timed section runs the same batches again: a cache then holds the rows they need,
    # so hit rate and evictions per step drift from the steady state toward a replay of a short trace.
    replayed = [
        f"{r['name']}@{r['dim']}" for r in rows
        if r["status"] == "ok" and r["cache_fraction"] and r.get("replayed_batches")
    ]
    if replayed:
        warnings.append(
            "the timed section of " + ", ".join(replayed) + f" ran over its {steps} batches more than once "
            "(to last --min-seconds): their cache saw those rows again, so hit rate and samples/s are "
            "optimistic; give --steps at least the steps that run in --min-seconds"
        )
    # This process accounts for about `threads` of the load; more than half a core beyond it is someone else.
    if loads and max(loads) > threads + 0.5:
        warnings.append(
            f"the machine was busy: load average reached {max(loads):.1f} on {cores} cores while this benchmark "
            f"ran {threads} thread(s); samples/s are understated and noisy (see the min-max spread; rerun when idle)"
        )
    # torch's allocator gives the peers' tables huge pages only when the process starts with THP_MEM_ALLOC_ENABLE=1
    ours_huge = any(
        r["status"] == "ok" and r["impl"] == "slipcache"
        and uses_huge_pages(int(r["bytes"] or 0), torch.device("cpu"), args.huge_pages)
        for r in rows
    )
    if ours_huge and any(r["status"] == "ok" and r["impl"] != "slipcache" for r in rows) and os.environ.get(
        "THP_MEM_ALLOC_ENABLE", "0"
    ) in ("", "0"):
        warnings.append(
            "slipcache's tables were on transparent huge pages and the peers' were not: for a like-for-like "
            "comparison start the bench with THP_MEM_ALLOC_ENABLE=1 (torch then gives theirs huge pages too), "
            "or pass --huge-pages off"
        )
    spread = [
        f"{r['name']}@{r['dim']}"
        for r in rows
        if r.get("samples_per_s_min") and (r["samples_per_s_max"] - r["samples_per_s_min"]) > 0.2 * r["samples_per_s"]
    ]
    if spread:
        warnings.append(
            "rounds differ by more than 20% of the median for " + ", ".join(spread) + ": the machine's speed changed "
            "during the run"
        )

    result = {
        "machine": {**machine, "torch_threads": threads, "load_avg_1m_start": load},
        "rounds": rounds,
        "min_seconds": min_seconds,
        "profile_clock": args.profile_clock,
        "command": _command(args, dims, configs),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "rows": rows,
        "probes": probes,
        "unique_share": share,
        "workload": work.describe(),
        "memory_budget_gb": budget_gb,
        "targets": targets,
        "warnings": warnings,
    }
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, allow_nan=False)
        fh.write("\n")
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as fh:
        fh.write(_markdown(result))

    print(format_table(rows))
    profile = format_profile(rows)
    if profile:
        clock = args.profile_clock
        print(f"\nphase profile, µs per sample ({clock} clock; ours; Python overhead = the rest of the step):")
        print(profile)
    print()
    print("targets:")
    print(format_targets(targets))
    for warning in warnings:
        print(f"\nwarning: {warning}")
    print(f"\nwrote {os.path.join(out_dir, 'bench.json')} and bench.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m slipcache.bench.cli embedding ...`: the subcommand without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="slipcache bench")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_bench(args)
    except SlipcacheError as exc:
        print(f"slipcache bench: error: {exc}", file=sys.stderr)
        return 2




if __name__ == "__main__":
    sys.exit(main())
