"""Atomic checkpoint files.

A crash (or a full disk, or Ctrl-C) in the middle of writing must never destroy the last good
checkpoint, because that is what `--resume` needs. So every file is written to a temporary name in the
same directory, flushed and fsynced, and only then renamed over the target with `os.replace`, which is
atomic on POSIX and Windows filesystems.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from slipcache.errors import SlipcacheError

LATEST = "latest.pt"
_PERIODIC = re.compile(r"^ckpt-(\d+)\.pt$")


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
            torch.save(state, f)
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


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; a missing or damaged file is a SlipcacheError.

    Loads with `weights_only=True`: checkpoints hold only tensors and plain Python values, and this way
    opening a file from elsewhere cannot execute code.
    """
    path = Path(path)
    if path.is_dir():
        path = path / LATEST
    if not path.is_file():
        raise SlipcacheError(f"checkpoint not found: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read()
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises many types (IndexError, EOFError, ...) on bad bytes
        raise SlipcacheError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__})") from exc
    if not isinstance(state, dict):
        raise SlipcacheError(f"checkpoint {path} does not hold a slipcache state dict")
    return state
