"""`slipcache experiment`: the research studies live in the source tree's `benchmarks/` (not installed).

From a source checkout (an editable install, or PYTHONPATH=src) the command runs `python -m benchmarks.studies`
with the same arguments in a child process that finds the checkout on its PYTHONPATH: this process's import
path stays as it is, and the child keeps the working directory, so a relative `--out` means the same.
From an installed wheel it says in one line where the studies are instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from slipcache.errors import SlipcacheError

MISSING = ("the studies are not installed with the package: run `python -m benchmarks.studies` from a "
           "source checkout of slipcache (they live in its benchmarks/ directory)")

COMMAND = "slipcache experiment"
# The child's first argument: its usage and errors then name `slipcache experiment`, the command the user typed.
AS_COMMAND = "--as-slipcache-experiment"

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds this slipcache package
CHECKOUT = PACKAGE_ROOT.parent  # src/slipcache/bench/experiment.py -> the checkout


def studies_command(argv: list[str], root: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that runs the studies of the checkout `root` (default: the one this package
    was loaded from) with `argv`, on this slipcache; SlipcacheError(MISSING) where there are none."""
    root = CHECKOUT if root is None else root
    if not (root / "benchmarks" / "studies.py").is_file():
        raise SlipcacheError(MISSING)
    env = dict(os.environ)
    paths = [str(root), str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # -P: the working directory is not put first on the child's path, so another `benchmarks` there
    # cannot stand in for the checkout's.
    return [sys.executable, "-P", "-m", "benchmarks.studies", AS_COMMAND, *argv], env


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    """Every argument is the studies' (`--help` too): none is read here, all are passed on."""
    parser.prefix_chars = "\0"  # nothing after `experiment` is taken for an option of this parser
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="STUDY ...",
        help="the study and its flags (`slipcache experiment --help` lists them, from a source checkout)",
    )


def run_experiment(args: argparse.Namespace) -> int:
    command, env = studies_command(list(args.argv))
    child = subprocess.Popen(command, env=env)
    try:
        return child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too: it stops, keeping the runs it finished
        child.wait()
        raise
