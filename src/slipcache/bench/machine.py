"""Describe the machine a measurement ran on, and probe its memory system.

Throughput numbers mean little without the machine they came from: the benchmark and the experiments
report both record `describe_machine()` next to their figures, and the two probes give the ceilings an
embedding lookup can approach (a cached-embedding step is a random row gather plus some streaming).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from typing import Any

import numpy as np
import torch

from slipcache import _native

__all__ = [
    "describe_machine",
    "physical_memory_bytes",
    "probe_memory",
    "probe_random_gather",
    "probe_sequential_copy",
]


def _cpu_model() -> str:
    """The CPU model string; /proc/cpuinfo on Linux, platform's guess elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _meminfo() -> dict[str, int]:
    """Bytes from /proc/meminfo (MemTotal, MemAvailable, ...); empty where there is none."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    out[key.strip()] = int(parts[0]) * scale
    except OSError:
        pass
    return out


def physical_memory_bytes() -> int | None:
    """Total physical memory, for default memory budgets; None when it cannot be read."""
    info = _meminfo()
    if "MemTotal" in info:
        return info["MemTotal"]
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _version(dist: str) -> str | None:
    """Installed version of a distribution without importing it (importing fbgemm_gpu loads big libraries)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs; None where /proc/cpuinfo does not say."""
    cores: set[tuple[str, str]] = set()
    phys = core = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = val.strip()
                elif key == "core id":
                    core = val.strip()
                elif not key and phys is not None and core is not None:
                    cores.add((phys, core))
                    phys = core = None
    except OSError:
        return None
    if phys is not None and core is not None:
        cores.add((phys, core))
    return len(cores) or None


def describe_machine() -> dict[str, Any]:
    """A JSON-ready description: CPU, cores, torch and compiled-loop threads, memory, library versions, CUDA
    device if any."""
    info = _meminfo()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    fbgemm = _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu") or _version("fbgemm_gpu")
    cuda: dict[str, Any] | None = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
        }
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": _physical_cores(),
        "usable_cores": affinity,
        "torch_threads": torch.get_num_threads(),
        "loop_threads": _native.threads(),  # threads per compiled loop (the cached step's lookups and updates)
        "memory_total_bytes": info.get("MemTotal", physical_memory_bytes()),
        "memory_available_bytes": info.get("MemAvailable"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "fbgemm_gpu": fbgemm,
        "cuda": cuda,
    }


def _touched(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor whose pages are really mapped: zeroed memory from calloc reads as one shared page."""
    out = torch.empty(numel, dtype=dtype)
    out.fill_(1)
    return out


def probe_sequential_copy(size_bytes: int = 256 << 20, seconds: float = 1.0) -> dict[str, float]:
    """Sequential copy bandwidth (torch `copy_` of a buffer larger than the caches).

    Why: the streaming ceiling for bulk work (quantizing tables, flushing the cache). `copy_gb_s` counts the
    bytes copied; `traffic_gb_s` counts read + written, the number STREAM-style tools print for "copy".
    """
    numel = max(1, size_bytes // 4)
    src = _touched(numel)
    dst = _touched(numel)
    dst.copy_(src)  # warm: page tables, TLB, threads
    reps = 0
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds or reps < 2:
        dst.copy_(src)
        reps += 1
        elapsed = time.perf_counter() - start
    copied = reps * numel * 4
    del src, dst
    return {
        "buffer_bytes": numel * 4,
        "copy_gb_s": copied / elapsed / 1e9,
        "traffic_gb_s": 2 * copied / elapsed / 1e9,
        "seconds": elapsed,
    }


def probe_random_gather(
    table_bytes: int = 1 << 30,
    row_bytes: int = 64,
    batch_rows: int = 1 << 20,
    seconds: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """Random row gathers (`index_select`) of `row_bytes` rows from a table of `table_bytes`.

    Why: an embedding lookup is exactly this; it bounds what any implementation on this machine can reach
    (64-byte rows = fp32 rows of D=16, one cache line each).
    """
    dim = max(1, row_bytes // 4)
    rows = max(1, table_bytes // (dim * 4))
    table = _touched(rows * dim).view(rows, dim)
    gen = torch.Generator().manual_seed(seed)
    batch_rows = max(1, min(batch_rows, 4 * rows))
    indices = [torch.randint(0, rows, (batch_rows,), generator=gen) for _ in range(4)]
    out = torch.empty(batch_rows, dim)
    torch.index_select(table, 0, indices[0], out=out)  # warm
    reps = 0
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds or reps < 2:
        torch.index_select(table, 0, indices[reps % len(indices)], out=out)
        reps += 1
        elapsed = time.perf_counter() - start
    gathered = reps * batch_rows
    del table, out, indices
    return {
        "table_bytes": rows * dim * 4,
        "row_bytes": dim * 4,
        "rows_per_s": gathered / elapsed,
        "gb_s": gathered * dim * 4 / elapsed / 1e9,
        "seconds": elapsed,
    }


def probe_memory(
    table_bytes: int = 1 << 30, copy_bytes: int = 256 << 20, seconds: float = 1.0
) -> dict[str, dict[str, float]]:
    """Both probes, about `2 * seconds` plus set-up; the dict the benchmark and report store."""
    return {
        "sequential_copy": probe_sequential_copy(copy_bytes, seconds),
        "random_gather": probe_random_gather(table_bytes, 64, seconds=seconds),
    }


if __name__ == "__main__":  # pragma: no cover - a manual check
    import json

    print(json.dumps({"machine": describe_machine(), "probes": probe_memory()}, indent=2))
