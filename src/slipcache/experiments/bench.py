"""`slipcache bench embedding`: our cached mixed-precision embeddings side by side with the peers.

One process, one Criteo-Kaggle-shaped workload (26 tables, power-law ids, batch 2048), the same id batches and
gradients for every implementation, forward + backward + update per step. Each configuration is built, warmed
up, timed and freed before the next, so a run fits in the machine's memory; configurations whose estimated
footprint exceeds the memory budget are reported as skipped instead of being allocated.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from slipcache.errors import SlipcacheError
from slipcache.experiments.machine import describe_machine, physical_memory_bytes, probe_memory

__all__ = [
    "CONFIGS",
    "KAGGLE_TABLE_SIZES",
    "BenchConfig",
    "Workload",
    "add_bench_arguments",
    "make_workload",
    "run_bench",
    "scaled_table_sizes",
]

# Criteo Kaggle categorical cardinalities, C1..C26 (33,762,577 rows in all).
KAGGLE_TABLE_SIZES: list[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip

DEFAULT_DIMS = (16, 64, 128)
GB = 1e9


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark, before it is measured at a given dim."""

    name: str
    impl: str  # slipcache | torch | fbgemm
    precision: str
    cache_fraction: float = 0.0
    policy: str = "none"


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("torch-fp32", "torch", "fp32"),
    BenchConfig("fbgemm-fp32", "fbgemm", "fp32"),
    BenchConfig("fbgemm-fp16", "fbgemm", "fp16"),
    BenchConfig("slipcache-fp32", "slipcache", "fp32"),
    BenchConfig("slipcache-fp16", "slipcache", "fp16"),
    BenchConfig("slipcache-int8-lru5", "slipcache", "int8", 0.05, "lru"),
    BenchConfig("slipcache-int8-lfu5", "slipcache", "int8", 0.05, "lfu"),
    BenchConfig("slipcache-int8", "slipcache", "int8"),
    BenchConfig("slipcache-int4-lru1", "slipcache", "int4", 0.01, "lru"),
)

# (full, quick) run shapes: quick shrinks the big tables and the step counts.
# Cached configurations warm up longer: a 5 % cache of the Kaggle tables holds 1.7 M rows and only fills
# after some 10 M lookups; timing it before that would report a cold-start hit rate.
# Each configuration is timed for at least `min_seconds` (cycling over the timed batches if it runs through
# them), in each of `rounds` rounds that visit every configuration in turn, so a neighbour's burst of load
# hits one round of every configuration rather than every round of one.
FULL = {"scale": 1.0, "warmup": 20, "cache_warmup": 150, "steps": 200, "min_seconds": 2.0, "rounds": 3}
QUICK = {"scale": 0.01, "warmup": 3, "cache_warmup": 20, "steps": 8, "min_seconds": 0.25, "rounds": 3}
# Phases of our step (PhaseClock) as the profile reports them; Python overhead is the rest of the step.
PHASE_NAMES = {
    "lookup": "cache lookup",
    "fill": "miss fill + dequantize",
    "evict": "eviction + quantize",
    "forward": "forward gather/pool",
    "backward": "backward scatter/update",
}
PROFILE_STEPS = 20


# --------------------------------------------------------------------------------------------- workload


def scaled_table_sizes(scale: float, min_rows: int = 10_000, sizes: list[int] | None = None) -> list[int]:
    """Shrink the big tables by `scale`; tables at or under `min_rows` keep their size.

    Why a floor: scaling a 24-row table by 0.01 would leave a table of one row, a different workload.
    """
    sizes = KAGGLE_TABLE_SIZES if sizes is None else sizes
    if scale >= 1.0:
        return list(sizes)
    return [min(n, max(math.ceil(n * scale), min_rows, 1)) for n in sizes]


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
    batches: Tensor  # int64 [max(warmup, cache warmup) + timed, B, T]
    lookup_share_top_1pct: float = 0.0
    lookup_share_top_5pct: float = 0.0
    generate_s: float = 0.0
    _grads: dict[int, Tensor] = field(default_factory=dict, repr=False)

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
) -> Workload:
    """Power-law ids per table by inverse-CDF sampling, ranks mapped to rows by a random permutation.

    Why the permutation: hot rows of a real table are scattered, not rows 0..k; a cache or a prefetcher must
    not get adjacency for free.
    """
    start = time.perf_counter()
    if cache_warmup_steps is None:
        cache_warmup_steps = warmup_steps
    rng = np.random.default_rng(seed)
    steps = max(warmup_steps, cache_warmup_steps) + timed_steps
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
        lookup_share_top_1pct=share1 / len(table_sizes),
        lookup_share_top_5pct=share5 / len(table_sizes),
        generate_s=time.perf_counter() - start,
    )


# ------------------------------------------------------------------------------------------- runners


def _fill_uniform(flat: Tensor, seed: int, bound: float = 0.01) -> None:
    """Fill a (possibly huge) tensor with uniform values by tiling one random block.

    Why: `uniform_` runs at well under 1 GB/s on two cores, so initializing 9 GB of fp32 tables would take
    longer than the measurement; a copy runs at memory speed. The values only need to be touched and
    plausible, not independent, for a throughput benchmark.
    """
    flat = flat.view(-1)
    gen = torch.Generator().manual_seed(seed)
    block_len = min(flat.numel(), 1 << 22)
    if block_len == 0:
        return
    block = (torch.rand(block_len, generator=gen) * (2 * bound) - bound).to(flat.dtype)
    for start in range(0, flat.numel(), block_len):
        end = min(start + block_len, flat.numel())
        flat[start:end].copy_(block[: end - start])


@dataclass
class Built:
    """A constructed implementation: how to run one step and what it holds."""

    step: Callable[[Tensor, Tensor], None]  # (ids [B, T], grad [B, T, D])
    bytes: int
    fp32_bytes: int
    stats: Callable[[], dict[str, Any]] | None = None
    reset_stats: Callable[[], None] | None = None
    clock: Any = None  # our PhaseClock, for the phase profile
    owner: Any = None  # the module; dropped to free memory


class _TorchBags(nn.Module):
    """26 `nn.EmbeddingBag` (sum, sparse gradients) and `torch.optim.SGD`: the DLRM reference setup."""

    def __init__(self, table_sizes: list[int], dim: int, lr: float, seed: int, batch_size: int) -> None:
        super().__init__()
        bags = []
        for t, n in enumerate(table_sizes):
            weight = torch.empty(n, dim)
            _fill_uniform(weight, seed + t)
            bags.append(nn.EmbeddingBag(n, dim, mode="sum", sparse=True, _weight=weight))
        self.bags = nn.ModuleList(bags)
        self.optimizer = torch.optim.SGD(self.bags.parameters(), lr=lr)
        self.offsets = torch.arange(batch_size, dtype=torch.long)

    def step(self, ids: Tensor, grad: Tensor) -> None:
        cols = ids.t().contiguous()
        offsets = self.offsets[: ids.shape[0]]
        out = torch.stack([bag(cols[t], offsets) for t, bag in enumerate(self.bags)], dim=1)
        out.backward(grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _build_torch(sizes: list[int], dim: int, lr: float, seed: int, batch_size: int) -> Built:
    bags = _TorchBags(sizes, dim, lr, seed, batch_size)
    nbytes = sum(b.weight.numel() * b.weight.element_size() for b in bags.bags)
    return Built(step=bags.step, bytes=nbytes, fp32_bytes=sum(sizes) * dim * 4, owner=bags)


def fbgemm_available() -> str | None:
    """None when FBGEMM's table-batched embedding imports; else the reason it does not."""
    try:
        with warnings.catch_warnings():  # it warns about optional SSD/GPU kernels the CPU build lacks
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
                SplitTableBatchedEmbeddingBagsCodegen,
            )
    except Exception as exc:  # ImportError, or OSError/RuntimeError from mismatched native libraries
        return f"{type(exc).__name__}: {exc}"
    return None


def _build_fbgemm(sizes: list[int], dim: int, precision: str, lr: float, seed: int) -> Built:
    """FBGEMM TBE on the host: CPU compute, exact SGD, fp32 or fp16 weights (it has no cache on CPU)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    weights_precision = {"fp32": SparseType.FP32, "fp16": SparseType.FP16}[precision]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in sizes],
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=lr,
        weights_precision=weights_precision,
        pooling_mode=PoolingMode.SUM,
        device="cpu",
    )
    with torch.no_grad():
        _fill_uniform(tbe.weights_host, seed)  # FBGEMM zero-fills lazily; touch every page like the others
    num_tables = len(sizes)
    offsets_cache: dict[int, Tensor] = {}

    def step(ids: Tensor, grad: Tensor) -> None:
        batch = ids.shape[0]
        offsets = offsets_cache.get(batch)
        if offsets is None:
            offsets = offsets_cache[batch] = torch.arange(num_tables * batch + 1, dtype=torch.long)
        out = tbe(ids.t().contiguous().view(-1), offsets)  # table-major indices, one id per bag
        out.backward(grad.reshape(batch, -1))

    nbytes = tbe.weights_host.numel() * tbe.weights_host.element_size()
    return Built(step=step, bytes=nbytes, fp32_bytes=sum(sizes) * dim * 4, owner=tbe)


def _slipcache_module() -> Any:
    """Import our embedding module lazily: the benchmark must still run the peers if it is broken."""
    from slipcache.embedding import collection as embedding

    return embedding


def _slipcache_config(cfg: BenchConfig, sizes: list[int], dim: int, lr: float, seed: int) -> Any:
    embedding = _slipcache_module()
    return embedding.EmbeddingConfig(
        table_sizes=list(sizes),
        dim=dim,
        precision=cfg.precision,
        cache_size=cfg.cache_fraction,
        policy=cfg.policy,
        rounding="stochastic",
        optimizer="sgd",
        lr=lr,
        seed=seed,
    )


def slipcache_static_estimate(cfg: BenchConfig, sizes: list[int], dim: int) -> dict[str, Any]:
    """The module's memory report for this configuration, without allocating it."""
    embedding = _slipcache_module()
    return embedding.CachedEmbeddingBagCollection.estimate_memory(_slipcache_config(cfg, sizes, dim, 0.1, 0))




def _build_slipcache(
    cfg: BenchConfig, sizes: list[int], dim: int, lr: float, seed: int
) -> Built:
    embedding = _slipcache_module()
    coll = embedding.CachedEmbeddingBagCollection(_slipcache_config(cfg, sizes, dim, lr, seed))
    coll.train()
    report = coll.memory_report()

    def step(ids: Tensor, grad: Tensor) -> None:
        out = coll(ids)
        out.backward(grad)

    return Built(
        step=step,
        bytes=int(report["total_bytes"]),
        fp32_bytes=int(report["fp32_bytes"]),
        stats=coll.stats,
        reset_stats=coll.reset_stats,
        clock=coll.clock,
        owner=coll,
    )


def estimate_bytes(cfg: BenchConfig, sizes: list[int], dim: int) -> tuple[int, dict[str, Any] | None]:
    """(bytes to compare with the budget, the module's static report for ours if any)."""
    rows = sum(sizes)
    if cfg.impl == "torch":
        return rows * dim * 4, None
    if cfg.impl == "fbgemm":
        return rows * dim * (4 if cfg.precision == "fp32" else 2), None
    static = slipcache_static_estimate(cfg, sizes, dim)
    # The static report is the steady state; add initialization temporaries (one chunk of fp32 rows and
    # what rounding it allocates, the module's chunk is 2^20 rows).
    return int(static["total_bytes"]) + 4 * min(rows, 1 << 20) * dim * 4, static


# ----------------------------------------------------------------------------------------- measuring


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _row(cfg: BenchConfig, dim: int) -> dict[str, Any]:
    return {
        "name": cfg.name,
        "impl": cfg.impl,
        "precision": cfg.precision,
        "cache_fraction": cfg.cache_fraction,
        "policy": cfg.policy,
        "dim": dim,
        "samples_per_s": None,
        "ratio_vs_fbgemm_fp32": None,
        "bytes": None,
        "memory_ratio": None,
        "hit_rate": None,
        "bytes_moved_per_sample": None,
        "status": "ok",
        "init_s": None,
        "timed_s": None,
        "samples_per_s_median_step": None,
        "load_avg_1m": None,
        "timed_steps": None,
        "phase_us_per_sample": None,
    }


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def measure(
    cfg: BenchConfig,
    dim: int,
    work: Workload,
    budget_bytes: int,
    lr: float = 0.1,
    min_seconds: float = 0.0,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """Build, warm up, time and free one configuration; never raises for a failing implementation.

    Timing runs the workload's timed batches (cycling over them) until both `timed_steps` steps and
    `min_seconds` have passed; then, for ours, `profile_steps` more steps with the phase clock on.
    """
    row = _row(cfg, dim)
    sizes = work.table_sizes
    if cfg.impl == "fbgemm":
        reason = fbgemm_available()
        if reason is not None:
            row["status"] = "not installed"
            row["error"] = reason
            return row
        if dim % 4:
            row["status"] = "skipped: FBGEMM needs dim to be a multiple of 4"
            return row
    if cfg.impl == "slipcache":
        try:
            _slipcache_module()
        except Exception as exc:
            row["status"] = f"skipped: slipcache.embedding.collection unavailable ({type(exc).__name__}: {exc})"
            return row
    need, static = estimate_bytes(cfg, sizes, dim)
    if cfg.impl != "slipcache":
        row["bytes"] = need
        row["memory_ratio"] = sum(sizes) * dim * 4 / need
    else:
        row["bytes"] = int(static["total_bytes"])
        row["memory_ratio"] = _finite(static.get("memory_ratio"))
    if need > budget_bytes:
        row["status"] = f"skipped: needs {need / GB:.1f} GB > budget {budget_bytes / GB:.1f} GB"
        return row

    built: Built | None = None
    try:
        start = time.perf_counter()
        if cfg.impl == "torch":
            built = _build_torch(sizes, dim, lr, work.seed, work.batch_size)
        elif cfg.impl == "fbgemm":
            built = _build_fbgemm(sizes, dim, cfg.precision, lr, work.seed)
        else:
            built = _build_slipcache(cfg, sizes, dim, lr, work.seed)
        row["init_s"] = time.perf_counter() - start
        row["bytes"] = built.bytes
        row["memory_ratio"] = built.fp32_bytes / built.bytes if built.bytes else None

        grad = work.grad(dim)
        batches = work.batches
        # Every configuration times the same batches; its warm-up is the batches just before them.
        first = work.first_timed
        warm = work.cache_warmup_steps if cfg.cache_fraction else work.warmup_steps
        for i in range(first - warm, first):
            built.step(batches[i], grad)
        if built.reset_stats is not None:
            built.reset_stats()
        row["load_avg_1m"] = _load_average()
        step_s: list[float] = []
        start = last = time.perf_counter()
        steps = 0
        while steps < work.timed_steps or last - start < min_seconds:
            built.step(batches[first + steps % work.timed_steps], grad)
            steps += 1
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
        elapsed = last - start
        samples = steps * work.batch_size
        row["timed_steps"] = steps
        row["timed_s"] = elapsed
        row["samples_per_s"] = samples / elapsed if elapsed > 0 else None
        # Robust to a neighbour stealing the cores for part of the run: the typical step, not the mean.
        median = float(np.median(step_s))
        row["samples_per_s_median_step"] = work.batch_size / median if median > 0 else None
        if built.stats is not None:
            stats = built.stats()
            row["hit_rate"] = _finite(stats.get("hit_rate"))
            moved = (stats.get("bytes_in") or 0) + (stats.get("bytes_out") or 0)
            row["bytes_moved_per_sample"] = moved / samples if samples else None
            for key in ("lookups", "misses", "rows_in", "overflow_rows", "evictions"):
                row[key] = stats.get(key)
        if built.clock is not None and profile_steps > 0:
            row["phase_us_per_sample"] = _profile(built, work, grad, first + steps, profile_steps)
    except MemoryError:
        row["status"] = "skipped: out of memory"
    except (KeyboardInterrupt, SlipcacheError):
        raise
    except Exception as exc:  # an implementation failing is a result to report, not a reason to stop
        row["status"] = f"skipped: failed ({type(exc).__name__}: {exc})"
    finally:
        del built
        gc.collect()
    return row


def _profile(built: Built, work: Workload, grad: Tensor, position: int, steps: int) -> dict[str, float]:
    """µs per sample in each phase of our step over `steps` steps; the rest of the step is Python overhead
    (validation, autograd, counters, the calls themselves)."""
    clock = built.clock
    clock.enable()
    start = time.perf_counter()
    for i in range(steps):
        built.step(work.batches[work.first_timed + (position + i) % work.timed_steps], grad)
    total = time.perf_counter() - start
    seconds = dict(clock.seconds)
    clock.disable()
    per_sample = 1e6 / (steps * work.batch_size)
    out = {label: seconds[phase] * per_sample for phase, label in PHASE_NAMES.items()}
    out["Python overhead"] = max(0.0, total * per_sample - sum(out.values()))
    out["total"] = total * per_sample
    return out


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of one configuration: median samples/s with its min and max.

    Why the median: on a shared machine a round can lose its cores to a neighbour; the median of three
    ignores one such round, and the min-max spread shows that it happened.
    """
    ok = [r for r in rounds if r["status"] == "ok" and r["samples_per_s"]]
    row = dict(ok[-1] if ok else rounds[0])
    speeds = [r["samples_per_s"] for r in ok]
    row["rounds"] = len(rounds)
    row["samples_per_s_rounds"] = speeds
    row["load_avg_rounds"] = [r.get("load_avg_1m") for r in rounds]
    if speeds:
        row["samples_per_s"] = float(np.median(speeds))
        row["samples_per_s_min"], row["samples_per_s_max"] = min(speeds), max(speeds)
    if len(ok) < len(rounds) and ok:
        row["status"] = f"ok in {len(ok)} of {len(rounds)} rounds"
    profiles = [r["phase_us_per_sample"] for r in ok if r.get("phase_us_per_sample")]
    if profiles:
        row["phase_us_per_sample"] = {k: float(np.median([p[k] for p in profiles])) for k in profiles[0]}
    return row


def _attach_ratios(rows: list[dict[str, Any]]) -> None:
    """samples/s over FBGEMM fp32 at the same dim (None where that row did not run)."""
    base = {
        r["dim"]: r["samples_per_s"]
        for r in rows
        if r["name"] == "fbgemm-fp32" and r["status"] == "ok" and r["samples_per_s"]
    }
    for r in rows:
        ref = base.get(r["dim"])
        r["ratio_vs_fbgemm_fp32"] = r["samples_per_s"] / ref if ref and r["samples_per_s"] else None


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The memory and throughput targets, each PASS, MISS or N/A (not measured in this run)."""
    by = {(r["name"], r["dim"]): r for r in rows}
    out: list[dict[str, Any]] = []

    def add(target: str, value: float | None, threshold: float, unit: str) -> None:
        result = "N/A" if value is None else ("PASS" if value >= threshold else "MISS")
        out.append({"target": target, "value": value, "threshold": threshold, "unit": unit, "result": result})

    for name in ("slipcache-int8-lru5", "slipcache-int8-lfu5"):
        r = by.get((name, 64))
        add(f"{name} memory ratio at dim 64 >= 3.0x", r and r["memory_ratio"], 3.0, "x")
    r = by.get(("slipcache-int4-lru1", 128))
    add("slipcache-int4-lru1 memory ratio at dim 128 >= 7.0x", r and r["memory_ratio"], 7.0, "x")
    # Throughput against FBGEMM fp32 at the same dim (issue 13's goals).
    dims = sorted({r["dim"] for r in rows})
    for dim in dims:
        for name, threshold in (("slipcache-int8-lru5", 1.0), ("slipcache-fp32", 1.0), ("slipcache-int4-lru1", 0.8)):
            r = by.get((name, dim))
            if r is None:
                continue
            add(
                f"{name} samples/s at dim {dim} >= {threshold:g}x FBGEMM fp32",
                r["ratio_vs_fbgemm_fp32"],
                threshold,
                "x fbgemm fp32",
            )
    return out


# ------------------------------------------------------------------------------------------ printing


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The result table, plain (for the terminal) or markdown (bench.md)."""
    header = [
        "dim",
        "name",
        "samples/s",
        "min-max",
        "x fbgemm fp32",
        "GB",
        "mem ratio",
        "hit rate",
        "B moved/sample",
        "status",
    ]
    lines = []
    for r in rows:
        lines.append(
            [
                str(r["dim"]),
                r["name"],
                _fmt(r["samples_per_s"], ",.0f"),
                _spread(r),
                _fmt(r["ratio_vs_fbgemm_fp32"], ".2f"),
                _fmt(None if r["bytes"] is None else r["bytes"] / GB, ".3f"),
                _fmt(r["memory_ratio"], ".2f"),
                _fmt(r["hit_rate"], ".3f"),
                _fmt(r["bytes_moved_per_sample"], ",.0f"),
                r["status"],
            ]
        )
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(cells) + " |" for cells in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(header)]

    def fmt_line(cells: list[str]) -> str:
        numeric = range(2, 9)  # right-align the number columns
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt_line(header), fmt_line(["-" * w for w in widths])] + [fmt_line(c) for c in lines])


def _spread(r: dict[str, Any]) -> str:
    if r.get("samples_per_s_min") is None:
        return "-"
    return f"{r['samples_per_s_min'] / 1e3:,.0f}k-{r['samples_per_s_max'] / 1e3:,.0f}k"


def format_profile(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """µs per sample in each phase of our step, one line per configuration and dim."""
    profiled = [r for r in rows if r.get("phase_us_per_sample")]
    if not profiled:
        return ""
    phases = list(profiled[0]["phase_us_per_sample"])
    header = ["dim", "name", *phases]
    lines = [
        [str(r["dim"]), r["name"], *(f"{r['phase_us_per_sample'][p]:.3f}" for p in phases)] for r in profiled
    ]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    return "\n".join(
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        for cells in [header, *lines]
    )


def format_targets(targets: list[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        value = (
            "not measured"
            if t["value"] is None
            else f"{t['value']:.2f}{'x' if t['unit'] == 'x' else ' ' + t['unit']}"
        )
        lines.append(f"{t['result']:4s}  {t['target']}: {value}")
    return "\n".join(lines)


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    probes = result.get("probes") or {}
    w = result["workload"]
    parts = [
        "# slipcache bench embedding",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- machine: {m['cpu_model']}, {m['logical_cores']} cores, torch threads {m['torch_threads']}, load average "
        f"{_fmt(m.get('load_avg_1m_start'), '.1f')} at start, "
        f"{(m['memory_total_bytes'] or 0) / GB:.1f} GB RAM; torch {m['torch']}, numpy {m['numpy']}, "
        f"fbgemm_gpu {m['fbgemm_gpu'] or 'not installed'}",
    ]
    if probes:
        copy, gather = probes["sequential_copy"], probes["random_gather"]
        parts.append(
            f"- memory probes: sequential copy {copy['copy_gb_s']:.1f} GB/s copied; random 64-byte row gather "
            f"from {gather['table_bytes'] / GB:.1f} GB: {gather['rows_per_s'] / 1e6:.1f} M rows/s"
        )
    parts += [
        f"- workload: {w['tables']} tables, {w['rows']:,} rows, batch {w['batch_size']}, {w['id_distribution']}; "
        f"top 1% / 5% of rows take {w['lookup_share_top_1pct_rows']:.0%} / {w['lookup_share_top_5pct_rows']:.0%} "
        f"of lookups; {w['warmup_steps']} warm-up steps ({w['cache_warmup_steps']} with a cache) + "
        f"{w['timed_steps']} timed steps of forward + backward + update",
        f"- memory budget: {result['memory_budget_gb']:.1f} GB",
        "",
        format_table(result["rows"], markdown=True),
        "",
        f"`samples/s` is the median of {result['rounds']} interleaved rounds (each timed for at least "
        f"{result['min_seconds']:g} s), `min-max` their range.",
        "",
        "## Phase profile (µs per sample)",
        "",
        format_profile(result["rows"], markdown=True) or "(not profiled)",
        "",
        "`mem ratio` = fp32 bytes / bytes held; `hit rate` and `B moved/sample` (cache <-> storage traffic) "
        "cover the timed steps only.",
        "",
        "## Targets",
        "",
        *[f"- {line}" for line in format_targets(result["targets"]).splitlines()],
        "",
        *[f"**Warning:** {w}\n" for w in result.get("warnings", [])],
    ]
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------ CLI


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `slipcache bench`: one sub-command per target."""
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    add_embedding_arguments(
        targets.add_parser("embedding", help="embedding step throughput: ours against torch and FBGEMM")
    )
    from slipcache.experiments.bench_cache import add_cache_arguments

    add_cache_arguments(
        targets.add_parser("cache", help="cache hit rate against size: LRU, LFU, lookahead and offline OPT")
    )
    from slipcache.experiments.bench_train import add_train_bench_arguments

    add_train_bench_arguments(
        targets.add_parser("train", help="the DLRM trainer (fp32, INT8 + 5 %% cache) against TorchRec + FBGEMM")
    )


def add_embedding_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `slipcache bench embedding`."""
    parser.add_argument("--out", required=True, help="directory for bench.json and bench.md")
    parser.add_argument(
        "--quick", action="store_true", help="big tables x0.01 and fewer steps (about a minute)"
    )
    parser.add_argument(
        "--dims", nargs="+", default=None, help="embedding dims, e.g. 16 64 or 16,64 (default 16 64 128)"
    )
    parser.add_argument("--configs", default=None, help="comma-separated configuration names (default all)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="untimed steps before timing, configurations without a cache",
    )
    parser.add_argument(
        "--cache-warmup-steps",
        type=int,
        default=None,
        help="untimed steps before timing configurations with a cache, so it is full (default 150, quick 20)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="skip configurations estimated above this (default 60%% of physical memory)",
    )
    parser.add_argument("--zipf", type=float, default=1.05, help="power-law exponent of the ids")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice, one per core); 1 is steadier on a busy machine",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds over all configurations, interleaved (default 3)"
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="timed section per configuration and round, at least (default 2; quick 0.25)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=PROFILE_STEPS,
        help=f"steps of ours timed phase by phase after the last round (default {PROFILE_STEPS}; 0: none)",
    )
    # Hidden knobs for tests and experiments.
    parser.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--min-rows", type=int, default=10_000, help=argparse.SUPPRESS)
    parser.add_argument("--skip-probes", action="store_true", help=argparse.SUPPRESS)


def _parse_dims(values: list[str] | None) -> list[int]:
    if not values:
        return list(DEFAULT_DIMS)
    dims: list[int] = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                dim = int(part)
            except ValueError:
                raise SlipcacheError(f"--dims: not an integer: {part!r}") from None
            if dim <= 0:
                raise SlipcacheError(f"--dims: dims must be positive, got {dim}")
            if dim not in dims:
                dims.append(dim)
    if not dims:
        raise SlipcacheError("--dims: no dims given")
    return dims


def _parse_configs(value: str | None) -> list[BenchConfig]:
    if not value:
        return list(CONFIGS)
    known = {c.name: c for c in CONFIGS}
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SlipcacheError(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[n] for n in names]


def _command(args: argparse.Namespace, dims: list[int], configs: list[BenchConfig]) -> str:
    """The effective command line, rebuilt from the parsed options (argv differs under tests and -m)."""
    parts = ["slipcache", "bench", args.target]
    if args.quick:
        parts.append("--quick")
    parts += ["--dims", ",".join(map(str, dims))]
    if args.configs:
        parts += ["--configs", ",".join(c.name for c in configs)]
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--warmup-steps", args.warmup_steps),
        ("--cache-warmup-steps", args.cache_warmup_steps),
        ("--steps", args.steps),
        ("--memory-budget-gb", args.memory_budget_gb),
        ("--scale", args.scale),
        ("--seed", args.seed),
        ("--zipf", args.zipf),
        ("--threads", args.threads),
        ("--rounds", args.rounds),
        ("--min-seconds", args.min_seconds),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if args.min_rows != 10_000:
        parts += ["--min-rows", str(args.min_rows)]
    if args.skip_probes:
        parts.append("--skip-probes")
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace) -> int:
    """`slipcache bench TARGET`."""
    if args.target == "cache":
        from slipcache.experiments.bench_cache import run_cache_bench

        return run_cache_bench(args)
    if args.target == "train":
        from slipcache.experiments.bench_train import run_train_bench

        return run_train_bench(args)
    return run_embedding_bench(args)


def run_embedding_bench(args: argparse.Namespace) -> int:
    """Run every configuration at every dim, print the table and targets, write bench.json and bench.md."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return _run_bench(args)
    if threads < 1:
        raise SlipcacheError(f"--threads must be positive, got {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_bench(args)
    finally:  # a library caller keeps its own setting
        torch.set_num_threads(previous)


def _run_bench(args: argparse.Namespace) -> int:
    dims = _parse_dims(args.dims)
    configs = _parse_configs(args.configs)
    shape = QUICK if args.quick else FULL
    scale = shape["scale"] if args.scale is None else args.scale
    warmup = shape["warmup"] if args.warmup_steps is None else args.warmup_steps
    steps = shape["steps"] if args.steps is None else args.steps
    if not 0 < scale <= 1:
        raise SlipcacheError(f"--scale must be in (0, 1], got {scale}")
    cache_warmup = shape["cache_warmup"] if args.cache_warmup_steps is None else args.cache_warmup_steps
    if warmup < 0 or cache_warmup < 0 or steps < 1:
        raise SlipcacheError("--warmup-steps and --cache-warmup-steps must be >= 0 and --steps >= 1")
    if args.batch_size < 1:
        raise SlipcacheError(f"--batch-size must be positive, got {args.batch_size}")
    if args.min_rows < 1:
        raise SlipcacheError(f"--min-rows must be positive, got {args.min_rows}")
    if args.zipf <= 0:
        raise SlipcacheError(f"--zipf must be positive, got {args.zipf}")
    rounds = shape["rounds"] if args.rounds is None else args.rounds
    min_seconds = shape["min_seconds"] if args.min_seconds is None else args.min_seconds
    if rounds < 1 or min_seconds < 0 or args.profile_steps < 0:
        raise SlipcacheError("--rounds must be >= 1, --min-seconds and --profile-steps >= 0")
    physical = physical_memory_bytes() or 16 * 1024**3
    budget_gb = args.memory_budget_gb if args.memory_budget_gb is not None else 0.6 * physical / GB
    if budget_gb <= 0:
        raise SlipcacheError(f"--memory-budget-gb must be positive, got {budget_gb}")
    out_dir = str(args.out)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SlipcacheError(f"--out {out_dir} exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)

    machine = describe_machine()
    load = _load_average()
    cores = machine.get("usable_cores") or machine.get("logical_cores") or 1
    if load is not None and load > cores and torch.get_num_threads() > 1:
        _progress(
            f"note: load average {load:.1f} on {cores} cores; with {torch.get_num_threads()} threads per op, "
            "timings on a shared CPU collapse (threads wait for descheduled peers): consider --threads 1"
        )
    probes = None
    if not args.skip_probes:
        _progress("probing memory (sequential copy, random 64-byte row gathers from 1 GB) ...")
        probes = probe_memory(seconds=0.5 if args.quick else 1.0)
        _progress(
            f"  copy {probes['sequential_copy']['copy_gb_s']:.1f} GB/s, "
            f"gather {probes['random_gather']['rows_per_s'] / 1e6:.1f} M rows/s"
        )
    sizes = scaled_table_sizes(scale, args.min_rows)
    _progress(
        f"generating ids: {len(sizes)} tables, {sum(sizes):,} rows, {max(warmup, cache_warmup)}+{steps} steps "
        f"of {args.batch_size}"
    )
    work = make_workload(sizes, args.batch_size, warmup, steps, args.zipf, args.seed, cache_warmup)
    _progress(f"  done in {work.generate_s:.1f} s")

    keys = [(dim, cfg) for dim in dims for cfg in configs]
    per_key: dict[tuple[int, str], list[dict[str, Any]]] = {(dim, cfg.name): [] for dim, cfg in keys}
    budget = int(budget_gb * GB)
    threads = torch.get_num_threads()
    for r in range(rounds):
        for n, (dim, cfg) in enumerate(keys):
            if per_key[(dim, cfg.name)] and per_key[(dim, cfg.name)][0]["status"] != "ok":
                continue  # skipped or not installed: the same in every round
            _progress(f"[round {r + 1}/{rounds}, {n + 1}/{len(keys)}] dim {dim} {cfg.name} ...")
            profile_steps = args.profile_steps if r == rounds - 1 else 0
            row = measure(cfg, dim, work, budget, min_seconds=min_seconds, profile_steps=profile_steps)
            row["load_avg_1m_after"] = _load_average()
            per_key[(dim, cfg.name)].append(row)
            if row["status"] == "ok":
                extra = "" if row["hit_rate"] is None else f", hit rate {row['hit_rate']:.3f}"
                _progress(
                    f"    init {row['init_s']:.1f} s, {row['timed_steps']} steps in {row['timed_s']:.1f} s: "
                    f"{row['samples_per_s']:,.0f} samples/s, {row['bytes'] / GB:.3f} GB "
                    f"({row['memory_ratio']:.2f}x){extra}"
                )
            else:
                _progress(f"    {row['status']}")
    rows = [combine_rounds(per_key[(dim, cfg.name)]) for dim, cfg in keys]
    _attach_ratios(rows)
    targets = evaluate_targets(rows)
    warnings = []
    loads = [
        x
        for rounds_rows in per_key.values()
        for r in rounds_rows
        for x in (r.get("load_avg_1m"), r.get("load_avg_1m_after"))
        if x is not None
    ]
    # In steady state nearly every row admitted to the cache evicts one (rows that overflow a full set are
    # read and written in place, not admitted); far fewer evictions means the cache is still filling.
    cold = [
        f"{r['name']}@{r['dim']}"
        for r in rows
        if r["status"] == "ok"
        and r["cache_fraction"]
        and (r.get("evictions") or 0) < 0.5 * ((r.get("rows_in") or 0) - (r.get("overflow_rows") or 0))
    ]
    if cold:
        warnings.append(
            "fewer evictions than half the rows admitted to the cache during the timed steps of "
            + ", ".join(cold)
            + ": the cache was still filling, so their hit rate is a cold-start figure, not the steady state "
            "(more --cache-warmup-steps or a smaller --scale show capacity misses)"
        )
    # This process accounts for about `threads` of the load; more than half a core beyond it is someone else.
    if loads and max(loads) > threads + 0.5:
        warnings.append(
            f"the machine was busy: load average reached {max(loads):.1f} on {cores} cores while this benchmark "
            f"ran {threads} thread(s); samples/s are understated and noisy (see the min-max spread; rerun when idle)"
        )
    spread = [
        f"{r['name']}@{r['dim']}"
        for r in rows
        if r.get("samples_per_s_min") and (r["samples_per_s_max"] - r["samples_per_s_min"]) > 0.2 * r["samples_per_s"]
    ]
    if spread:
        warnings.append(
            "rounds differ by more than 20% of the median for " + ", ".join(spread) + ": the machine's speed changed "
            "during the run"
        )

    result = {
        "machine": {**machine, "torch_threads": threads, "load_avg_1m_start": load},
        "rounds": rounds,
        "min_seconds": min_seconds,
        "command": _command(args, dims, configs),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
        "probes": probes,
        "workload": work.describe(),
        "memory_budget_gb": budget_gb,
        "targets": targets,
        "warnings": warnings,
    }
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, allow_nan=False)
        fh.write("\n")
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as fh:
        fh.write(_markdown(result))

    print(format_table(rows))
    profile = format_profile(rows)
    if profile:
        print("\nphase profile, µs per sample (ours; Python overhead = the rest of the step):")
        print(profile)
    print()
    print("targets:")
    print(format_targets(targets))
    for warning in warnings:
        print(f"\nwarning: {warning}")
    print(f"\nwrote {os.path.join(out_dir, 'bench.json')} and bench.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m slipcache.experiments.bench embedding ...`: the subcommand without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="slipcache bench")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_bench(args)
    except SlipcacheError as exc:
        print(f"slipcache bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
