"""Know before allocating: the bytes a command's tables need, against what the machine can give.

Every command that builds embedding tables (train, eval, export, bench, plan, the TorchRec path) asks
`require_tables_fit` first. Tables that cannot fit stop the command with one line that says what they
need, what is available and what would fit, instead of an allocation that the kernel kills half-way
(or that swaps the machine to a halt).

Available memory is the smallest of the kernel's MemAvailable, what the process's cgroup still allows
(its limit less its usage) and what the address-space limit (RLIMIT_AS, `ulimit -v`) still allows (its
limit less the address space mapped); `SLIPCACHE_MEMORY_AVAILABLE_GB` overrides them all (to leave room
for something else, or to try the check). Beside the tables, training prices the MLPs and the per-batch
buffers (`model_bytes`) in the same check.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipcache.errors import SlipcacheError
from slipcache.units import amount

if TYPE_CHECKING:
    from slipcache.embedding.config import EmbeddingConfig

logger = logging.getLogger(__name__)

GB = 1e9
# The process beside its tables: torch itself, the dense layers, batches in flight, evaluation's scores.
RUNTIME_BYTES = int(1.0 * GB)
ENV_AVAILABLE = "SLIPCACHE_MEMORY_AVAILABLE_GB"
# Precision and cache share, best first: what the error suggests when the asked-for tables do not fit.
# The memory report's components that are the row storage in files with a storage path (the rows' codes;
# their quantization parameters stay in memory).
STORAGE_COMPONENTS = ("storage_payload",)
# File systems whose reads cross a network: a storage path there is warned about.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "fuse.sshfs", "afs")
FALLBACKS = (("fp16", 0.05), ("int8", 0.05), ("int8", 0.01), ("int4", 0.05), ("int4", 0.01))


class MemoryShortError(SlipcacheError):
    """Tables that cannot fit in the memory this machine (or cgroup) has available."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's cgroup still allows (limit less usage); None without a limit."""
    limits = [(root / "memory.max", root / "memory.current"),  # cgroup v2
              (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes")]  # v1
    for limit_path, usage_path in limits:
        limit = _read_int(limit_path)  # "max" (no limit) reads as None
        if limit is not None and limit < 1 << 60:
            return max(0, limit - (_read_int(usage_path) or 0))
    return None


def _address_space_headroom() -> int | None:
    """What the address-space limit (RLIMIT_AS, `ulimit -v`) still allows this process: the limit less
    the address space it already maps (VmSize); None without a limit. Every allocation counts against it,
    and so does every file mapped into memory (row storage under a storage path)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError):  # pragma: no cover - platforms without it
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = 0
    try:
        with open("/proc/self/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    used = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return max(0, soft - used)


def memory_limits() -> list[tuple[int, str]]:
    """Each limit this process's allocations meet, as (bytes still allowed, what it is), the override alone
    where `SLIPCACHE_MEMORY_AVAILABLE_GB` is set."""
    override = os.environ.get(ENV_AVAILABLE)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):  # -5 or inf would be used as given
            raise SlipcacheError(f"{ENV_AVAILABLE} must be a non-negative number of GB, got {override!r}")
        return [(int(value * GB), ENV_AVAILABLE)]
    found = [(_meminfo_available(), "available memory"), (_cgroup_headroom(), "the cgroup's memory limit"),
             (_address_space_headroom(), "the address-space limit, ulimit -v")]
    return [(b, name) for b, name in found if b is not None]


def limiting_memory() -> tuple[int, str] | None:
    """The smallest of `memory_limits()`: (bytes, what it is); None where none is known."""
    limits = memory_limits()
    return min(limits, key=lambda item: item[0]) if limits else None


def available_bytes() -> int | None:
    """Bytes this process can still allocate without swapping, being killed or refused: the smallest of
    MemAvailable, the cgroup's headroom and the address-space limit's; None where unknown."""
    limit = limiting_memory()
    return None if limit is None else limit[0]


# Floats each optimizer of the MLPs keeps per parameter beside the weight and its gradient.
DENSE_OPTIMIZER_SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2}
EVAL_BATCH = 8192  # `training.evaluation.evaluate`'s batch (no gradients)


def model_bytes(model: Any, batch_size: int, dense_optimizer: str = "sgd", eval_batch: int = EVAL_BATCH) -> int:
    """Bytes the dense part of a DLRM of `model` (a `ModelConfig`) takes beside its tables: the MLPs'
    weights, gradients and optimizer state, and the per-batch buffers of a training step (activations and
    their gradients, the embeddings' output [batch, tables, dim], the interaction) or of an evaluation batch,
    whichever is larger. An estimate from the shapes, in exact integers: `--bottom-mlp 1000000000,16` is
    priced before torch is asked for it."""
    bottom = [int(model.num_dense), *map(int, model.bottom_mlp)]
    top = [int(model.interaction_dim), *map(int, model.top_mlp)]
    params = sum(a * b + b for widths in (bottom, top) for a, b in zip(widths[:-1], widths[1:], strict=True))
    slots = 2 + DENSE_OPTIMIZER_SLOTS.get(dense_optimizer, 2)
    tables, dim = int(model.num_tables), int(model.embedding_dim)
    # per sample, forward: each layer's output and its ReLU, the tables' rows and pooled output, the stacked
    # vectors, their pairwise products and the interaction
    forward = 2 * (sum(bottom) + sum(top)) + 2 * tables * dim + (tables + 1) * dim + (tables + 1) ** 2
    forward += int(model.interaction_dim)
    per_batch = max(4 * int(batch_size) * 2 * forward, 4 * int(eval_batch) * forward)  # training: + gradients
    return 4 * params * slots + per_batch


def table_bytes(config: EmbeddingConfig, embeddings: str = "cached") -> int:
    """Bytes the tables of `config` will hold in memory once built, computed on the meta device: the
    collection's own accounting (storage in files under `storage_path` left out), or with
    embeddings="torch" fp32 `nn.EmbeddingBag` rows (+ Adagrad's state)."""
    if embeddings != "cached":
        return config.num_rows * config.dim * 4 * (2 if config.optimizer == "adagrad" else 1)
    return config_bytes(config)


def config_bytes(config: EmbeddingConfig) -> int:
    """Bytes of memory a `CachedEmbeddingBagCollection` of `config` will hold (computed on the meta device):
    all of it, less the row storage when that lives in files (`storage_path`)."""
    return _memory_split(config)[0]


def _memory_split(config: EmbeddingConfig) -> tuple[int, int]:
    """(bytes in memory, bytes of row storage in files under config.storage_path)."""
    from slipcache.embedding.collection import CachedEmbeddingBagCollection

    report = CachedEmbeddingBagCollection.estimate_memory(config)
    in_files = 0
    if config.storage_path is not None:
        in_files = sum(report["components"][k] for k in STORAGE_COMPONENTS)
    return int(report["total_bytes"]) - in_files, in_files


def require_storage_room(config: EmbeddingConfig, what: str) -> int:
    """Stop with one line unless the disk under `config.storage_path` has room for the row storage; returns
    its bytes (0 without a storage path)."""
    if config.storage_path is None:
        return 0
    in_files = _memory_split(config)[1]
    line = storage_room_refusal(Path(config.storage_path), in_files, what)
    if line is not None:
        raise SlipcacheError(line)
    return in_files


def storage_room_refusal(directory: Path, in_files: int, what: str) -> str | None:
    """The line that refuses `in_files` bytes of row storage under `directory` (not a directory, or short of
    free space), None when they fit; warns when the directory is on a network file system."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "is a file" if existing == directory else f"lies under the file {existing}"
        return f"--storage-path {directory} {where}; give a directory (new or existing)"
    free = shutil.disk_usage(existing).free
    kind = filesystem_type(existing)
    if kind in NETWORK_FILESYSTEMS:
        logger.warning(f"slipcache: warning: storage path {directory} is on a network file system ({kind}): every "
                       "row the caches lack is read across the network, 10-100x slower than a local disk "
                       "(docs/scale.md)")
    if in_files > free:
        return (f"{what}: the row storage needs {amount(in_files)} on disk under {directory}, which has "
                f"{amount(free)} free; give --storage-path a directory on a disk with room")
    return None


def filesystem_type(path: Path) -> str | None:
    """The type of the file system holding `path` (its longest mount point in /proc/self/mountinfo); None
    where there is no such file."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = str(Path(path).resolve()), "", None
    for line in lines:
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        mount = fields[4]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[fields.index("-") + 1]
    return kind


def what_fits(config: EmbeddingConfig, available: int) -> str:
    """The best precision and cache share whose tables fit `available` (with the runtime's share), as flags."""
    budget = available - RUNTIME_BYTES

    def need(precision: str, share: float) -> int:
        return config_bytes(dataclasses.replace(config, precision=precision, cache_size=share, cache_rows=None))

    for precision, share in FALLBACKS:
        if need(precision, share) <= budget:
            return (
                f"would fit: --precision {precision} --cache-size {share:g} ({need(precision, share) / GB:.1f} GB), "
                f"or per table: slipcache plan --budget-gb {max(budget / GB, 0.1):.1f}"
            )
    return f"nothing fits: even --precision int4 --cache-size 0.01 needs {need('int4', 0.01) / GB:.1f} GB"


def require_tables_fit(
    config: EmbeddingConfig, what: str, *, embeddings: str = "cached", extra_bytes: int = 0,
    available: int | None = None, extra_what: str = "other buffers", extra_advice: str = "make them smaller",
) -> int:
    """Stop with one line (MemoryShortError) unless the tables of `config`, `extra_bytes` of `extra_what`
    and the runtime fit the available memory, and the disk under its storage path has room for the row
    storage; returns the tables' bytes in memory. `what` names the command or path for the message (the
    TorchRec path passes its hashed sizes, max id + 1, at fp32). The row storage in files is mapped into
    the address space: under an address-space limit (`ulimit -v`) it counts too."""
    cached = embeddings == "cached"
    in_files = require_storage_room(config, what) if cached else 0
    need = table_bytes(config, embeddings)
    choice = _describe(config.precision, config.cache_size, config.cache_rows) if cached else "fp32 torch tables"
    require_bytes(need, what=what, config=config, choice=choice, extra_bytes=extra_bytes, available=available,
                  extra_what=extra_what, extra_advice=extra_advice)
    headroom = _address_space_headroom() if in_files and not os.environ.get(ENV_AVAILABLE) else None
    if headroom is not None and need + in_files + extra_bytes + RUNTIME_BYTES > headroom:
        raise MemoryShortError(
            f"{what}: the tables need {(need + in_files) / GB:.1f} GB of address space (rows mapped from "
            f"{config.storage_path}: {in_files / GB:.1f} GB) + {(extra_bytes + RUNTIME_BYTES) / GB:.1f} GB, and "
            f"the address-space limit (ulimit -v) allows {headroom / GB:.1f} GB; raise the limit or use "
            "smaller tables"
        )
    return need


def require_bytes(
    need: int, *, what: str, config: EmbeddingConfig, choice: str, extra_bytes: int = 0,
    available: int | None = None, extra_what: str = "other buffers", extra_advice: str = "make them smaller",
) -> None:
    """Raise MemoryShortError when `need` bytes of tables (+ `extra_bytes` of `extra_what` + the runtime)
    exceed what is available: the smallest of available memory, the cgroup's limit and the address-space
    limit (`memory_limits`)."""
    limit = (available, "available memory") if available is not None else limiting_memory()
    if limit is None:
        return
    available, source = limit
    total = need + extra_bytes + RUNTIME_BYTES
    if total <= available:
        return
    parts = f"tables {need / GB:.1f} GB" + (f" + {extra_what} {extra_bytes / GB:.1f} GB" if extra_bytes else "")
    if extra_bytes + RUNTIME_BYTES > available:  # the tables are not the problem: no precision helps
        advice = f"the {extra_what} alone do not fit: {extra_advice}"
    else:
        advice = what_fits(config, available - extra_bytes)
    where = "" if source == "available memory" else f" ({source})"
    raise MemoryShortError(
        f"{what}: {config.num_rows:,} rows at dim {config.dim} in {choice} need {total / GB:.1f} GB "
        f"({parts} + {RUNTIME_BYTES / GB:.1f} GB runtime), available {available / GB:.1f} GB{where}; {advice}"
    )


def _describe(precision: object, cache_size: object, cache_rows: object) -> str:
    text = precision if isinstance(precision, str) else "per-table precisions"
    if cache_rows:
        return f"{text} + cache of {cache_rows if isinstance(cache_rows, int) else 'per-table'} rows"
    if isinstance(cache_size, (int, float)):
        return f"{text} + {cache_size:g} cache" if cache_size else text
    return f"{text} + per-table caches"


def peak_rss_bytes() -> int:
    """The OS's figure for this process's peak resident memory (ru_maxrss: KB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def process_age_s() -> float:
    """Seconds since this process started (from /proc; since slipcache was imported where there is none)."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # noqa: SIM115
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()
