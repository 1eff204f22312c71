"""The optimizer update of an Adagrad / row-wise Adagrad training step, compiled against torch, interleaved.

Each round trains the same skewed batches once with the compiled update and once with the torch update
(the compiled loops of the row operations, `slipcache.embedding.kernels`, switched off; the cache's
stay compiled in both), alternating which goes first, and records the "backward" phase of the step clock (the
whole optimizer update: per-row sums, state and weights, finite check). Prints per-variant medians with
min-max over the rounds and the load average beside them. Run from the repository root:

    python -m benchmarks.adagrad_step --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types

import torch

from slipcache import _native
from slipcache.embedding import kernels
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig


def backward_seconds(config: EmbeddingConfig, batches: list[torch.Tensor], compiled: bool) -> float:
    """Seconds per step spent in the optimizer update over `batches` (after one warm-up batch)."""
    original = kernels._native
    if not compiled:  # the row operations see no compiled library; the cache keeps it
        kernels._native = types.SimpleNamespace(usable=lambda *tensors: False)
    try:
        coll = CachedEmbeddingBagCollection(config)
        out = coll(batches[0])
        out.backward(torch.ones_like(out))
        coll.clock.enable()
        for ids in batches[1:]:
            out = coll(ids)
            out.backward(torch.ones_like(out))
        return coll.clock.seconds["backward"] / (len(batches) - 1)
    finally:
        kernels._native = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=200_000, help="rows per table (8 tables)")
    parser.add_argument("--cache-share", type=float, default=0.05)
    args = parser.parse_args()
    if _native.native() is None:
        raise SystemExit("no compiled library (no C compiler, or SLIPCACHE_NATIVE=0): nothing to compare")
    g = torch.Generator().manual_seed(0)
    sizes = [args.rows] * 8
    batches = [torch.stack([(torch.rand(args.batch, generator=g) ** 3 * n).long() for n in sizes], dim=1)
               for _ in range(args.steps + 1)]
    print(f"threads {torch.get_num_threads()}, {len(sizes)} tables x {args.rows} rows, batch {args.batch}, "
          f"fp32 cache {args.cache_share:.0%}, {args.steps} steps per run, {args.rounds} rounds interleaved")
    for optimizer in ("adagrad", "rowwise_adagrad"):
        for dim in (16, 64):
            config = EmbeddingConfig(sizes, dim=dim, precision="fp32", cache_rows=int(sum(sizes) * args.cache_share),
                                     optimizer=optimizer, lr=0.05, seed=1)
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for compiled in ((True, False) if r % 2 == 0 else (False, True)):
                    times[compiled].append(backward_seconds(config, batches, compiled))
            parts = []
            for compiled in (False, True):
                t = times[compiled]
                parts.append(f"{'compiled' if compiled else 'torch'} {statistics.median(t) * 1e3:.2f} ms "
                             f"[{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}]")
            ratio = statistics.median(times[False]) / statistics.median(times[True])
            print(f"{optimizer:16s} dim {dim:3d}: update per step: {'; '.join(parts)}; torch/compiled {ratio:.2f}x; "
                  f"load {os.getloadavg()[0]:.2f} at {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
