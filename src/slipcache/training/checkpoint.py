"""Atomic, checksummed, versioned checkpoint files.

A crash (or a full disk, or Ctrl-C) in the middle of writing must never destroy the last good
checkpoint, because that is what `--resume` needs. So every file is written to a temporary name in the
same directory, flushed and fsynced, and only then renamed over the target with `os.replace`, which is
atomic on POSIX and Windows filesystems.

A file is a fixed-size text header, then the `torch.save` payload:

    slipcache-checkpoint <format version> sha256 <hex digest of the payload> <payload bytes>

so flipped or lost bytes are found before anything is unpickled, and a file from another version of
slipcache (or from elsewhere) is named as such instead of failing somewhere inside the loader.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from slipcache.errors import SlipcacheError

LATEST = "latest.pt"
_PERIODIC = re.compile(r"^ckpt-(\d+)\.pt$")
MAGIC = "slipcache-checkpoint"
# Bumped whenever what a checkpoint holds changes (v2: the checksum header); readers accept only their own.
FORMAT_VERSION = 2
HEADER_BYTES = 128


class CorruptCheckpointError(SlipcacheError):
    """The file is missing, truncated or its bytes do not match the checksum it was written with."""


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through (for `torch.save`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write as a RuntimeError; keep the cause

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _header(digest: str, size: int) -> bytes:
    text = f"{MAGIC} {FORMAT_VERSION} sha256 {digest} {size}"
    return text.encode().ljust(HEADER_BYTES - 1) + b"\n"


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable; not possible (or needed) on every platform."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write `state` to `path` atomically: either the old file or the complete new one survives."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_header("0" * 64, 0))  # placeholder until the payload's digest is known
            payload = _HashingWriter(f)
            try:
                torch.save(state, payload)
            except RuntimeError:
                if payload.error is not None:  # e.g. ENOSPC, which torch's zip writer turns into a RuntimeError
                    raise payload.error from None
                raise
            f.seek(0)
            f.write(_header(payload.sha.hexdigest(), payload.size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # Leave no half-written temp file behind; the previous `path` is untouched.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)
    return path


# Temporary names of our own writes: checkpoints (`save_checkpoint`'s mkstemp), the `latest.pt` link
# staging file, and the run directory's JSON files (`rundir.write_json`). A user's `.notes.tmp` is not ours.
_OUR_TEMP = re.compile(
    r"^\.(?:(?:ckpt-\d+|latest|rank-\d+)\.pt\.[A-Za-z0-9_]+\.tmp|latest\.pt\.link|(?:config|summary|manifest)\.json\.tmp)$"
)


def is_partial_write(name: str) -> bool:
    """Whether a file name is the temporary file of one of our atomic writes."""
    return _OUR_TEMP.match(name) is not None


def remove_partial_writes(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files of our writes that a killed process never finished (`.<name>.*.tmp`
    and the link staging file; nobody else's files); call only while holding the run's lock."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if is_partial_write(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def save_run_checkpoint(
    directory: str | os.PathLike[str], state: dict[str, Any], samples: int, keep: int = 2
) -> Path:
    """Write `ckpt-<samples>.pt` and point `latest.pt` at it; keep only the `keep` newest periodic files.

    `latest.pt` is a hard link to the periodic file when the filesystem allows (no second write),
    otherwise a second atomic write.
    """
    directory = Path(directory)
    periodic = save_checkpoint(directory / f"ckpt-{samples:012d}.pt", state)
    latest = directory / LATEST
    tmp_link = directory / f".{LATEST}.link"
    try:
        if tmp_link.exists():
            tmp_link.unlink()
        os.link(periodic, tmp_link)
        os.replace(tmp_link, latest)
        _fsync_dir(directory)
    except OSError:
        save_checkpoint(latest, state)
    periodic_files = sorted(p for p in directory.iterdir() if _PERIODIC.match(p.name))
    for old in periodic_files[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return latest


def _payload(path: Path, data: bytes) -> memoryview:
    """The verified payload of a checkpoint file's bytes; errors name the versions involved."""
    if not data.startswith(MAGIC.encode()):
        raise SlipcacheError(_foreign(path, data))
    fields = data[:HEADER_BYTES].decode("ascii", "replace").split()
    if len(fields) != 5 or fields[2] != "sha256" or not fields[1].isdigit() or not fields[4].isdigit():
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt (damaged header)")
    version = int(fields[1])
    if version != FORMAT_VERSION:
        newer = "a newer" if version > FORMAT_VERSION else "an older"
        raise SlipcacheError(
            f"checkpoint {path} has format version {version} (written by {newer} slipcache); "
            f"this slipcache reads format version {FORMAT_VERSION}"
        )
    payload = memoryview(data)[HEADER_BYTES:]
    if len(payload) != int(fields[4]):
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt (truncated: {len(payload)} of {fields[4]} payload bytes)"
        )
    if hashlib.sha256(payload).hexdigest() != fields[3]:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt (checksum mismatch)")
    return payload


def _foreign(path: Path, data: bytes) -> str:
    """What a file without our header is: an unversioned v1 slipcache checkpoint, or something else."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # not a torch file at all
        return f"{path} is not a slipcache checkpoint (format version {FORMAT_VERSION} expected)"
    if isinstance(state, dict) and state.get("format") == MAGIC:
        return (
            f"checkpoint {path} has format version {state.get('version', 1)} (written by an older slipcache); "
            f"this slipcache reads format version {FORMAT_VERSION}"
        )
    return f"{path} is a torch file but not a slipcache checkpoint (format version {FORMAT_VERSION} expected)"


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; a missing or damaged file is a SlipcacheError.

    The checksum is verified before anything is unpickled, and unpickling uses `weights_only=True`:
    checkpoints hold only tensors and plain Python values, so opening a file from elsewhere cannot
    execute code.
    """
    path = Path(path)
    if path.is_dir():
        path = path / LATEST
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint not found: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is unreadable: {exc.strerror or exc}") from exc
    payload = _payload(path, data)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises many types (IndexError, EOFError, ...) on bad bytes
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__})") from exc
    if not isinstance(state, dict):
        raise SlipcacheError(f"checkpoint {path} does not hold a slipcache state dict")
    return state


def is_complete(path: Path) -> bool:
    """Whether a checkpoint file is whole and matches its checksum (without unpickling it)."""
    try:
        _payload(path, path.read_bytes())
    except (SlipcacheError, OSError):
        return False
    return True


def complete_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The periodic checkpoints of a run's `checkpoints/` directory that verify, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    periodic = sorted((p for p in directory.iterdir() if _PERIODIC.match(p.name)), reverse=True)
    return [p for p in periodic if is_complete(p)]
