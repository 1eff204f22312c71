"""Timing of one `slipcache bench embedding` configuration: build, warm up, time, profile our step's phases,
free; and the median over the rounds of one configuration.
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from slipcache.bench.peers import (
    BenchConfig,
    Built,
    _build_fbgemm,
    _build_slipcache,
    _build_torch,
    _slipcache_module,
    estimate_bytes,
    fbgemm_available,
)
from slipcache.bench.workload import Workload, prefill_batches
from slipcache.errors import SlipcacheError

GB = 1e9


# Phases of our step (PhaseClock) as the profile reports them; Python overhead is the rest of the step.
PHASE_NAMES = {
    "lookup": "cache lookup",
    "fill": "miss fill + dequantize",
    "evict": "eviction + quantize",
    "forward": "forward gather/pool",
    "backward": "backward scatter/update",
}
PROFILE_STEPS = 20
PREFILL_OVERSUBSCRIPTION = 1.5  # rows offered by the prefill per cache slot


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
        "samples_per_cpu_s": None,
        "ratio_vs_fbgemm_fp32_cpu": None,
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
    profile_clock: str = "wall",
) -> dict[str, Any]:
    """Build, warm up, time and free one configuration; never raises for a failing implementation.

    Timing runs the workload's timed batches (cycling over them) until both `timed_steps` steps and
    `min_seconds` have passed; then, for ours, `profile_steps` more steps with the phase clock on (`profile_clock`
    "cpu": this process's CPU time, for a machine shared with other jobs). Besides samples/s by the wall clock,
    the timed section's samples per CPU second of this process (`samples_per_cpu_s`) are kept: on a busy
    machine descheduling inflates wall time and not CPU time.
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
        assert static is not None  # ours always reports its memory
        row["bytes"] = int(static["total_bytes"])
        row["memory_ratio"] = _finite(static.get("memory_ratio"))
    if need > budget_bytes:
        row["status"] = f"does not fit: needs {need / GB:.1f} GB (budget {budget_bytes / GB:.1f} GB)"
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
        if built.cache_rows and work.hot_rows:
            start = time.perf_counter()
            row["prefill_steps"] = _prefill(built, work, dim)
            row["prefill_s"] = time.perf_counter() - start
        for i in range(first - warm, first):
            built.step(batches[i], grad)
        if built.reset_stats is not None:
            built.reset_stats()
        row["load_avg_1m"] = _load_average()
        step_s: list[float] = []
        start = last = time.perf_counter()
        cpu_start = time.process_time()
        steps = 0
        while steps < work.timed_steps or last - start < min_seconds:
            built.step(batches[first + steps % work.timed_steps], grad)
            steps += 1
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
        elapsed = last - start
        cpu = time.process_time() - cpu_start
        samples = steps * work.batch_size
        row["cpu_s"] = cpu
        row["samples_per_cpu_s"] = samples / cpu if cpu > 0 else None
        row["timed_steps"] = steps
        row["replayed_batches"] = max(0, steps - work.timed_steps)  # only with --min-seconds: flagged
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
            for key in ("lookups", "misses", "rows_in", "rows_out", "overflow_rows", "evictions"):
                row[key] = stats.get(key)
            if row["evictions"] is not None:
                row["evictions_per_step"] = row["evictions"] / steps
        if built.clock is not None and profile_steps > 0:
            row["phase_us_per_sample"] = _profile(built, work, grad, profile_steps, profile_clock)
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


def _prefill(built: Built, work: Workload, dim: int) -> int:
    """Fill the cache with the workload's most probable rows (zero gradients: values unchanged) so that the
    warm-up and timing start in steady state, evicting, rather than filling a cold cache. Returns the steps.

    It offers 1.5x the cache's rows, coldest first: rows hash to sets unevenly, and a set that receives more
    than its ways keeps the later, hotter ones, so every set ends full. Each prefill batch brings at most a
    quarter of the cache's rows, so that few sets overflow within one step.
    """
    tables = len(work.table_sizes)
    rows_per_batch = min(8 * work.batch_size, max(1, built.cache_rows // (4 * tables)))
    batches = prefill_batches(work, math.ceil(PREFILL_OVERSUBSCRIPTION * built.cache_rows), rows_per_batch)
    for ids in batches:
        built.step(ids, torch.zeros(ids.shape[0], tables, dim))
    return len(batches)


PROFILE_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _profile(built: Built, work: Workload, grad: Tensor, steps: int, clock_name: str = "wall") -> dict[str, float]:
    """µs per sample in each phase of our step over `steps` steps; the rest of the step is Python overhead
    (validation, autograd, counters, the calls themselves). The steps run the workload's profile batches,
    fresh ids (cycling only if it has fewer): a replay of timed batches would find their rows cached and
    profile a step without misses. `clock_name` "cpu" times the phases in this process's CPU time."""
    clock = built.clock
    timer = PROFILE_CLOCKS[clock_name]
    clock.enable(timer)
    start = timer()
    first, count = work.first_timed + work.timed_steps, work.profile_steps
    for i in range(steps):
        index = first + i % count if count else work.first_timed + i % work.timed_steps
        built.step(work.batches[index], grad)
    total = timer() - start
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
    cpu_speeds = [r["samples_per_cpu_s"] for r in ok if r.get("samples_per_cpu_s")]
    row["samples_per_cpu_s_rounds"] = cpu_speeds
    if cpu_speeds:
        row["samples_per_cpu_s"] = float(np.median(cpu_speeds))
        row["samples_per_cpu_s_min"], row["samples_per_cpu_s_max"] = min(cpu_speeds), max(cpu_speeds)
    if len(ok) < len(rounds) and ok:
        row["status"] = f"ok in {len(ok)} of {len(rounds)} rounds"
    profiles = [r["phase_us_per_sample"] for r in ok if r.get("phase_us_per_sample")]
    if profiles:
        row["phase_us_per_sample"] = {k: float(np.median([p[k] for p in profiles])) for k in profiles[0]}
    return row


