"""Deprecated import paths: the benchmarks moved to `slipcache.bench`. Each old module name is an alias of
its new module, with a warning. (The studies moved to the source tree's `benchmarks/`, not installed: their
old names are gone; import `benchmarks.<module>` from a checkout.)"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

MOVED: dict[str, str] = {
    "bench": "slipcache.bench.cli",
    "bench_workload": "slipcache.bench.workload",
    "bench_peers": "slipcache.bench.peers",
    "bench_timing": "slipcache.bench.timing",
    "bench_report": "slipcache.bench.report",
    "bench_cache": "slipcache.bench.cache",
    "bench_train": "slipcache.bench.train",
    "machine": "slipcache.bench.machine",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `slipcache.experiments.X` to the very module object it moved to (so patches reach it)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; the old path will be removed", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is already imported under its new name."""


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.append(_Alias())
