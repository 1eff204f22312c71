"""The cached embedding step with its compiled loops on 1 thread against N threads of the pool, interleaved.

One collection per precision trains the same skewed batches; each round runs the timed steps once per thread
count (the order alternating from round to round), switching the pool's size in between
(`_native.set_threads`; torch stays on one thread). Prints per thread count the step's median wall time with
min-max over the rounds, the phases the split loops serve (`lookup`: the fused forward gather; `evict`:
victims quantized; `fill`: misses; `backward`: the fused update), the gather and the scatter loops alone (best of
`--repeats` runs per round), and the load average beside them: a busy machine's figures are checks, not
verdicts. Run from the repository root:

    python -m benchmarks.loop_threads --threads 1 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from slipcache import _native
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

PHASES = ("lookup", "evict", "fill", "backward")


def timed_steps(coll: CachedEmbeddingBagCollection, batches: list[torch.Tensor]) -> dict[str, float]:
    """Seconds per step: the whole step (forward and backward) and the phases of the split loops."""
    coll.clock.enable()  # from zero
    start = time.perf_counter()
    for ids in batches:
        out = coll(ids)
        out.backward(torch.ones_like(out))
    wall = time.perf_counter() - start
    seconds = {"step": wall / len(batches)}
    seconds.update({phase: (coll.clock.seconds or {}).get(phase, 0.0) / len(batches) for phase in PHASES})
    coll.clock.disable()
    return seconds


def loop_seconds(coll: CachedEmbeddingBagCollection, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """The split loops alone on one batch, best of `repeats` (the least disturbed run on a shared machine):
    the fused forward gather, and the fused SGD scatter with lr 0 (weights unchanged)."""
    cache, tables = coll.cache, ids.shape[1]
    offsets = torch.tensor([0, *coll.config.table_sizes]).cumsum(0)[:-1]
    rows = (ids + offsets).reshape(-1).contiguous()
    out = torch.empty(rows.numel(), cache.weights.shape[1])
    counters = torch.zeros(tables, 3, dtype=torch.int64)
    grad = torch.ones_like(out)
    best = {"gather": float("inf"), "scatter": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        slots, _ = _native.lookup_gather(cache.slot_rows, cache.num_sets, cache.ways, cache.multiplier, rows, tables,
                                         cache.last_used, None, 1, cache.weights, out, counters, (0, 1, 2))
        middle = time.perf_counter()
        _native.sgd_update_finite(cache.weights, slots, grad, 0.0)
        end = time.perf_counter()
        best["gather"] = min(best["gather"], middle - start)
        best["scatter"] = min(best["scatter"], end - middle)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per thread count and round")
    parser.add_argument("--repeats", type=int, default=20, help="runs of the loops alone per round (best kept)")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=300_000, help="rows per table")
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    if _native.native() is None:
        raise SystemExit("no compiled library (no C compiler, or SLIPCACHE_NATIVE=0): nothing to compare")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    sizes = [args.rows] * args.tables
    batches = [torch.stack([(torch.rand(args.batch, generator=g) ** 3 * n).long() for n in sizes], dim=1)
               for _ in range(args.steps)]
    print(f"{args.tables} tables x {args.rows} rows, batch {args.batch}, {args.steps} steps per run, "
          f"{args.rounds} rounds interleaved over loop threads {args.threads}; {os.cpu_count()} cores")
    for dim in args.dims:
        for precision, share in (("int8", 0.05), ("int4", 0.01)):
            config = EmbeddingConfig(sizes, dim=dim, precision=precision, cache_size=share, lr=0.01, seed=1)
            coll = CachedEmbeddingBagCollection(config)
            for ids in batches:  # warm-up: the cache fills
                out = coll(ids)
                out.backward(torch.ones_like(out))
            times: dict[int, list[dict[str, float]]] = {t: [] for t in args.threads}
            for r in range(args.rounds):
                for threads in (args.threads if r % 2 == 0 else args.threads[::-1]):
                    _native.set_threads(threads)
                    times[threads].append(timed_steps(coll, batches))
            loops: dict[int, list[dict[str, float]]] = {t: [] for t in args.threads}
            for r in range(args.rounds):
                for threads in (args.threads if r % 2 == 0 else args.threads[::-1]):
                    _native.set_threads(threads)
                    loops[threads].append(loop_seconds(coll, batches[0], args.repeats))
            _native.set_threads(1)
            base = statistics.median(x["step"] for x in times[args.threads[0]])
            for threads in args.threads:
                runs = times[threads]
                parts = []
                for key in ("step", *PHASES):
                    t = [x[key] * 1e3 for x in runs]
                    parts.append(f"{key} {statistics.median(t):.2f} ms [{min(t):.2f}-{max(t):.2f}]")
                for key in ("gather", "scatter"):
                    t = [x[key] * 1e3 for x in loops[threads]]
                    parts.append(f"{key} alone {statistics.median(t):.2f} ms [{min(t):.2f}-{max(t):.2f}]")
                speed = base / statistics.median(x["step"] for x in runs)
                print(f"dim {dim:3d} {precision} + {share:.0%}, {threads} thread(s): {'; '.join(parts)}; "
                      f"step speed {speed:.2f}x of {args.threads[0]}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
