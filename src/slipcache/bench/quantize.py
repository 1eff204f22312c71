"""`slipcache bench quantize`: how fast fp32 rows become storage rows, and tables are created.

Three figures per round, interleaved over rounds so a neighbour's burst of load hits every one alike:
the compiled quantize pass alone, the torch path it replaces, and creating a table (the seeded uniform
draw, rounded to nearest into storage) with `CachedEmbeddingBagCollection`. Each in M values/s of wall
time and of this process's CPU time (on a shared machine the CPU figure is what the code costs; the wall
figure is what a user waits). The load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from slipcache.bench.figures import median_range, write_result
from slipcache.errors import SlipcacheError


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the created table (default 2 M)")
    parser.add_argument("--dim", type=int, default=128, help="embedding dim (default 128)")
    parser.add_argument("--precision", default="int4", help="storage precision (default int4)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--json", help="also write the figures to this JSON file")


def _timed(work: Callable[[], Any], values: int) -> tuple[float, float]:
    """(M values/s by wall clock, M values/s by this process's CPU time) of one call of `work`."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return values / wall / 1e6, values / max(cpu, 1e-9) / 1e6


def run_quantize_bench(args: argparse.Namespace) -> int:
    from slipcache._native import quantize
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
    from slipcache.embedding.quant import RowStorage

    if args.rows < 1 or args.dim < 1 or args.rounds < 1:
        raise SlipcacheError("--rows, --dim and --rounds must be positive")
    if not quantize.available():
        raise SlipcacheError("the compiled loops are unavailable (no C compiler, or SLIPCACHE_NATIVE=0)")
    chunk_rows = max(1, (1 << 18) // args.dim)  # what table creation rounds at once
    chunk = torch.rand(chunk_rows, args.dim) * 0.02 - 0.01
    passes = max(1, args.rows // chunk_rows // 4)
    storage = RowStorage(chunk_rows, args.dim, args.precision, huge_pages=args.huge_pages)

    def compiled() -> None:
        for _ in range(passes):
            storage.write_range(0, chunk, "nearest", None)

    def torch_path() -> None:
        for _ in range(max(1, passes // 8)):
            storage.encode(chunk, "nearest", None)

    config = EmbeddingConfig(table_sizes=[args.rows], dim=args.dim, precision=args.precision, cache_size=0.01,
                             huge_pages=args.huge_pages)
    figures: dict[str, list[tuple[float, float]]] = {"compiled": [], "torch": [], "create": []}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        figures["compiled"].append(_timed(compiled, passes * chunk_rows * args.dim))
        figures["torch"].append(_timed(torch_path, max(1, passes // 8) * chunk_rows * args.dim))
        figures["create"].append(_timed(lambda: CachedEmbeddingBagCollection(config), args.rows * args.dim))
    load_after = os.getloadavg()[0]
    result: dict[str, Any] = {
        "dim": args.dim, "precision": args.precision, "rows": args.rows, "rounds": args.rounds,
        "load_average": [load_before, load_after], "threads": torch.get_num_threads(),
    }
    print(f"{args.precision} at dim {args.dim}, {args.rounds} rounds, "
          f"load average {load_before:.1f} -> {load_after:.1f}")
    for name, label in (("compiled", "compiled quantize pass"), ("torch", "torch quantize path"),
                        ("create", f"create a {args.rows:,}-row table")):
        wall = [w for w, _ in figures[name]]
        cpu = [c for _, c in figures[name]]
        result[name] = {"wall_mvalues_s": wall, "cpu_mvalues_s": cpu}
        print(f"  {label:<32} {median_range(wall, 'M values/s wall', width=7)}, "
              f"{median_range(cpu, 'per CPU second', width=7)}")
    write_result(args.json, result)
    return 0
