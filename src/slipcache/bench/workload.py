"""The workload of `slipcache bench embedding`: Criteo-Kaggle-shaped tables (`data.kaggle`) and
power-law id batches with their gradients, the same for every implementation (also `bench cache`'s trace).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


def zipf_cdf(num_rows: int, exponent: float) -> np.ndarray:
    """Cumulative probability of ranks 1..n under p(k) ~ k^-exponent (float64, last entry 1)."""
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return cdf


@dataclass
class Workload:
    """Id batches generated up front (so sampling is never timed) and what they look like."""

    table_sizes: list[int]
    batch_size: int
    warmup_steps: int  # for configurations without a cache
    timed_steps: int
    exponent: float
    seed: int
    cache_warmup_steps: int
    batches: Tensor  # int64 [max(warmup, cache warmup) + timed + profile, B, T]
    # Each table's most probable rows, hottest first, as many as are among the `hot_rows` most probable rows
    # of all tables (make_workload's argument; at least one per table; none when 0), for `prefill_batches`.
    hot_rows: list[Tensor] = field(default_factory=list, repr=False)
    zipf_norms: list[float] = field(default_factory=list, repr=False)  # sum_k k^-exponent of each table
    lookup_share_top_1pct: float = 0.0
    lookup_share_top_5pct: float = 0.0
    generate_s: float = 0.0
    _grads: dict[int, Tensor] = field(default_factory=dict, repr=False)
    # Batches after the timed ones, for the phase profile only: never timed, so the profile sees rows the
    # cache has not been given by a replay of the timed batches (which it would mostly hit).
    profile_steps: int = 0

    @property
    def first_timed(self) -> int:
        """Index of the first timed batch: after the longer of the two warm-ups."""
        return max(self.warmup_steps, self.cache_warmup_steps)

    @property
    def num_rows(self) -> int:
        return sum(self.table_sizes)

    def grad(self, dim: int) -> Tensor:
        """The output gradient used at every step at this dim: the same for every implementation."""
        if dim not in self._grads:
            gen = torch.Generator().manual_seed(self.seed + 7919 * dim)
            shape = (self.batch_size, len(self.table_sizes), dim)
            self._grads[dim] = torch.randn(shape, generator=gen) * 0.01
        return self._grads[dim]

    def describe(self) -> dict[str, Any]:
        return {
            "tables": len(self.table_sizes),
            "table_sizes": self.table_sizes,
            "rows": self.num_rows,
            "batch_size": self.batch_size,
            "warmup_steps": self.warmup_steps,
            "cache_warmup_steps": self.cache_warmup_steps,
            "timed_steps": self.timed_steps,
            "id_distribution": f"zipf({self.exponent}) over a random permutation of each table's rows",
            "prefill": bool(self.hot_rows),
            "lookup_share_top_1pct_rows": self.lookup_share_top_1pct,
            "lookup_share_top_5pct_rows": self.lookup_share_top_5pct,
            "seed": self.seed,
        }


def make_workload(
    table_sizes: list[int],
    batch_size: int = 2048,
    warmup_steps: int = 10,
    timed_steps: int = 30,
    exponent: float = 1.05,
    seed: int = 0,
    cache_warmup_steps: int | None = None,
    hot_rows: int = 0,
    profile_steps: int = 0,
) -> Workload:
    """Power-law ids per table by inverse-CDF sampling, ranks mapped to rows by a random permutation.

    Why the permutation: hot rows of a real table are scattered, not rows 0..k; a cache or a prefetcher must
    not get adjacency for free. The `hot_rows` most probable rows of all tables are kept for a cache prefill.
    """
    start = time.perf_counter()
    if cache_warmup_steps is None:
        cache_warmup_steps = warmup_steps
    norms = [float(np.sum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)) for n in table_sizes]
    hot_counts = [max(1, c) for c in hottest_counts(table_sizes, norms, exponent, hot_rows)]
    hot: list[Tensor] = []
    rng = np.random.default_rng(seed)
    steps = max(warmup_steps, cache_warmup_steps) + timed_steps + profile_steps
    count = steps * batch_size
    ids = np.empty((count, len(table_sizes)), dtype=np.int64)
    share1 = share5 = 0.0
    for t, n in enumerate(table_sizes):
        cdf = zipf_cdf(n, exponent)
        share1 += float(cdf[max(1, n // 100) - 1])
        share5 += float(cdf[max(1, n // 20) - 1])
        ranks = np.searchsorted(cdf, rng.random(count), side="right")
        np.minimum(ranks, n - 1, out=ranks)
        perm = rng.permutation(n)
        ids[:, t] = perm[ranks]
        if hot_rows > 0:
            hot.append(torch.from_numpy(perm[: hot_counts[t]].copy()))
        del cdf, perm, ranks
    batches = torch.from_numpy(ids).view(steps, batch_size, len(table_sizes))
    return Workload(
        table_sizes=list(table_sizes),
        batch_size=batch_size,
        warmup_steps=warmup_steps,
        cache_warmup_steps=cache_warmup_steps,
        timed_steps=timed_steps,
        exponent=exponent,
        seed=seed,
        batches=batches,
        hot_rows=hot,
        zipf_norms=norms,
        lookup_share_top_1pct=share1 / len(table_sizes),
        lookup_share_top_5pct=share5 / len(table_sizes),
        generate_s=time.perf_counter() - start,
        profile_steps=profile_steps,
    )




def hottest_counts(table_sizes: list[int], norms: list[float], exponent: float, total: int) -> list[int]:
    """How many top ranks of each table are among the `total` most probable rows of all tables.

    Rank k of table t has probability k^-exponent / norms[t] per lookup of t, and every table is looked up
    once per sample, so these are the rows a cache of `total` rows holds in steady state under LFU (and,
    near enough, LRU). The threshold probability is found by bisection on its logarithm.
    """
    if total <= 0:
        return [0] * len(table_sizes)
    if total >= sum(table_sizes):
        return list(table_sizes)

    def counts(log_threshold: float) -> list[int]:
        # k^-s / H >= p  <=>  log k <= -(log p + log H) / s
        return [
            min(n, int(math.exp(min(50.0, -(log_threshold + math.log(h)) / exponent)) + 1e-9))
            for n, h in zip(table_sizes, norms, strict=True)
        ]

    low = -exponent * math.log(max(table_sizes)) - math.log(max(norms)) - 1.0  # every row above it
    high = 0.0  # no row above it
    for _ in range(100):
        middle = (low + high) / 2
        if sum(counts(middle)) > total:
            low = middle
        else:
            high = middle
    return counts(high)


def prefill_batches(work: Workload, capacity: int, rows_per_batch: int) -> list[Tensor]:
    """Id batches ([<= rows_per_batch, tables]) that bring the `capacity` most probable rows into a cache.

    Each table's rows come coldest first and end together in the last batch, so under LRU the hottest are
    the most recently used when the warm-up starts; a table with fewer rows than the longest repeats its
    hottest one before them. Deterministic: the same rows for every configuration of one workload.
    """
    available = sum(len(h) for h in work.hot_rows)
    counts = hottest_counts(work.table_sizes, work.zipf_norms, work.exponent, min(capacity, available))
    counts = [max(1, min(c, len(h))) for c, h in zip(counts, work.hot_rows, strict=True)]
    length = max(counts)
    ids = torch.empty(length, len(counts), dtype=torch.int64)
    for t, count in enumerate(counts):
        ids[:, t] = work.hot_rows[t][0]
        ids[length - count :, t] = work.hot_rows[t][:count].flip(0)
    return list(ids.split(max(1, rows_per_batch)))
