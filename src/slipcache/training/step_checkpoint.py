"""A checkpoint of N processes read by one process: the step directory's format (manifest, trainer state,
DCP files of the tables; `slipcache.distributed.checkpoint` writes it) and its whole tables.

`--resume` without torchrun, `slipcache eval` and `slipcache export` read a step here: its manifest checked
(every file's size and SHA-256), rank 0's trainer state, and every table gathered whole from its shards (an
INT8 table of one column cut as its stored bytes, exactly) with its optimizer state. Only torch's
`torch.distributed.checkpoint` is needed, no process group.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipcache.errors import SlipcacheError
from slipcache.training import checkpoint as ckpt
from slipcache.training.run_state import TrainingCheckpoint
from slipcache.training.rundir import load_training_checkpoint

MANIFEST = ckpt.STEP_MANIFEST
MANIFEST_FORMAT = "slipcache-dcp-checkpoint"
MANIFEST_VERSION = 1
OLD_MANIFEST_FORMAT = "slipcache-sharded-checkpoint"  # the per-rank files of earlier releases
OLD_FORMAT = (
    "checkpoint {path} is in the per-rank format of an earlier slipcache (rank-<r>.pt files), which this "
    "version does not read; continue the run with the version that wrote it, or start it again"
)
TRAINER_FILE = "trainer.pt"


def table_names(count: int) -> list[str]:
    """The tables' names in a step's DCP keys, as the sharded trainer names its tables."""
    return [f"t{i}" for i in range(count)]

TABLES, OPTIMIZER = "tables", "tables_optimizer"
RESHARDED = "DCP re-sharded the tables and their optimizer state into this plan; caches start empty"


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest, after checking that every file it names is there with its recorded size; a step of
    the earlier per-rank format is refused in one line."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise SlipcacheError(f"cannot read {step_dir / MANIFEST}: {exc}") from exc
    if isinstance(manifest, dict) and manifest.get("format") == OLD_MANIFEST_FORMAT:
        raise SlipcacheError(OLD_FORMAT.format(path=step_dir))
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise SlipcacheError(f"{step_dir / MANIFEST} is not a slipcache checkpoint manifest")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise SlipcacheError(f"checkpoint manifest {step_dir / MANIFEST} is malformed: {problem}")
    for name, size in manifest["files"].items():
        file = step_dir / str(name)
        if not file.is_file() or file.stat().st_size != size:
            problem = f"{name} is missing or not the size its manifest records"
        elif file_digest(file) != manifest["sha256"][name]:
            problem = f"{name} fails its checksum"
        else:
            continue
        older = [p for _, p in ckpt.complete_steps(step_dir.parent) if p.name < step_dir.name]
        then = f"to continue from the newest complete one: --resume {older[-1]}" if older else (
            "no older complete checkpoint")
        raise SlipcacheError(f"checkpoint {step_dir} is damaged ({problem}); {then}")
    return manifest


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


MAX_WORLD_SIZE = 1 << 16  # a manifest naming more processes is not one slipcache wrote


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields, in words; None when they are well-formed."""
    if manifest.get("version") != MANIFEST_VERSION:
        return f"version must be {MANIFEST_VERSION}, got {manifest.get('version')!r}"
    world = manifest.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD_SIZE:
        return f"world_size must be a number of processes in [1, {MAX_WORLD_SIZE}], got {world!r}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        files = {}
    plain = bool(files) and all(
        isinstance(n, str) and n not in ("", ".", "..") and "/" not in n and "\\" not in n
        and isinstance(size, int) and size >= 0
        for n, size in files.items()
    )
    if not plain or TRAINER_FILE not in files or ".metadata" not in files:
        return f"files must name {TRAINER_FILE} and .metadata with their sizes, plain names in the step directory"
    digests = manifest.get("sha256")
    if not isinstance(digests, dict) or sorted(digests) != sorted(files) or not all(
        isinstance(d, str) and len(d) == 64 for d in digests.values()
    ):
        return "sha256 must give every file's digest"
    if not isinstance(manifest.get("plan"), dict):
        return "plan is not a sharding plan"
    return None


def read_trainer_state(step_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, the trainer state rank 0 saved), verified."""
    manifest = read_manifest(step_dir)
    return manifest, load_training_checkpoint(step_dir / TRAINER_FILE)


def read_step(step_dir: Path) -> TrainingCheckpoint:
    """A step of N processes for one process: the trainer state, and the whole tables (with their
    optimizer state) put into a one-process collection when the checkpoint is loaded."""
    manifest, state = read_trainer_state(step_dir)
    line = (
        f"reading {step_dir}, written by {manifest['world_size']} processes, into 1: the tables gathered from "
        "their shards (rows and optimizer state as saved); the cache starts empty"
    )
    return TrainingCheckpoint(step_dir, state, load_tables=_whole_tables_loader(step_dir), resharding=line)


def _whole_tables_loader(step_dir: Path) -> Callable[[Any], None]:
    def load(collection: Any) -> None:
        load_whole_tables(step_dir, collection)

    return load


def load_whole_tables(step_dir: Path, collection: Any) -> None:
    """Every table of the step, whole, into the one-process `CachedEmbeddingBagCollection`: its rows (an
    INT8 table of one column cut as its stored bytes, exactly; of more cuts rounded from its values) and its
    optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from slipcache.interop.torchrec_checkpoint import int8_keys
    from slipcache.interop.torchrec_weights import torchrec_key

    metadata = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    names = table_names(len(collection.table_sizes))
    if len(names) != len(collection.table_names):
        raise SlipcacheError(f"checkpoint {step_dir} holds other tables than this model")

    def key(part: str, name: str) -> str:
        return f"{part}.{name}"

    wanted: dict[str, Any] = {}
    for name in names:
        keys = [torchrec_key(name)] if f"{TABLES}.{torchrec_key(name)}" in metadata else list(int8_keys(name).values())
        for k in keys:
            full = key(TABLES, k)
            if full not in metadata:
                raise SlipcacheError(f"checkpoint {step_dir} has no {k!r}: not a checkpoint of these tables")
            wanted[full] = _empty_like_saved(metadata[full])
    optimizer_keys = [k for k in metadata if k.startswith(OPTIMIZER + ".state.")]
    for k in optimizer_keys:
        wanted[k] = _empty_like_saved(metadata[k])
    with warnings.catch_warnings():  # DCP says it loads in one process: that is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(wanted, checkpoint_id=str(step_dir), no_dist=True)
    rows = []
    int8: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t, name in enumerate(names):
        fp32 = wanted.get(key(TABLES, torchrec_key(name)))
        if fp32 is not None:
            rows.append(fp32)
            continue
        parts = int8_keys(name)
        payload, bias, scale = (wanted[key(TABLES, parts[p])] for p in ("payload", "bias", "scale_code"))
        cuts = [int(c) for c in wanted[key(TABLES, parts["cuts"])].tolist()]
        rows.append(_dequantized(payload, bias, scale, cuts))
        if len(cuts) == 1:
            int8[t] = (payload, bias[:, 0], scale[:, 0])
    collection.load_tables(rows)  # rounded to nearest; INT8 tables of one cut then get their bytes back
    for t, (payload, bias, scale) in int8.items():
        collection.load_int8(t, payload.to(torch.uint8), bias.to(torch.float16), scale.to(torch.uint8))
    _load_whole_optimizer_state(collection, names, wanted)


def _dequantized(payload: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    from slipcache.embedding.quant import dequantize_int

    bounds = [*cuts, payload.shape[1]]
    pieces = [
        dequantize_int(payload[:, start:end], bias[:, i], scale[:, i])
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    ]
    return torch.cat(pieces, dim=1)


def _load_whole_optimizer_state(collection: Any, names: list[str], loaded: dict[str, Any]) -> None:
    kind = collection.config.optimizer
    if kind == "sgd":
        return
    state = getattr(collection, "optimizer_state", None)
    for t, name in enumerate(names):
        values = {k.rsplit(".", 1)[-1]: v for k, v in loaded.items() if k.startswith(OPTIMIZER + ".state.")
                  and k.split(".state.", 1)[1].split(".")[-2:-1] == [name]}
        if not values or state is None:
            continue
        start, rows = int(collection.table_offsets[t]), int(collection.table_sizes[t])
        target = state[start : start + rows]
        if kind == "rowwise_adagrad":
            value = values["momentum1"]
            if value.shape[1] != 1:
                raise SlipcacheError(
                    f"table {name!r}: its row-wise Adagrad state was saved with {value.shape[1]} column cuts; "
                    "one process holds one: resume it on as many processes as wrote it"
                )
            target.copy_(value[:, 0].to(target.dtype))
        elif kind == "adam":
            target.copy_(torch.cat([values["momentum1"], values["momentum2"]], dim=1).to(target.dtype))
            if "step" in values:
                collection.optimizer.steps = int(values["step"])
        else:
            target.copy_(values["momentum1"].to(target.dtype))


def _empty_like_saved(item: Any) -> Any:
    """A tensor to load a saved value into (its global size and dtype), or None for a saved object."""
    size = getattr(item, "size", None)
    properties = getattr(item, "properties", None)
    if size is None or properties is None:
        return None
    return torch.empty(tuple(size), dtype=properties.dtype)
