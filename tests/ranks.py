"""Start a few gloo processes from a test: a free port on 127.0.0.1, bounded waiting."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

JOIN_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():  # the code under test may have shut it down itself
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; fail if any fails or hangs."""
    context = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {JOIN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def exit_codes(fn: Callable[..., None], *args: Any, world_size: int = 2) -> list[int | None]:
    """Like `run_ranks`, but let every rank finish on its own (one failing does not stop the others)."""
    context = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for process in context.processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in context.processes:
        if process.is_alive():
            process.kill()
    return [process.exitcode for process in context.processes]
