"""The `slipcache` command: one subcommand per job, each defined in the module that does the work."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from slipcache import __version__
from slipcache.errors import SlipcacheError

# name -> (module, help). The module defines add_<name>_arguments(parser) and run_<name>(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("slipcache.training.cli", "train a DLRM model (synthetic data by default)"),
    "eval": ("slipcache.training.cli", "evaluate a checkpoint on a dataset split"),
    "synth": ("slipcache.data.synthetic.cli", "generate a synthetic Criteo-shaped dataset"),
    "preprocess": ("slipcache.data.preprocess", "convert raw Criteo files to a binary dataset"),
    "stats": ("slipcache.data.stats.cli", "access-pattern statistics of raw Criteo files or a dataset"),
    "bench": ("slipcache.bench.cli", "benchmark embedding implementations"),
    "experiment": ("slipcache.bench.experiment", "run the papers' experiments and write a report"),
    "plan": ("slipcache.planning.cli", "choose per-table precision and cache rows for a memory budget"),
    "export": ("slipcache.export", "write a checkpoint's tables for serving (nn.EmbeddingBag, TorchRec, FBGEMM INT8)"),
}


def add_progress_flag(parser: argparse.ArgumentParser, default: object = True) -> None:
    """`--quiet` / `--no-progress`, one flag under both names in every long-running command (args.progress);
    users who learnt one spelling on one command tried it on the others."""
    parser.add_argument("--no-progress", "--quiet", dest="progress", action="store_false", default=default,
                        help="no progress bar")


def add_threads_flag(parser: argparse.ArgumentParser, default: object = None, help: str | None = None) -> None:
    """`--threads N`: torch threads for the command, the same flag on every command that computes with torch
    (`main` applies it for the command's duration)."""
    parser.add_argument("--threads", type=positive_int, default=default, metavar="N",
                        help=help or "torch threads, and threads per compiled embedding loop (default: torch's "
                        "choice, one per core, and one per loop; 1 is steadier on a busy machine)")


HUGE_PAGE_CHOICES = ("off", "on", "auto")  # how slipcache.embedding.hostmem allocates the tables' big tensors
ENV_HUGE_PAGES = "SLIPCACHE_HUGE_PAGES"  # its choice for this process (and the processes it starts)


def add_huge_pages_flag(parser: argparse.ArgumentParser) -> None:
    """`--huge-pages`: whether the tables' big tensors ask for 2 MiB pages, on every command that builds tables
    (`main` applies it for the command's duration; docs/scale.md says when it helps)."""
    parser.add_argument("--huge-pages", choices=HUGE_PAGE_CHOICES, default=None, dest="huge_pages",
                        help="back the tables' storage, cache and optimizer state with transparent huge pages: on, "
                        "off, or auto (tensors of 64 MiB and more); where the kernel has none, off (default: "
                        "$SLIPCACHE_HUGE_PAGES, else off)")


@contextlib.contextmanager
def huge_pages(mode: str | None) -> Iterator[None]:
    """Allocate with huge pages per `mode` (None: leave the environment's choice), then put it back. Set in
    the environment, so that processes the command starts (torchrun ranks) allocate the same way."""
    if mode is None:
        yield
        return
    previous = os.environ.get(ENV_HUGE_PAGES)
    os.environ[ENV_HUGE_PAGES] = mode
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_HUGE_PAGES, None)
        else:
            os.environ[ENV_HUGE_PAGES] = previous


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with `threads` torch threads and as many threads per compiled loop (None: leave both settings;
    SLIPCACHE_LOOP_THREADS sets the loops' own), then put the previous settings back."""
    if threads is None:
        yield
        return
    import torch

    from slipcache import _native

    loops = _native.threads_for(threads)  # a bad SLIPCACHE_LOOP_THREADS fails before anything changes
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    previous_loops = _native.set_threads(loops)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        _native.set_threads(previous_loops)


class DeprecatedFlag(argparse.Action):
    """An old spelling kept working: stores into the new flag's `dest` and says so in one line."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: object) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def seed_arg(text: str) -> int:
    """A random seed for argparse: numpy and torch take [0, 2**32); anything else is a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**32), got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 for argparse (counts, ways, sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (torch and friends load slowly)."""
    parser = argparse.ArgumentParser(
        prog="slipcache",
        description="Train recommendation models with mixed-precision cached embeddings "
        "and stale-input skipping.",
    )
    parser.add_argument("--version", action="version", version=f"slipcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            getattr(module, f"add_{name}_arguments")(sub_parser)
            sub_parser.set_defaults(_module=module_name, _parser=sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 0
    if unknown:  # the command's own usage and name, not the top-level ones
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    module = importlib.import_module(args._module)
    try:
        with torch_threads(getattr(args, "threads", None)), huge_pages(getattr(args, "huge_pages", None)):
            return int(getattr(module, f"run_{args.command}")(args) or 0)
    except SlipcacheError as exc:
        print(f"slipcache {args.command}: error: {exc}{_torchrun_note()}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a full disk, a missing or unwritable path: the OS says which
        where = f": {exc.filename}" if exc.filename else ""
        print(f"slipcache {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slipcache {args.command}: interrupted", file=sys.stderr)
        return 130


def _torchrun_note() -> str:
    """Under torchrun, a stopped rank is followed by torchrun's own report (a ChildFailedError traceback):
    the line says so, so that the traceback is not taken for the cause."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("WORLD_SIZE", "1").strip() in ("", "0", "1"):
        return ""
    return " (torchrun's report of the stopped processes, a ChildFailedError traceback, follows: this line is the cause)"


if __name__ == "__main__":
    sys.exit(main())
