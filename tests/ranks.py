"""Start a few gloo processes from a test: a free port on 127.0.0.1, waiting without a wall-clock race.

A loaded machine slows ranks down but does not stop them: the ranks are given up on only when none of
them used any CPU for STALL_S seconds (a deadlock), not after a fixed time, and their collectives wait
COLLECTIVE_TIMEOUT_S for a peer (a dead peer is noticed at once by its closed connection).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipcache.distributed.launch import shutdown  # before any group: see its import of torch.distributed.nn

STALL_S = 60.0  # no rank ran for this long: hung
COLLECTIVE_TIMEOUT_S = 600.0
POLL_S = 1.0


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
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    from slipcache.console import console_messages

    try:
        with console_messages():  # a rank prints the library's messages as `slipcache train`'s ranks do
            fn(rank, world_size, *args)
    finally:
        shutdown()  # as `slipcache train`'s ranks: a gloo thread outliving the group aborts the process at exit


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (Linux /proc; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Watchdog:
    """Says when processes look hung: none of them used any CPU for `stall_s` seconds. Without /proc to
    read CPU time from, ten times `stall_s` of wall time is the bound."""

    def __init__(self, processes: list[Any], stall_s: float = STALL_S) -> None:
        self.processes, self.stall_s = processes, stall_s
        self.has_proc = Path("/proc/self/stat").is_file()
        self.used = self._used()
        self.since = time.monotonic()

    def _used(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.processes if p.is_alive()) if self.has_proc else 0.0

    def stalled(self) -> bool:
        if not self.has_proc:
            return time.monotonic() - self.since > 10 * self.stall_s
        used = self._used()
        if used != self.used:
            self.used, self.since = used, time.monotonic()
        return time.monotonic() - self.since > self.stall_s


def run_ranks(fn: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; fail if any fails or hangs."""
    context = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False, start_method="spawn"
    )
    watchdog = Watchdog(context.processes)
    try:
        while not context.join(timeout=POLL_S):
            if watchdog.stalled():
                raise TimeoutError(f"ranks hung: no rank used any CPU for {STALL_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def exit_codes(fn: Callable[..., None], *args: Any, world_size: int = 2) -> list[int | None]:
    """Like `run_ranks`, but let every rank finish on its own (one failing does not stop the others)."""
    context = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False, start_method="spawn"
    )
    watchdog = Watchdog(context.processes)
    while any(p.is_alive() for p in context.processes) and not watchdog.stalled():
        for process in context.processes:
            process.join(timeout=POLL_S / world_size)
    for process in context.processes:
        if process.is_alive():
            process.kill()
            process.join()
    return [process.exitcode for process in context.processes]
