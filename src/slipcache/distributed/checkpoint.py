"""Checkpoints of a run of N processes: a torch.distributed.checkpoint (DCP) of the sharded tables beside the
trainer's state, a manifest written last.

    <run>/checkpoints/step-<samples>/            written as .step-<samples>.partial, renamed once complete
        .metadata, __<r>_0.distcp                DCP: every table (TorchRec's keys: fp32 rows, or an INT8
                                                 table's stored bytes), the fused optimizer's state, and
                                                 each rank's cache and rounding generators (`rank_state`)
        trainer.pt                               rank 0's trainer state (config, MLPs, dense optimizer,
                                                 progress, random generators), checksummed
        manifest.json                            world size, the plan, every file's size and SHA-256: last

A step counts only once its manifest is there and its directory has its final name, so a crash mid-write
leaves the previous checkpoint the newest complete one. Resuming on the same number of processes with the
same plan is exact (caches and generators come back); on another number (two or more), DCP re-shards the
tables and their optimizer state into the new plan (an INT8 table into a plan with the same column cuts)
and the caches start empty. One process (`slipcache eval`, `export`, `--resume` without torchrun) reads the
whole tables and their optimizer state from it (`training.step_checkpoint`, which holds the format).

Checkpoints of the earlier per-rank format (rank-<r>.pt files) are refused in one line (`OLD_FORMAT`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from slipcache.errors import SlipcacheError
from slipcache.safe_files import ensure_dir, write_atomic
from slipcache.training import checkpoint as ckpt
from slipcache.training.step_checkpoint import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    OPTIMIZER,
    TABLES,
    TRAINER_FILE,
    file_digest,
)

logger = logging.getLogger(__name__)


def step_name(samples: int) -> str:
    return f"step-{samples:012d}"


# ---------------------------------------------------------------------------------------------- writing
def save_step(
    run_dir: Path,
    samples: int,
    rank: int,
    world_size: int,
    trainer_state: dict[str, Any],
    dcp_state: dict[str, Any],
    plan: dict[str, Any],
    *,
    keep: int,
) -> int | None:
    """Write one step (module doc) from every rank; returns, on rank 0, the bytes of all its files.

    Every rank calls it. A failure on rank 0 (a full disk) is said on every rank in the same line."""
    import torch.distributed.checkpoint as dcp

    directory = run_dir / "checkpoints"
    final = directory / step_name(samples)
    partial = directory / f".{step_name(samples)}.partial"
    error = None
    if rank == 0:
        try:
            ensure_dir(directory, inside=run_dir)  # a link there is refused
            shutil.rmtree(partial, ignore_errors=True)  # left by a write that was killed
            partial.mkdir()
        except OSError as exc:
            error = _cannot_write(directory, exc, run_dir)
    _agree_on_error(error)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(dcp_state, checkpoint_id=str(partial))  # a collective: every rank's shards
    except CheckpointException as exc:  # raised on every rank, with every rank's failure in it
        raise SlipcacheError(_cannot_write(directory, OSError(_first_line(exc)), run_dir)) from exc
    error, size = None, None
    if rank == 0:
        try:
            ckpt.save_checkpoint(partial / TRAINER_FILE, trainer_state)
            written = [p for p in sorted(partial.iterdir()) if p.is_file()]
            files = {p.name: p.stat().st_size for p in written}
            manifest = {
                "format": MANIFEST_FORMAT,
                "version": MANIFEST_VERSION,
                "world_size": world_size,
                "samples": samples,
                "plan": plan,
                "files": files,
                "sha256": {p.name: file_digest(p) for p in written},  # DCP's files carry no checksum
            }
            write_atomic(partial / MANIFEST, json.dumps(manifest, indent=2) + "\n", durable=True)
            if final.exists():  # the same step written again: the new one replaces it whole
                aside = directory / f".{step_name(samples)}.old"
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(partial, final)
            _fsync_dir(directory)
            _prune(directory, keep)
            size = sum(files.values()) + (final / MANIFEST).stat().st_size
        except OSError as exc:
            error = _cannot_write(directory, exc, run_dir)
    _agree_on_error(error)
    return size


def _cannot_write(directory: Path, exc: OSError, run_dir: Path) -> str:
    complete = ckpt.complete_steps(directory) if directory.is_dir() else []
    then = (
        f"the last complete checkpoint is {complete[-1][1]}; free space, then --resume {run_dir}"
        if complete
        else f"no checkpoint was written yet; free space, then --resume {run_dir} starts it again"
    )
    return f"cannot write a checkpoint into {directory}: {exc.strerror or exc}; {then}"


def _agree_on_error(error: str | None) -> None:
    """Rank 0's failure raised on every rank (no rank left waiting in the next collective)."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise SlipcacheError(box[0])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(directory: Path, keep: int) -> None:
    """Keep the `keep` newest complete steps; drop older ones and unfinished writes."""
    for path in directory.iterdir():
        if path.name.startswith(".step-") and path.name.endswith((".partial", ".old")) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    complete = ckpt.complete_steps(directory)
    if keep <= 0 or len(complete) <= keep:
        return
    oldest_kept = complete[-keep][1]
    for path in sorted(directory.iterdir()):
        if ckpt.STEP_DIR.match(path.name) and path.name < oldest_kept.name:
            shutil.rmtree(path, ignore_errors=True)


def load_into_shards(step_dir: Path, manifest: dict[str, Any], tables: Any, rank: int, world_size: int) -> None:
    """The step's tables, their optimizer state and (same world size and plan) this rank's caches and
    generators into the sharded tables (`model.ShardedTables`); a collective."""
    import torch.distributed.checkpoint as dcp

    from slipcache.interop.torchrec_checkpoint import load_rank_state, rank_state

    sharded = tables.sharded
    state: dict[str, Any] = {TABLES: sharded.state_dict()}
    optimizer = sharded.fused_optimizer.state_dict()
    if optimizer["state"]:  # SGD keeps none: DCP saved nothing under the key, so none is asked for
        state[OPTIMIZER] = optimizer
    same = manifest["world_size"] == world_size and manifest.get("plan") == sharding_plan_record(sharded)
    if same:
        state.update(rank_state(sharded))
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=str(step_dir))
        sharded.load_state_dict(state[TABLES])
        if OPTIMIZER in state:
            sharded.fused_optimizer.load_state_dict(state[OPTIMIZER])
        if same:
            load_rank_state(sharded, state)
    except (RuntimeError, ValueError, KeyError, CheckpointException) as exc:
        raise SlipcacheError(f"checkpoint {step_dir} does not fit this run's tables: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def dcp_state(tables: Any) -> dict[str, Any]:
    """What a step's DCP holds for this rank (module doc)."""
    from slipcache.interop.torchrec_checkpoint import rank_state

    sharded = tables.sharded
    return {TABLES: sharded.state_dict(), OPTIMIZER: sharded.fused_optimizer.state_dict(), **rank_state(sharded)}


def sharding_plan_record(sharded: Any) -> dict[str, Any]:
    """Each table's sharding type and ranks, as the manifest records them."""
    record: dict[str, Any] = {}
    for name, metadata in sharded.global_metadata().items():
        if metadata is None:
            record[name] = {"type": "data_parallel"}
            continue
        record[name] = {
            "shards": [
                [list(m.shard_offsets), list(m.shard_sizes), m.placement.rank() if m.placement else None]
                for m in metadata.shards_metadata
            ]
        }
    return record
