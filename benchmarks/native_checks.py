"""What the compiled loops' input checks cost: per call, the hot-update count (its id range pass), the SGD
scatter split over threads (its position lists, now per-thread scratch) and the Adagrad step (its
distinct-row check), at a Criteo-like batch.

Each round times every loop over `--calls` calls after one warm-up call; prints per loop the median per call
with min-max over the rounds, and the load average. Run from the repository root:

    python -m benchmarks.native_checks --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from slipcache import _native
from slipcache._native import filter as native_filter
from slipcache.staleness.hotset import HotIndex

BATCH, TABLES, DIM = 4096, 26, 16


def loops(seed: int = 0) -> dict[str, Callable[[], object]]:
    """One call of each loop on fixed inputs."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(np.geomspace(10, 2_000_000, TABLES).astype(np.int64), 2_000_000)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    ids = np.stack([np.minimum(rng.zipf(1.2, BATCH) - 1, s - 1) for s in sizes], axis=1).astype(np.int32)
    hot = np.unique((ids[:1024].astype(np.int64) + offsets[:-1]).reshape(-1))
    flags = np.zeros(int(offsets[-1]), np.uint8)
    flags[hot] = 1
    index, counts = HotIndex(hot), np.zeros(hot.size, np.int64)
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(200_000, DIM, generator=g)
    slots = torch.randint(0, 200_000, (BATCH * TABLES,), generator=g)
    grad = torch.randn(BATCH * TABLES, DIM, generator=g) * 1e-3
    unique = torch.randperm(200_000, generator=g)[:50_000]
    state, state_rows = torch.zeros(1_000_000), torch.randperm(1_000_000, generator=g)[:50_000]
    row_grad = grad[:50_000].clone()
    return {
        "count_hot_updates": lambda: native_filter.count_hot_updates(
            ids, offsets, flags, index.keys, index.values, counts
        ),
        "sgd_update": lambda: _native.sgd_update(weights, slots, grad, 1e-3),
        "adagrad_update": lambda: _native.adagrad_update(weights, unique, state, state_rows, row_grad, 1e-3, 1e-8),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2, help="threads of the compiled loops")
    args = parser.parse_args()
    if _native.native() is None:
        raise SystemExit("no compiled library (no C compiler, or SLIPCACHE_NATIVE=0)")
    _native.set_threads(args.threads)
    calls = loops()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            call()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            seconds[name].append((time.perf_counter() - start) / args.calls)
    print(f"batch {BATCH} x {TABLES}, dim {DIM}, {args.threads} loop threads, load {os.getloadavg()[0]:.2f}")
    for name, values in seconds.items():
        us = [v * 1e6 for v in values]
        print(f"{name:>18}: {statistics.median(us):8.0f} us per call ({min(us):.0f}-{max(us):.0f})")
    print(f"scratch held: {_native.scratch_bytes() / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
