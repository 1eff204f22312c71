"""`slipcache experiment`: the research studies live in the source tree's `benchmarks/` (not installed).

From a source checkout (an editable install, or PYTHONPATH=src) the command finds them next to `src/`;
from an installed wheel it says in one line where they are instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from pathlib import Path

from slipcache.errors import SlipcacheError

MISSING = ("the studies are not installed with the package: run `python -m benchmarks.studies` from a "
           "source checkout of slipcache (they live in its benchmarks/ directory)")


CHECKOUT = Path(__file__).resolve().parents[3]  # src/slipcache/bench/experiment.py -> the checkout


def import_studies(root: Path = CHECKOUT) -> types.ModuleType:
    """benchmarks.studies, importable as is or from the checkout (root) this package was loaded from."""
    try:
        return importlib.import_module("benchmarks.studies")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.studies"):
            raise
    if not (root / "benchmarks" / "studies.py").is_file():
        raise SlipcacheError(MISSING)
    sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.studies")


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        studies = import_studies()
    except SlipcacheError:  # parse anything; run_experiment then says where the studies are
        parser.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    studies.add_experiment_arguments(parser)


def run_experiment(args: argparse.Namespace) -> int:
    return int(import_studies().run_experiment(args))
