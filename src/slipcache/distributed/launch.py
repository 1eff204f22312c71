"""Joining a `torchrun` launch: the process group, per-rank threads and per-rank output.

`torchrun --nproc-per-node N --no-python slipcache train ...` starts N copies of the command with
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; multi-node launches
add `--nnodes` and `--rdzv-endpoint`, and nothing here changes. Without those variables (or with
WORLD_SIZE=1) `init_from_env` returns None and the caller runs as a single process, exactly as before.

When a rank dies, torchrun stops the others with SIGTERM and then prints its own report. A rank busy
computing (not inside a collective that would fail on the lost connection) would die silently: the handler
installed here prints one line first, on the console and in the rank's log, and exits at once. A rank
whose collective failed reports that instead (`announce_stop`), once.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this module binds the default group into its
# functions' default arguments when it is first imported. Imported later (TorchRec's sharded tensors do it
# lazily), it keeps the group alive past `destroy_process_group`; gloo's worker threads then outlive it and
# one may release a tensor during interpreter exit, which aborts the process (SIGABRT) after a good run.
import torch.distributed.nn.functional  # noqa: F401

from slipcache._native import check_thread_count, usable_cores
from slipcache.errors import SlipcacheError
from slipcache.safe_files import open_append

logger = logging.getLogger(__name__)

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
    if given is not None:
        if not given.strip().isdigit() or int(given) < 1:  # an empty value is a mistake too, not "unset"
            raise SlipcacheError(f"SLIPCACHE_THREADS must be a positive integer, got {given!r}")
        return check_thread_count(int(given), "SLIPCACHE_THREADS")
    return max(1, usable_cores() // max(1, local_world_size))


STOP_COMMAND = "slipcache train"
_stop_reported = False  # this process already said why it stops


def stop_message(rank: int) -> str:
    return (
        f"rank {rank}: stopped by torchrun because another rank exited; resume from the last complete "
        "checkpoint with --resume"
    )


def announce_stop(line: str) -> None:
    """Mark that this process said why it stops; repeat `line` on the console when its output goes to
    its rank log (the caller prints it to sys.stderr, the log)."""
    global _stop_reported
    _stop_reported = True
    console = sys.__stderr__
    if console is not None and sys.stderr is not console:
        print(f"{STOP_COMMAND}: error: {line}", file=console, flush=True)


def _on_terminate(rank: int, signum: int, _frame: object) -> None:
    """torchrun's SIGTERM after another rank exited: one line (unless already said), then exit now.

    Exiting at once (no unwinding): a collective with a dead peer could block the shutdown until torchrun's
    SIGKILL; checkpoints stay whole because each file is renamed into place and the manifest comes last.
    """
    if not _stop_reported:
        line = stop_message(rank)
        print(f"{STOP_COMMAND}: error: {line}", file=sys.stderr, flush=True)
        announce_stop(line)
    os._exit(128 + signum)


def install_stop_handler(rank: int) -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), report torchrun's SIGTERM in one line."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        signal.signal(signal.SIGTERM, lambda signum, frame: _on_terminate(rank, signum, frame))


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> DistributedContext | None:
    """Join the process group torchrun described; None for a single process (nothing to join)."""
    world_size = launched_ranks()
    if world_size <= 1:
        if os.environ.get("SLIPCACHE_THREADS"):  # checked, and said once: one process takes --threads
            threads_per_rank(1)
            logger.warning("slipcache train: warning: SLIPCACHE_THREADS sets the threads of torchrun's ranks; "
                           "one process uses --threads (not set: torch's choice)")
        return None
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SlipcacheError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: start many processes with torchrun"
        )
    rank, local_rank = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    install_stop_handler(rank)
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
        threads=threads,
    )


def redirect_output(run_dir: Path, rank: int) -> TextIO:
    """Send this rank's stdout and stderr to `run_dir/rank-<r>.log` (rank 0 alone prints)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open_append(run_dir / f"rank-{rank}.log", buffering=1)  # lives as long as the process; no link followed
    sys.stdout = sys.stderr = log
    return log


def shutdown() -> None:
    """Leave the process group and let its worker threads end now: one still releasing a tensor during
    interpreter exit aborts the process. Whatever holds the group must go first: the caller drops its model,
    the frames of an exception in flight are cleared (their locals only: the traceback still prints), and the
    garbage is collected."""
    seen: set[int] = set()
    exc = sys.exception()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
