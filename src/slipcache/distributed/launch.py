"""Joining a `torchrun` launch: the process group, per-rank threads and per-rank output.

`torchrun --nproc-per-node N --no-python slipcache train ...` starts N copies of the command with
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; multi-node launches
add `--nnodes` and `--rdzv-endpoint`, and nothing here changes. Without those variables (or with
WORLD_SIZE=1) `init_from_env` returns None and the caller runs as a single process, exactly as before.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from slipcache.errors import SlipcacheError

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 120.0  # a rank that stops answering fails the others' collectives after this long


@dataclass
class DistributedContext:
    """Who this process is in the launch, and the groups its collectives use."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    embedding_group: dist.ProcessGroup  # the sharded tables' all-to-alls, apart from DDP's all-reduces
    threads: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_ranks() -> int:
    """The world size torchrun announced, 1 when not launched by it."""
    return env_int("WORLD_SIZE", 1)


def env_int(name: str, default: int) -> int:
    """An integer launch variable (WORLD_SIZE, RANK, ...); anything else is one line naming it."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise SlipcacheError(f"{name} must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise SlipcacheError(f"{name} must be a non-negative integer, got {text!r}")
    return value


def default_backend() -> str:
    """NCCL when this process has a GPU, gloo otherwise; SLIPCACHE_DIST_BACKEND overrides."""
    chosen = os.environ.get("SLIPCACHE_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen not in BACKENDS:
        raise SlipcacheError(f"SLIPCACHE_DIST_BACKEND must be one of {', '.join(BACKENDS)}, got {chosen!r}")
    if chosen == "nccl" and not torch.cuda.is_available():
        raise SlipcacheError("SLIPCACHE_DIST_BACKEND=nccl needs a CUDA GPU, and none is available; use gloo")
    return chosen


def threads_per_rank(local_world_size: int) -> int:
    """SLIPCACHE_THREADS if set, else the cores this process may use shared by the ranks on this node."""
    given = os.environ.get("SLIPCACHE_THREADS")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise SlipcacheError(f"SLIPCACHE_THREADS must be a positive integer, got {given!r}")
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> DistributedContext | None:
    """Join the process group torchrun described; None for a single process (nothing to join)."""
    world_size = launched_ranks()
    if world_size <= 1:
        return None
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SlipcacheError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: start many processes with torchrun"
        )
    rank, local_rank = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    threads = threads_per_rank(local_world_size)
    torch.set_num_threads(threads)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return DistributedContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        backend=backend,
        device=device,
        embedding_group=dist.new_group(backend=backend, timeout=timeout),
        threads=threads,
    )


def redirect_output(run_dir: Path, rank: int) -> TextIO:
    """Send this rank's stdout and stderr to `run_dir/rank-<r>.log` (rank 0 alone prints)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / f"rank-{rank}.log", "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    sys.stdout = sys.stderr = log
    return log


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
