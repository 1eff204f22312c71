"""The `slipcache` command: one subcommand per job, each defined in the module that does the work."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from slipcache import __version__
from slipcache.console import console_messages
from slipcache.errors import RunInterrupted, SlipcacheError
from slipcache.options import torch_threads

# name -> (module, help). The module defines add_<name>_arguments(parser) and run_<name>(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("slipcache.train_command", "train a DLRM model (synthetic data by default)"),
    "eval": ("slipcache.training.cli", "evaluate a checkpoint on a dataset split"),
    "synth": ("slipcache.data.synthetic.cli", "generate a synthetic Criteo-shaped dataset"),
    "preprocess": ("slipcache.data.preprocess_cli", "convert raw Criteo files to a binary dataset"),
    "stats": ("slipcache.data.stats.cli", "access-pattern statistics of raw Criteo files or a dataset"),
    "bench": ("slipcache.bench.cli", "benchmark embedding implementations"),
    "experiment": ("slipcache.bench.experiment", "run the papers' experiments and write a report"),
    "plan": ("slipcache.planning.cli", "choose per-table precision and cache rows for a memory budget"),
    "export": ("slipcache.export", "write a trained model for serving: tables (nn.EmbeddingBag, TorchRec, FBGEMM "
               "INT8), dense layers, configuration and vocabulary"),
    "predict": ("slipcache.predict", "score raw Criteo files or a dataset with a trained run or an export"),
}


def unknown_flag_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """'unrecognized arguments: --lr-shedule (did you mean --lr-schedule?)': the closest flag the command
    has to the first unknown one, by spelling."""
    import difflib

    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    first = next((arg for arg in unknown if arg.startswith("-")), unknown[0]).split("=", 1)[0]
    close = difflib.get_close_matches(first, flags, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else f" (`{parser.prog} --help` lists the flags)"
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


class OneLineErrors(argparse.ArgumentParser):
    """A usage error (a bad choice or type, a missing argument) is one line and the hint to the command's
    help, not the whole usage before it (train's is long); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (torch and friends load slowly)."""
    parser = OneLineErrors(
        prog="slipcache",
        description="Train recommendation models with mixed-precision cached embeddings "
        "and stale-input skipping.",
    )
    parser.add_argument("--version", action="version", version=f"slipcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrors)
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            getattr(module, f"add_{name}_arguments")(sub_parser)
            sub_parser.set_defaults(_module=module_name, _parser=sub_parser)
    return parser


WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"


def set_wait_policy() -> None:
    """OpenMP threads that sleep while they wait, unless the environment chose (`OMP_WAIT_POLICY`).

    Why: torch's OpenMP threads otherwise spin at every join, and with other processes on the cores a
    spinning thread holds the core its descheduled partner needs: the training loop collapsed to a fraction
    of its one-thread speed on torch's default threads; with passive waits it kept pace (docs/threads.md).
    OpenMP reads the setting once, when torch loads, so only the command's entry point can make it, before
    anything imports torch; a library caller keeps its own process's choice."""
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY_VARIABLE, "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    set_wait_policy()
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 0
    if unknown:  # one line naming the command and the nearest flag it has, not the whole usage
        print(f"{args._parser.prog}: error: {unknown_flag_message(args._parser, unknown)}", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(args._module)
    # A command that applies its own threads (train: the run's, a resumed run's unless given) says so.
    threads = None if getattr(module, "APPLIES_THREADS", False) else getattr(args, "threads", None)
    try:
        with (
            console_messages(),  # the library's log records, printed as the one-line messages they say
            torch_threads(threads),
        ):
            return int(getattr(module, f"run_{args.command}")(args) or 0)
    except RunInterrupted as exc:  # stopped as asked, the work saved: not an error
        print(f"slipcache {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
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
    return (
        " (torchrun's report of the stopped processes, a ChildFailedError traceback, follows: this line is the cause)"
    )


if __name__ == "__main__":
    sys.exit(main())
