"""Flags that several commands share, the argparse types they parse with, and the settings `slipcache`
applies for a command's duration. Command modules and library modules import these from here, never from
the command module (`slipcache.cli`)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path


def add_progress_flag(parser: argparse.ArgumentParser, default: object = True) -> None:
    """`--quiet` / `--no-progress`, one flag under both names in every long-running command (args.progress);
    users who learnt one spelling on one command tried it on the others."""
    parser.add_argument("--no-progress", "--quiet", dest="progress", action="store_false", default=default,
                        help="no progress bar")


# The help of --threads and --huge-pages, on every command that has them (`slipcache train`'s are its
# `ProcessSettings` fields, with the same words).
THREADS_HELP = ("torch threads, and threads per compiled embedding loop; their waits sleep, so the default holds "
                "on a busy machine (docs/threads.md)")
THREADS_DEFAULT = "torch's choice, one per core, and one per loop"
HUGE_PAGES_HELP = ("back the tables' storage, cache and optimizer state with transparent huge pages: on, off, or "
                   "auto (tensors of 64 MiB and more); where the kernel has none, off (docs/scale.md)")


def add_threads_flag(parser: argparse.ArgumentParser, default: object = None, help: str | None = None) -> None:
    """`--threads N`: torch threads for the command, the same flag on every command that computes with torch
    (`main` applies it for the command's duration)."""
    parser.add_argument("--threads", type=positive_int, default=default, metavar="N",
                        help=help or f"{THREADS_HELP} (default: {THREADS_DEFAULT})")


def add_huge_pages_flag(parser: argparse.ArgumentParser) -> None:
    """`--huge-pages`: whether the tables' big tensors ask for 2 MiB pages, on every command that builds tables
    (`main` applies it for the command's duration; docs/scale.md says when it helps)."""
    from slipcache.embedding.config import EmbeddingConfig
    from slipcache.embedding.hostmem import HUGE_PAGE_MODES

    default = EmbeddingConfig.huge_pages  # the collection's own default
    parser.add_argument("--huge-pages", choices=HUGE_PAGE_MODES, default=default, dest="huge_pages",
                        help=f"{HUGE_PAGES_HELP} (default: {default})")


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with `threads` torch threads and as many threads per compiled loop (None: leave both settings;
    SLIPCACHE_LOOP_THREADS sets the loops' own), then put the previous settings back."""
    if threads is None:
        yield
        return
    import torch

    from slipcache import _native

    _native.check_thread_count(threads)  # the flag as given (a run's own count, on resume, is not refused)
    loops = _native.threads_for(threads)  # a bad SLIPCACHE_LOOP_THREADS fails before anything changes
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    previous_loops = _native.set_threads(loops)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        _native.set_threads(previous_loops)


SEED_RANGE = "[0, 2**32)"  # numpy's and torch's seeds (`slipcache train --seed` too)


def seed_arg(text: str) -> int:
    """A random seed for argparse, in SEED_RANGE; anything else is a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed must be in {SEED_RANGE}, got {value}")
    return value


def whole_number(text: str) -> int:
    """An integer for argparse, exactly: '123', or scientific notation that is a whole number ('1e18');
    never through a float, so 2**63-1 stays 9223372036854775807."""
    import decimal

    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = decimal.Decimal(text.strip())
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not value.is_finite() or value != value.to_integral_value() or abs(value.adjusted()) > 4300:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """An integer >= 1 for argparse (counts, ways, sizes)."""
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type for a finite float in (low, high] (nan and inf refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low < value <= high:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be in ({low:g}, {high:g}], got {text}")
        return value

    return parse


IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def image_file(text: str) -> str:
    """A plot's file name for argparse: matplotlib picks the format by suffix, so an unknown one is refused
    here, before the work, instead of after it with a traceback."""
    if Path(text).suffix.lower() not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"expected a {', '.join(IMAGE_SUFFIXES)} file name, got {text!r}")
    return text
