"""`slipcache train`'s flags and the summary table a run ends with (the command, one process or a rank
of N, is `slipcache/train_command.py`), and `slipcache eval`: evaluating a saved run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from slipcache.errors import SlipcacheError
from slipcache.options import (
    add_huge_pages_flag,
    add_progress_flag,
    add_threads_flag,
    positive_int,
)
from slipcache.training.datasets import (
    check_table_sizes,
    open_dataset,
    prepare_data,
    resolve_data,
    run_dataset_dir,
)
from slipcache.training.flags import add_config_flags
from slipcache.training.parts import ScheduleSettings
from slipcache.training.saved_run import find_checkpoint, load_saved_model, saved_config
from slipcache.training.trainer import evaluate


def fmt_bytes(n: float) -> str:
    """Bytes with a binary unit (B, KiB, MiB, GiB), for the summary table and `slipcache plan`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def ceiling_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Generated data: how far the test AUC is from the best a model can reach (the k = 10 coverage ceiling)."""
    ceiling = summary.get("ceiling")
    if not ceiling:
        return []
    best = ceiling["coverage_auc"]["10"]
    return [("AUC ceiling", f"{best:.4f} (values seen >= 10 times), {best - summary['auc']:.4f} to go; "
             f"teacher {ceiling['teacher_auc']:.4f}")]


def format_summary(summary: dict[str, Any]) -> str:
    """The short table `slipcache train` ends with."""
    rate = summary["samples_per_s"]
    rows = [
        ("AUC (test)", f"{summary['auc']:.4f}"),
        ("log loss (test)", f"{summary['logloss']:.4f}"),
        ("normalized entropy", f"{summary['normalized_entropy']:.4f}"),
        *ceiling_rows(summary),
        (
            "embedding memory",
            f"{fmt_bytes(summary['embedding_bytes'])} vs {fmt_bytes(summary['fp32_embedding_bytes'])} fp32 "
            f"({summary['memory_ratio']:.2f}x smaller)",
        ),
        ("throughput", f"{rate:,.0f} samples/s" if rate else "n/a"),
        ("train time", f"{summary['train_wall_s']:.1f} s for {summary['train_samples']:,} samples"),
    ]
    if summary.get("cache_hit_rate") is not None:
        rows.insert(4, ("cache hit rate", f"{100 * summary['cache_hit_rate']:.1f}%"))
    if summary.get("staleness"):
        rows.append(("skipped as stale", f"{100 * summary['skipped_fraction']:.1f}% of inputs"))
    quality = summary.get("data_quality")
    if quality and quality["malformed_lines"]:
        rows.append(("malformed lines", f"{quality['malformed_lines']:,} skipped (see report.md)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """`TrainConfig`'s flags (`training/flags.py`), `--config` and the progress flags; `--help` shows the
    ones most runs need, `--help-all` every one."""
    from slipcache.training.flags import HelpAll

    parser.add_argument("--help-all", action=HelpAll, help="show every flag (the detailed options too) and exit")
    parser.add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS,
        help="TOML or YAML file of config keys (a flag --a-b is the key a_b); flags override it",
    )
    add_config_flags(parser)
    add_progress_flag(parser, default=argparse.SUPPRESS)
    flags = [a for a in parser._actions if a.option_strings and not isinstance(a, (argparse._HelpAction, HelpAll))]
    shown = sum(1 for a in flags if a.help is not argparse.SUPPRESS)
    parser.usage = f"{parser.prog} [--data PATH] [--out DIR] [--quick] [FLAG ...]"
    parser.epilog = (
        f"These are the flags most runs need ({shown} of {len(flags)}); `{parser.prog} --help-all` "
        "shows every one: stale-input skipping's detailed options, the schedule's details, the data's options."
    )


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    parser.add_argument("--data", default=None, help="dataset (default: the one the run trained on)")
    parser.add_argument(
        "--split", default="test", choices=("train", "val", "test"), help="split to evaluate (default test)"
    )
    parser.add_argument(
        "--eval-samples", dest="samples", metavar="N", type=positive_int, default=None,
        help="evaluate the first N samples of the split, as `train --eval-samples` (default: all)",
    )
    add_threads_flag(parser)
    add_huge_pages_flag(parser)
    parser.add_argument(
        "--allow-changes",
        action="store_true",
        help="evaluate even when the run's dataset is no longer the data it trained on (its fingerprint differs)",
    )


def evaluate_checkpoint(
    checkpoint_path: str | Path,
    *,
    data: str | None = None,
    split: str = "test",
    samples: int | None = None,
    allow_changes: bool = False,
) -> dict[str, float]:
    """Metrics of a saved model on a dataset split. On the run's own dataset (no `data`), that dataset must
    still be the data the run trained on (its fingerprint), unless `allow_changes`."""
    if samples is not None:
        ScheduleSettings(eval_samples=samples)  # checked as the run's own --eval-samples is
    saved = find_checkpoint(checkpoint_path, "--checkpoint").read()
    state, path = saved.state, saved.path
    config = saved_config(saved)
    if data is not None:
        config.data.data = str(resolve_data(data))
        dataset_dir = prepare_data(config)
    else:
        saved_dataset = state["config"].get("dataset")
        dataset_dir = run_dataset_dir(config, saved_dataset if isinstance(saved_dataset, str) else None)
    dataset = open_dataset(dataset_dir, config)
    try:
        check_table_sizes(state["table_sizes"], dataset.table_sizes, f"dataset {dataset_dir}")
    except SlipcacheError as exc:
        if data is None:
            raise
        raise SlipcacheError(  # new raw files got a vocabulary of their own: predict maps them with the run's
            f"{exc}; to score other data with the run's own vocabulary: "
            f"slipcache predict --checkpoint {checkpoint_path} {data} --out scores.txt"
        ) from exc
    if data is None:
        from slipcache.data.fingerprint import check_same_data, fingerprint

        what = f"dataset {dataset_dir} of checkpoint {path}"
        trained_on = state["config"].get("data_fingerprint")
        diff = check_same_data(trained_on, fingerprint(dataset), allow=allow_changes, what=what)
        if diff is not None:
            print(f"slipcache eval: warning: {what} is not the data the run trained on ({diff})", file=sys.stderr)
    if split not in dataset.splits or not dataset.splits[split]:
        raise SlipcacheError(f"dataset {dataset_dir} has no {split!r} split")
    model = load_saved_model(saved, dataset.num_dense)
    return evaluate(model, dataset.split(split), max_samples=samples)


def run_eval(args: argparse.Namespace) -> int:
    scores = evaluate_checkpoint(
        args.checkpoint, data=args.data, split=args.split, samples=args.samples, allow_changes=args.allow_changes
    )
    print(f"{args.split}: {scores['samples']:,} samples")
    for name in ("auc", "logloss", "accuracy", "normalized_entropy"):
        print(f"  {name:<20} {scores[name]:.4f}")
    return 0
