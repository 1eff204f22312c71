"""Checkpoints written by many ranks: one file per rank, a manifest written last.

    <run>/checkpoints/step-<samples>/rank-<r>.pt     each rank's state (its shards under "embeddings")
    <run>/checkpoints/step-<samples>/manifest.json   world size, plan, file sizes: written by rank 0
                                                     after a barrier, once every rank's file is complete

A checkpoint counts only when its manifest exists, so a crash mid-write leaves the previous one as the
newest complete checkpoint. Each file is written atomically by `slipcache.training.checkpoint`.
Resuming with another world size re-shards the tables (`reshard_into`): every new rank reads the old
shards that overlap its own, flushes their caches into storage and copies the rows (storage bytes and
optimizer state, exactly); caches start empty and cache counters from zero.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from slipcache.distributed.planner import Shard, ShardingPlan
from slipcache.distributed.sharded import ShardedEmbeddingCollection, shard_config
from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.errors import SlipcacheError
from slipcache.safe_files import ensure_dir, write_atomic
from slipcache.training import checkpoint as ckpt
from slipcache.training.run_state import TrainingCheckpoint, check_checkpoint

MANIFEST = ckpt.STEP_MANIFEST
RESHARDED = (
    "each rank copied the rows it now holds from the saved shards (their caches flushed into storage first; "
    "rows and optimizer state exact); caches start empty"
)
MANIFEST_FORMAT = "slipcache-sharded-checkpoint"
_STEP_DIR = ckpt.STEP_DIR
MAX_WORLD_SIZE = 1 << 16  # a manifest naming more processes is not one slipcache wrote


def rank_file(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank-{rank}.pt"


def save_sharded(
    directory: Path,
    samples: int,
    rank: int,
    world_size: int,
    state: dict[str, Any],
    manifest: dict[str, Any],
    *,
    keep: int = 2,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Every rank writes its file; after a barrier rank 0 writes the manifest and prunes old checkpoints.

    `manifest` (rank 0's is used) holds what resuming needs besides the files, e.g. the plan.
    """
    step_dir = ensure_dir(Path(directory) / f"step-{samples:012d}", inside=Path(directory).parent)
    ckpt.save_checkpoint(rank_file(step_dir, rank), state)
    dist.barrier(group=group)  # every rank's file is complete (and fsynced) past this point
    if rank == 0:
        files = {
            rank_file(step_dir, r).name: rank_file(step_dir, r).stat().st_size for r in range(world_size)
        }
        content = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "world_size": world_size,
            "samples": samples,
            "files": files,
            **manifest,
        }
        write_atomic(step_dir / MANIFEST, json.dumps(content, indent=2) + "\n", durable=True)
        _prune(Path(directory), keep)
    dist.barrier(group=group)  # no rank moves on (or reports the checkpoint) before it counts
    return step_dir


def _prune(directory: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints; drop older ones and incomplete ones before them."""
    steps = sorted(p for p in directory.iterdir() if _STEP_DIR.match(p.name))
    complete = [p for p in steps if (p / MANIFEST).is_file()]
    if keep <= 0 or len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for path in steps:
        if path < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def latest_sharded(path: Path) -> Path | None:
    """The newest complete checkpoint under a run dir, its checkpoints dir, or a step dir itself."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        return None
    complete = sorted(p for p in path.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file())
    return complete[-1] if complete else None


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest, after checking that every rank file it names is there with its recorded size."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise SlipcacheError(f"cannot read {step_dir / MANIFEST}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise SlipcacheError(f"{step_dir / MANIFEST} is not a slipcache sharded checkpoint manifest")
    _check_files(manifest, step_dir / MANIFEST)
    for name, size in manifest["files"].items():
        file = step_dir / name
        if not file.is_file() or file.stat().st_size != size:
            raise SlipcacheError(
                f"checkpoint {step_dir}: {name} is missing or not the size the manifest records"
            )
    _check_plan(manifest, step_dir / MANIFEST)
    return manifest


def _malformed(manifest: dict[str, Any], path: Path, field: str, problem: str) -> SlipcacheError:
    return SlipcacheError(
        f"checkpoint manifest {path} is malformed: {field} {problem}, got {manifest.get(field)!r:.60}"
    )


def _check_files(manifest: dict[str, Any], path: Path) -> None:
    """The processes and their files, before any file is looked at: one line naming the malformed field."""

    def bad(field: str, problem: str) -> SlipcacheError:
        return _malformed(manifest, path, field, problem)

    world = manifest.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
        raise bad("world_size", f"must be a number of processes in [1, {MAX_WORLD_SIZE}]")
    files = manifest.get("files")
    expected = {rank_file(path.parent, r).name for r in range(world)}
    if not isinstance(files, dict) or set(files) != expected:
        named = f"{', '.join(sorted(expected)[:3])}{', ...' if world > 3 else ''}"
        raise bad("files", f"must name {named} (one file per rank)")
    if not all(type(size) is int and size >= 0 for size in files.values()):
        raise bad("files", "must give each file's size in bytes")


def _check_plan(manifest: dict[str, Any], path: Path) -> None:
    """What a resume reads besides the files: the position and the sharding plan."""

    def bad(field: str, problem: str) -> SlipcacheError:
        return _malformed(manifest, path, field, problem)

    if type(manifest.get("samples")) is not int or manifest["samples"] < 0:
        raise bad("samples", "must be a non-negative integer")
    world = manifest["world_size"]
    try:
        plan = ShardingPlan.from_dict(manifest["plan"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise bad("plan", f"is not a sharding plan ({type(exc).__name__})") from None
    if plan.world_size != world:
        raise bad("plan", f"is for {plan.world_size} processes, the manifest's world_size {world}")


def load_rank_state(step_dir: Path, rank: int) -> dict[str, Any]:
    return ckpt.load_checkpoint(rank_file(step_dir, rank))


def reshard_into(collection: ShardedEmbeddingCollection, step_dir: Path, manifest: dict[str, Any]) -> None:
    """Fill `collection`'s shards from a checkpoint written under another plan (any world size)."""
    old_plan = ShardingPlan.from_dict(manifest["plan"])
    if [t.rows for t in old_plan.tables] != collection.table_sizes:
        raise SlipcacheError(f"checkpoint {step_dir} holds other tables than this model's")
    if collection.local is None:
        return
    collection.local.cache.evict(collection.local.cache.cached()[0])  # the new shards start with empty caches
    for old_rank in range(old_plan.world_size):
        old_shards = old_plan.shards_of(old_rank)
        if _overlaps(old_shards, collection.shards):
            saved = load_rank_state(step_dir, old_rank)["embeddings"]  # the sharded collection's state dict
            _copy_rows(collection, old_shards, old_rank, {k.removeprefix("local."): v for k, v in saved.items()})


def reshard_from_single(collection: ShardedEmbeddingCollection, embeddings: dict[str, Any]) -> None:
    """Fill `collection`'s shards from a one-process checkpoint's tables (its "embeddings" state dict)."""
    if collection.local is None:
        return
    collection.local.cache.evict(collection.local.cache.cached()[0])
    whole = [Shard(t, 0, 0, n) for t, n in enumerate(collection.table_sizes)]
    _copy_rows(collection, whole, 0, embeddings)


def _overlaps(old_shards: list[Shard], new_shards: list[Shard]) -> list[tuple[int, int, int, int]]:
    """(old shard, new shard, first row, end row) of every row range both hold."""
    return [
        (i, j, max(a.row_start, b.row_start), min(a.row_end, b.row_end))
        for i, a in enumerate(old_shards)
        for j, b in enumerate(new_shards)
        if a.table == b.table and max(a.row_start, b.row_start) < min(a.row_end, b.row_end)
    ]


def _copy_rows(
    collection: ShardedEmbeddingCollection, old_shards: list[Shard], old_rank: int, saved: dict[str, Any]
) -> None:
    """Load one old rank's shards (`saved`, a collection state dict), flush its cache into storage and copy
    the rows this rank now holds: storage bytes and optimizer state, exactly."""
    local = collection.local
    assert local is not None
    old = CachedEmbeddingBagCollection(shard_config(collection.config, old_shards, old_rank), draw_rows=False)
    # A one-process checkpoint read lazily leaves its large tensors on disk (tables past the streaming
    # threshold, 16 MiB): read them, digests checked, straight into the old collection's buffers.
    ckpt.materialize(saved, old.state_dict(), old.storage_files())
    old.load_state_dict(saved)
    old.flush()
    sources, targets = old.table_offsets.tolist(), local.table_offsets.tolist()
    for i, j, lo, hi in _overlaps(old_shards, collection.shards):
        src = sources[i] + lo - old_shards[i].row_start
        dst = targets[j] + lo - collection.shards[j].row_start
        for target, source in _row_buffers(local, old):
            target[dst : dst + hi - lo].copy_(source[src : src + hi - lo])


def _row_buffers(
    new: CachedEmbeddingBagCollection, old: CachedEmbeddingBagCollection
) -> list[tuple[Any, Any]]:
    """(new, old) pairs of every buffer indexed by row: storage bytes, quantization parameters, optimizer."""
    pairs = list(zip(new.storage.buffers(), old.storage.buffers(), strict=True))
    if hasattr(new, "optimizer_state"):
        pairs.append((new.optimizer_state, old.optimizer_state))
    return pairs


def unshard_into(collection: CachedEmbeddingBagCollection, step_dir: Path) -> None:
    """Fill one process's collection of all tables from an N-rank checkpoint (for `slipcache eval`).

    Every rank's shards are loaded in turn, their caches flushed, and their rows and optimizer state copied
    to the tables' places; the cache of `collection` starts empty.
    """
    plan = ShardingPlan.from_dict(read_manifest(step_dir)["plan"])
    if [t.rows for t in plan.tables] != collection.table_sizes:
        raise SlipcacheError(f"checkpoint {step_dir} holds other tables than this model's")
    collection.cache.evict(collection.cache.cached()[0])
    offsets = collection.table_offsets.tolist()
    for rank in range(plan.world_size):
        shards = plan.shards_of(rank)
        if not shards:
            continue
        old = CachedEmbeddingBagCollection(shard_config(collection.config, shards, rank), draw_rows=False)
        saved = load_rank_state(step_dir, rank)["embeddings"]
        old.load_state_dict({k.removeprefix("local."): v for k, v in saved.items()})
        old.flush()
        sources = old.table_offsets.tolist()
        for i, shard in enumerate(shards):
            dst = offsets[shard.table] + shard.row_start
            for target, source in _row_buffers(collection, old):
                target[dst : dst + shard.rows].copy_(source[sources[i] : sources[i] + shard.rows])


def read_in_one_process(step_dir: Path) -> TrainingCheckpoint:
    """A step directory read by one process (`--resume` without torchrun, `slipcache eval`, `export`):
    rank 0's trainer state now; every rank's shards gathered into the tables when it is loaded."""
    manifest = read_manifest(step_dir)  # every rank's file present, with its recorded size
    state = load_rank_state(step_dir, 0)
    check_checkpoint(state, step_dir)
    del state["embeddings"]  # rank 0's shards alone: the tables come from every rank's
    return TrainingCheckpoint(
        step_dir,
        state,
        load_tables=partial(unshard_into, step_dir=step_dir),
        resharding=(
            f"re-sharding {step_dir}, written by {manifest['world_size']} processes, into 1: {RESHARDED}"
        ),
    )
