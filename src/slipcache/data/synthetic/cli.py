"""`slipcache synth`: generate a dataset, or compare the generators with real rows (`--compare`)."""

from __future__ import annotations

import argparse

from slipcache.data.dataset import check_output_dir
from slipcache.data.presets import parse_table_sizes
from slipcache.data.synthetic.compare import COMPARE_ROWS, compare_with_real, format_comparison
from slipcache.data.synthetic.generate import (
    DEFAULT_GENERATOR,
    DEFAULT_SAMPLES,
    GENERATOR_VERSIONS,
    LAYOUTS,
    generate_synthetic,
)
from slipcache.data.synthetic.v3 import DAYS, DRIFT_RATE, NEW_ENTITY_RATE
from slipcache.errors import SlipcacheError
from slipcache.options import add_progress_flag, float_in, seed_arg

# Terabyte's vocabulary is about 8x Kaggle's; a larger scale only asks for tables no machine holds.
MAX_SCALE = 8.0


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="output dataset directory (required unless --compare)")
    parser.add_argument(
        "--samples", type=int, default=DEFAULT_SAMPLES, help="total rows (default %(default)s)"
    )
    parser.add_argument(
        "--scale",
        type=float_in(0, MAX_SCALE),
        default=1.0,
        help=f"multiplier of the Kaggle table sizes, at most {MAX_SCALE:g} (default %(default)s)",
    )
    parser.add_argument(
        "--table-sizes",
        type=parse_table_sizes,
        default=None,
        help="v3: rows per table instead of --scale: a preset (mlperf: the MLPerf DLRM tables, 204 M rows; "
        "kaggle) or 26 comma-separated counts; the tables take v3's roles by size",
    )
    parser.add_argument(
        "--format",
        dest="layout",
        choices=LAYOUTS,
        default="slipcache",
        help="slipcache's dataset files (default) or TorchRec's day_{i}_{dense,sparse,labels}.npy",
    )
    parser.add_argument("--seed", type=seed_arg, default=0, help="random seed (default 0)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of rows in val (default 0.1)")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="share of rows in test (default 0.1)")
    parser.add_argument(
        "--generator",
        choices=tuple(GENERATOR_VERSIONS),
        default=DEFAULT_GENERATOR,
        help="v5 (default): v4 with the label signal reaching the rarer values; v4: v3 with the label signal, "
        "dense shapes and links of real rows; v3: latent entities, time order",
    )
    parser.add_argument("--days", type=int, default=DAYS, help="days the log spans (default %(default)s)")
    parser.add_argument(
        "--new-entity-rate",
        type=float,
        default=NEW_ENTITY_RATE,
        help="share of each entity's popularity ranks taken by new entities per day (default %(default)s)",
    )
    parser.add_argument(
        "--drift-rate",
        type=float,
        default=DRIFT_RATE,
        help="share of ranks passed to another existing entity per day (default %(default)s)",
    )
    parser.add_argument(
        "--compare",
        metavar="REAL_FILE",
        help="instead of writing data: real vs synthetic statistics (v5, v4 and v3) side by side, with tolerances",
    )
    parser.add_argument(
        "--compare-rows",
        type=int,
        default=COMPARE_ROWS,
        help="--compare: real rows read from the start of the file (default %(default)s)",
    )
    parser.add_argument(
        "--compare-day",
        type=int,
        default=0,
        help="--compare: the synthetic window starts this day (default 0)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite the dataset already in --out")
    add_progress_flag(parser)


def run_synth(args: argparse.Namespace) -> int:
    if args.compare:
        result = compare_with_real(
            args.compare,
            max_rows=args.compare_rows,
            day=args.compare_day,
            num_samples=args.samples,
            scale=args.scale,
            seed=args.seed,
            days=args.days,
            new_entity_rate=args.new_entity_rate,
            drift_rate=args.drift_rate,
        )
        print(format_comparison(result))
        return 0
    if not args.out:
        raise SlipcacheError("synth needs --out DIR (or --compare REAL_FILE)")
    check_output_dir(args.out, force=args.force)
    meta = generate_synthetic(
        args.out,
        num_samples=args.samples,
        scale=args.scale,
        seed=args.seed,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
        generator=args.generator,
        days=args.days,
        new_entity_rate=args.new_entity_rate,
        drift_rate=args.drift_rate,
        progress=args.progress,
        table_sizes=args.table_sizes,
        layout=args.layout,
    )
    splits = ", ".join(f"{k} {v}" for k, v in meta["splits"].items())
    if args.layout == "torchrec":
        splits += " (TorchRec day files: the last day holds val then test)"
    print(
        f"wrote {args.out} ({args.generator}): {splits}; {sum(meta['table_sizes'])} embedding rows; "
        f"positive rate {meta['positive_rate']:.4f}; teacher AUC {meta['teacher_auc']}"
        + (f"; a model can reach about {meta['ceiling']['coverage_auc']['10']:.4f} (the teacher without the values "
           "seen < 10 times in training)" if meta.get("ceiling") else "")
    )
    return 0
