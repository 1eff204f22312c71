"""`slipcache train` and `slipcache eval`: their flags, evaluating a saved run, and the summary table a run ends with."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from slipcache.cli import add_progress_flag
from slipcache.data.presets import parse_table_sizes
from slipcache.data.synthetic import GENERATOR_VERSIONS
from slipcache.embedding.cache import POLICIES
from slipcache.embedding.collection import OPTIMIZERS
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS
from slipcache.errors import SlipcacheError
from slipcache.model import EMBEDDING_KINDS
from slipcache.staleness.config import HOT_SETS, RULES, SKIP_RULE_HELP, SKIP_RULES, STALE_PRESETS, preset_help
from slipcache.training.config import CONFIG_FIELDS, VOCABS, load_config_file, make_config
from slipcache.training.datasets import (
    check_table_sizes,
    open_dataset,
    prepare_data,
    resolve_data,
    run_dataset_dir,
)
from slipcache.training.saved_run import find_checkpoint, load_saved_model, saved_config
from slipcache.training.trainer import evaluate, train


def fmt_bytes(n: float) -> str:
    """Bytes with a binary unit (B, KiB, MiB, GiB), for the summary table and `slipcache plan`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_summary(summary: dict[str, Any]) -> str:
    """The short table `slipcache train` ends with."""
    rate = summary["samples_per_s"]
    rows = [
        ("AUC (test)", f"{summary['auc']:.4f}"),
        ("log loss (test)", f"{summary['logloss']:.4f}"),
        ("normalized entropy", f"{summary['normalized_entropy']:.4f}"),
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
    """Every flag defaults to 'not given' so that a config file value is only overridden on purpose."""
    s = argparse.SUPPRESS
    add = parser.add_argument
    add("--config", metavar="FILE", default=s, help="TOML or YAML file of config keys; flags override it")
    add(
        "--data",
        default=s,
        help="raw Criteo file/dir (any of the 3 formats) or a preprocessed dataset dir; "
        "default: synthetic data",
    )
    add("--out", default=s, help="run directory (default runs/<timestamp>)")
    add(
        "--generator",
        dest="synthetic_generator",
        choices=tuple(GENERATOR_VERSIONS),
        default=s,
        help="synthetic data generator: v4 (default; v3 with real signal, dense shapes and links), v3 or v2 (earlier figures)",
    )
    add(
        "--resume",
        metavar="RUN_OR_CHECKPOINT",
        default=s,
        help="continue an interrupted run, in its own directory (or a new empty --out)",
    )
    add(
        "--allow-changes",
        action="store_true",
        default=s,
        help="with --resume: continue with settings that differ from the run's (e.g. a larger --samples)",
    )
    add("--quick", action="store_true", default=s, help="small synthetic run, well under a minute")
    add(
        "--embeddings",
        choices=EMBEDDING_KINDS,
        default=s,
        help="cached = mixed-precision + fp32 cache (default); torch = fp32 nn.EmbeddingBag baseline",
    )
    add("--precision", choices=PRECISIONS, default=s, help="embedding storage precision (default int8)")
    add("--cache-size", type=float, default=s, help="share of rows cached, 0..1; 1 = every row (default 0.05)")
    add("--cache-rows", type=int, default=s, help="cache capacity as a number of rows (overrides --cache-size)")
    add("--policy", choices=POLICIES, default=s, help="cache replacement policy; none = no cache (default lru)")
    add("--lookahead", type=int, default=s, help="batches ahead the lookahead policies see (default 4)")
    add(
        "--prefetch",
        action="store_true",
        default=s,
        help="read the next batch's rows into the cache in the background while the current one computes",
    )
    add("--rounding", choices=ROUNDINGS, default=s, help="rounding into storage (default stochastic)")
    add("--optimizer", choices=OPTIMIZERS, default=s, help="embedding optimizer (default sgd)")
    add("--lr", type=float, default=s, help="embedding learning rate (default 0.3)")
    add("--dense-lr", type=float, default=s, help="MLP learning rate (default: --lr)")
    add("--batch-size", type=int, default=s, help="samples per batch (default 256)")
    add("--epochs", type=int, default=s, help="passes over the training split (default 1)")
    add("--samples", type=int, default=s, help="training budget in samples (overrides --epochs)")
    add(
        "--eval-every",
        metavar="SAMPLES",
        type=int,
        default=s,
        help="evaluate on the validation split after every SAMPLES samples consumed (trained or skipped; "
        "default: 10 per run)",
    )
    add(
        "--eval-samples",
        metavar="N",
        type=int,
        default=s,
        help="validation samples per evaluation, the first N of the split (default 100000)",
    )
    add("--checkpoint-every", type=int, default=s, help="samples between checkpoints (default: 4 per run)")
    add(
        "--keep-checkpoints",
        type=int,
        default=s,
        help="periodic checkpoints kept on disk, newest first (default 2; the MLPerf tables take 15 GB each)",
    )
    add("--dim", dest="embedding_dim", type=int, default=s, help="embedding dimension (default 16)")
    add("--seed", type=int, default=s, help="random seed (default 0)")
    add("--vocab", choices=VOCABS, default=s, help="raw data vocabulary: hash (default) or frequency")
    add("--max-rows", type=int, default=s, help="raw data, hash vocabulary: rows per table (default 1000000)")
    add("--min-count", type=int, default=s, help="raw data, frequency vocabulary: minimum count (default 1)")
    add("--strict", action="store_true", default=s, help="raw data: stop at the first malformed line")
    add(
        "--table-sizes",
        type=parse_table_sizes,
        default=s,
        help="TorchRec/DLRM/MLPerf files: rows per table, one for all, 26 comma-separated or a preset "
        "(mlperf, kaggle); ids are taken modulo them (TorchRec's hashes). Default: the files' counts, else "
        "max id + 1. A slipcache dataset must match its own sizes",
    )
    add(
        "--wire-precision",
        choices=("fp32", "fp16", "bf16"),
        default=s,
        help="torchrun runs: rows and gradients between ranks as fp32 (default) or fp16/bf16 (half the bytes)",
    )
    add(
        "--split-order",
        choices=("val-test", "test-val"),
        default=s,
        help="which half of the last day is validation (default: the format's convention)",
    )
    add_progress_flag(parser, default=s)
    add(
        "--tensorboard",
        nargs="?",
        const="",
        default=s,
        metavar="DIR",
        help="also write the metrics as TensorBoard events (default DIR: <out>/tensorboard)",
    )
    add(
        "--skip-stale",
        action="store_true",
        default=s,
        help="skip stale inputs (Slipstream; docs/skipping.md); the same as --skip-rule stale",
    )
    add("--skip-rule", choices=SKIP_RULES, default=s, help=SKIP_RULE_HELP)
    add("--time-order", choices=("first", "every"), default=s,
        help="time-ordered data: first (default): the first epoch through time, later ones shuffled across "
             "days (validation AUC does not saw at epoch boundaries); every: every epoch through time")
    add("--stale-preset", choices=tuple(STALE_PRESETS), default=s,
        help="a set of --stale-* settings (flags you give still win): " + preset_help())
    add("--stale-hot-set", choices=HOT_SETS, default=s,
        help="budget (default): most accessed rows that fit --stale-budget-mb; frequency: FAE's threshold")
    add("--stale-hot-rate", type=float, default=s,
        help="frequency hot set: share of profiled inputs a hot row is looked up by (default 1e-4)")
    add("--prune-share", type=float, default=s,
        help="loss rule: r, share of below-mean-loss inputs pruned; kept ones weigh 1/(1-r) (default 0.5)")
    add("--prune-final", type=float, default=s, help="loss rule: last share of the run on all data (0.125)")
    add("--stale-target", type=float, default=s, help="D: share of hot inputs to skip (default 0.3)")
    add("--no-stale-guard", dest="stale_guard", action="store_false", default=s, help="no accuracy guard")
    add("--stale-guard-every", type=int, default=s, help="batches between guard checks (default 100)")
    add(
        "--stale-alpha",
        type=float,
        default=s,
        help="share of an input's lookups that must be hot, and stale to skip it (default 1: all; 0.9 = 24 of 26)",
    )
    add(
        "--stale-window",
        type=float,
        default=s,
        help="share of an epoch's batches in the snapshot window (0.02)",
    )
    add("--stale-recheck", type=int, default=s, help="batches between rolling snapshots (default 0 = window)")
    add("--stale-budget-mb", type=float, default=s, help="hot-row snapshot budget in MiB (default 256)")
    add(
        "--stale-min-accesses",
        type=float,
        default=s,
        help="hot rows must expect this many accesses per window (default 0 = budget only, as the paper)",
    )
    add("--stale-release-cache", action="store_true", default=s, help="stale rows give up their cache slots")
    add("--stale-rule", choices=RULES, default=s,
        help="convergence (default): change per update of rows updated >= k times; paper: L-inf change")
    add("--stale-min-updates", type=int, default=s, help="k: updates before a row is judged (default 4)")
    add("--stale-count-share", type=float, default=s,
        help="share of each trained batch whose row updates are counted, then scaled up (default 0.25)")
    add("--stale-warmup", choices=("val", "epoch", "none"), default=s,
        help="skip after validation loss flattened (val, default), from --stale-warmup-epoch, or at once")
    add("--stale-warmup-epoch", type=int, default=s, help="0-based epoch skipping starts by at the latest (1)")
    add("--stale-warmup-min", type=float, default=s, help="never skip in this first share of the run (0.1)")
    add("--stale-warmup-tol", type=float, default=s, help="relative val-loss gain that still counts (0.005)")
    add("--stale-decision", choices=("rolling", "epoch"), default=s,
        help="rolling re-checks (default) or one decision per epoch (the authors')")
    add("--stale-keep", "--stale-control", dest="stale_keep", type=float, default=s,
        help="p: share of would-be-skipped inputs trained anyway, the guard's control (0.05)")
    add("--stale-reweight", action="store_true", default=s,
        help="weight those inputs' loss by 1/p: the expected gradient is the one without skipping")
    add("--stale-weight-max", type=float, default=s, help="clip that weight at this value (default: none, 1/p)")
    add(
        "--no-stale-refit",
        dest="stale_refit",
        action="store_false",
        default=s,
        help="fit the threshold once per epoch (the paper) instead of at every re-check",
    )


def int_list(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] for argparse, so a bad list is argparse's one-line usage error."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def run_train(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS}
    file_values = load_config_file(args.config) if getattr(args, "config", None) else {}
    config = make_config(file_values, flags)
    from slipcache.distributed.launch import init_from_env

    context = init_from_env()  # None unless started by torchrun with more than one process
    if context is None:
        summary = train(config)
    else:
        from slipcache.distributed.training import train_on_ranks

        summary = train_on_ranks(config, context)
        if not context.is_main:
            return 0
    print(f"run: {summary['run_dir']}")
    print(format_summary(summary))
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run directory")
    parser.add_argument("--data", default=None, help="dataset (default: the one the run trained on)")
    parser.add_argument("--split", default="test", choices=("train", "val", "test"), help="split to evaluate (default test)")
    parser.add_argument("--samples", type=int, default=None, help="evaluate only the first N samples")
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
    if samples is not None and samples < 1:
        raise SlipcacheError(f"--samples must be at least 1, got {samples}")
    saved = find_checkpoint(checkpoint_path, "--checkpoint")
    state = saved.read()
    path = saved.path
    config = saved_config(saved, state)
    if data is not None:
        config.data = str(resolve_data(data))
        dataset_dir = prepare_data(config)
    else:
        saved_dataset = state["config"].get("dataset")
        dataset_dir = run_dataset_dir(config, saved_dataset if isinstance(saved_dataset, str) else None)
    dataset = open_dataset(dataset_dir, config)
    check_table_sizes(state["table_sizes"], dataset.table_sizes, f"dataset {dataset_dir}")
    if data is None:
        from slipcache.data.fingerprint import check_same_data, fingerprint

        what = f"dataset {dataset_dir} of checkpoint {path}"
        diff = check_same_data(state["config"].get("data_fingerprint"), fingerprint(dataset), allow=allow_changes, what=what)
        if diff is not None:
            print(f"slipcache eval: warning: {what} is not the data the run trained on ({diff})", file=sys.stderr)
    if split not in dataset.splits or not dataset.splits[split]:
        raise SlipcacheError(f"dataset {dataset_dir} has no {split!r} split")
    model = load_saved_model(saved, state, dataset.num_dense)
    return evaluate(model, dataset.split(split), max_samples=samples)


def run_eval(args: argparse.Namespace) -> int:
    scores = evaluate_checkpoint(
        args.checkpoint, data=args.data, split=args.split, samples=args.samples, allow_changes=args.allow_changes
    )
    print(f"{args.split}: {scores['samples']:,} samples")
    for name in ("auc", "logloss", "accuracy", "normalized_entropy"):
        print(f"  {name:<20} {scores[name]:.4f}")
    return 0


if __name__ == "__main__":  # python -m slipcache.training.cli
    parser = argparse.ArgumentParser(prog="slipcache train")
    add_train_arguments(parser)
    sys.exit(run_train(parser.parse_args()))
