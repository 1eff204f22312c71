"""The `slipcache` command: one subcommand per job, each defined in the module that does the work."""

from __future__ import annotations

import argparse
import importlib
import sys

from slipcache import __version__
from slipcache.errors import SlipcacheError
from slipcache.options import huge_pages, torch_threads

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
        print(f"slipcache {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a full disk, a missing or unwritable path: the OS says which
        where = f": {exc.filename}" if exc.filename else ""
        print(f"slipcache {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slipcache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
