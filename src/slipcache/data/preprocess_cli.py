"""`slipcache preprocess`: raw Criteo files to a binary dataset (the command; `preprocess.preprocess` the work)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from slipcache.data.dataset import check_output_dir
from slipcache.data.preprocess import DEFAULT_MAX_ROWS, DEFAULT_MIN_COUNT, DEFAULT_SPLIT, preprocess
from slipcache.errors import RunInterrupted
from slipcache.options import add_progress_flag, seed_arg


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="raw Criteo files (tsv, csv; .gz too)")
    parser.add_argument("--out", required=True, help="output dataset directory")
    parser.add_argument(
        "--vocab",
        choices=("frequency", "hash"),
        default="frequency",
        help="frequency: a row per value seen (default); hash: --max-rows hashed rows per table",
    )
    parser.add_argument(
        "--min-count",
        type=int,
        default=DEFAULT_MIN_COUNT,
        help="frequency vocab: values seen fewer times in train share row 0 (default %(default)s)",
    )
    parser.add_argument(
        "--max-rows",
        type=int,
        default=DEFAULT_MAX_ROWS,
        help="hash vocab: rows per table (default %(default)s)",
    )
    parser.add_argument(
        "--split",
        default=DEFAULT_SPLIT,
        help="train,val,test fractions as contiguous ranges in input order, or 'days' "
        "(one file per day; the last one is halved into val and test) (default %(default)s)",
    )
    parser.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    parser.add_argument("--seed", type=seed_arg, default=0, help="salt of the hash vocabulary")
    parser.add_argument("--force", action="store_true", help="overwrite the dataset already in --out")
    add_progress_flag(parser)


@contextlib.contextmanager
def _stopped_by_signals() -> Any:
    """SIGTERM and SIGHUP raise in the main thread (as Ctrl-C does), so that a stopped preprocessing removes its
    scratch space and the output directory it made instead of dying with them on disk."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        raise RunInterrupted(f"stopped by {signal.Signals(signum).name}; nothing was written", signum)

    previous = {}
    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_preprocess(args: argparse.Namespace) -> int:
    check_output_dir(args.out, force=args.force)
    with _stopped_by_signals():
        meta = _run(args)
    return _report(meta, args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    return preprocess(
        args.inputs,
        args.out,
        vocab=args.vocab,
        min_count=args.min_count,
        max_rows=args.max_rows,
        split=args.split,
        strict=args.strict,
        progress=args.progress,
        seed=args.seed,
    )


def _report(meta: dict[str, Any], args: argparse.Namespace) -> int:
    source = meta["source"]
    print(f"good lines: {source['good_lines']}, bad lines: {source['bad_lines']}")
    for example in source["bad_examples"]:
        print(f"  {example}")
    splits = ", ".join(f"{k} {v}" for k, v in meta["splits"].items())
    print(
        f"wrote {args.out}: {splits}; {sum(meta['table_sizes'])} embedding rows; "
        f"positive rate {meta['positive_rate']:.4f}"
    )
    return 0
