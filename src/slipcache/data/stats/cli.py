"""`slipcache stats`: its flags, and printing or writing the result."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from slipcache.data.stats.compute import (
    DEFAULT_BUDGETS_MB,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_HOT_FRACTIONS,
    DEFAULT_MAX_VALUES,
    DEFAULT_SAMPLE_ROWS,
    compute_stats,
)
from slipcache.data.stats.report import format_stats, plot_stats
from slipcache.data.stats.signal import DEFAULT_SIGNAL_ROWS
from slipcache.data.synthetic.regenerate import dataset_ceiling
from slipcache.errors import SlipcacheError
from slipcache.options import add_progress_flag, image_file, seed_arg
from slipcache.safe_files import prepare_output_file, write_atomic


def _positive_list(text: str) -> list[float]:
    """'64,256,1024' -> [64.0, 256.0, 1024.0] (for argparse)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 64,256,1024, got {text!r}"
        ) from exc
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH", help="raw Criteo file or directory (tsv/csv, .gz too) or a dataset"
    )
    parser.add_argument("--max-rows", type=int, default=None, help="measure only the first N rows")
    parser.add_argument(
        "--json", metavar="FILE", help="also write the statistics as JSON ('-': stdout only; its directory is created)"
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", type=image_file, help="also draw them into a PNG (its directory is created)"
    )
    parser.add_argument(
        "--budgets-mb", type=_positive_list, default=list(DEFAULT_BUDGETS_MB),
        help="hot-row budgets in MB for the hot-input share (default 64,256,1024)",
    )  # fmt: skip
    parser.add_argument(
        "--hot-fractions", type=_positive_list, default=list(DEFAULT_HOT_FRACTIONS),
        help="hot-row budgets as shares of the sample's values (default 0.01,0.1)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
        help="rows per chunk for the over-time figures (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--sample-rows", type=int, default=DEFAULT_SAMPLE_ROWS,
        help="rows kept for per-row figures; more rows make them estimates (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-values", type=int, default=DEFAULT_MAX_VALUES,
        help="distinct values counted exactly before counts are sampled (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--split", action="append", help="dataset split to read (repeatable; default all)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the row sample")
    parser.add_argument(
        "--signal-rows", type=int, default=DEFAULT_SIGNAL_ROWS,
        help="first rows kept for target AUC, dense shapes and table links (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--ceiling", action="store_true",
        help="data that slipcache generated: also the best AUC a model can reach on its test split (the "
        "teacher's, and with the values seen < 1, 10, 100 times in training removed)",
    )  # fmt: skip
    add_progress_flag(parser)


def _write_plot(stats: dict, path: Path) -> None:
    """The PNG under a temporary name (same suffix: matplotlib picks the format by it), then renamed."""
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        plot_stats(stats, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_stats(args: argparse.Namespace) -> int:
    # The output paths are checked, and their directories made, before minutes of counting.
    plot = prepare_output_file(Path(args.plot), "--plot") if args.plot else None
    json_file = prepare_output_file(Path(args.json), "--json") if args.json and args.json != "-" else None
    stats = compute_stats(
        args.path,
        max_rows=args.max_rows,
        chunk_rows=args.chunk_rows,
        budgets_mb=args.budgets_mb,
        hot_fractions=args.hot_fractions,
        progress=args.progress,
        sample_rows=args.sample_rows,
        max_values=args.max_values,
        splits=args.split,
        seed=args.seed,
        signal_rows=args.signal_rows,
    )
    if args.ceiling:
        try:
            stats["ceiling"] = dataset_ceiling(args.path, progress=args.progress)
        except SlipcacheError as exc:
            stats["ceiling"] = None
            print(exc, file=sys.stderr)
    if plot is not None:
        _write_plot(stats, plot)
    if args.json == "-":
        json.dump(stats, sys.stdout, indent=1)
        print()
        return 0
    if json_file is not None:
        write_atomic(json_file, json.dumps(stats, indent=1) + "\n")
    print(format_stats(stats))
    return 0
