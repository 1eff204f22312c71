"""Writing the files of a run directory without ever writing through a symbolic link.

A run directory can come from someone else (copied, unpacked, shared). If its `metrics.jsonl` were a link
to `~/.bashrc`, opening it to write would truncate `~/.bashrc`. So every file a run writes is either
replaced atomically (a new file under a temporary name, renamed over the old name: a link there is
replaced by a regular file and its target is never opened) or opened with `O_NOFOLLOW` and checked to be
a regular file with one link before anything is written (`open_fd`: a symbolic or a hard link is refused
in one line). A directory the run writes into (`checkpoints/`, a step of N processes, ...) must not
be a link either: refused in one line, since everything written into it would land elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import TextIO

from slipcache.errors import SlipcacheError


class LinkRefusedError(SlipcacheError):
    """A file or directory the run would write is a link (symbolic, or a hard link's second name)."""


def _refusal(path: Path, kind: str = "file") -> LinkRefusedError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return LinkRefusedError(
        f"{path} is a symbolic link{target}; slipcache never writes a run's {kind} through a link: "
        "remove the link (or copy the run with its links resolved) and run again"
    )


def refuse_link(path: Path, kind: str = "directory") -> None:
    """One line when `path` is a symbolic link (a missing path is fine)."""
    if Path(path).is_symlink():
        raise _refusal(Path(path), kind)


def ensure_dir(path: Path, *, inside: Path | None = None) -> Path:
    """Create directory `path` (parents too) and refuse it, or any directory between `inside` and it, when
    it is a symbolic link: what is written into it must stay where it seems to be."""
    path = Path(path)
    base = inside if inside is not None and path.is_relative_to(inside) else path.parent
    chain = [path, *(p for p in path.parents if p.is_relative_to(base) and p != base)]
    for directory in chain:
        refuse_link(directory)
    path.mkdir(parents=True, exist_ok=True)
    for directory in chain:  # created by someone else meanwhile: checked again
        refuse_link(directory)
    return path


def open_fd(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a file to write in place, that never writes through a link: a symbolic link at `path`
    is not followed, and the file opened must be a regular file with one link (`st_nlink == 1`): a hard
    link's other name may lie outside the run, and writing would change that file too. Both are refused in
    one line, before anything is written (`O_TRUNC` is applied only after the check)."""
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or Path(path).is_symlink():
            raise _refusal(Path(path)) from None
        raise
    try:
        refuse_shared_file(fd, Path(path))
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_shared_file(fd: int, path: Path) -> None:
    """One line unless open file `fd` (at `path`) is a regular file with a single link: the one check every
    file written in place (not replaced by a rename) passes."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise LinkRefusedError(f"{path} is not a regular file; slipcache writes a run's files only as regular files: "
                               "remove it and run again")
    if info.st_nlink != 1:
        raise LinkRefusedError(
            f"{path} has {info.st_nlink} hard links (another name of it may lie outside the run); slipcache never "
            "writes a run's file through a link: remove it (or copy the run without hard links) and run again"
        )


def open_append(path: Path, buffering: int = -1) -> TextIO:
    """A text file opened to append, created if missing; a link is refused."""
    fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return open(fd, "a", buffering=buffering)  # noqa: SIM115 - the caller closes it


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Replace `path` with `data` at once: written under `.<name>.tmp` (created new: never an existing file
    or link) and renamed over `path`, so a reader never sees half a file and a link at `path` is replaced,
    its target untouched. `durable`: fsync before the rename (a crash leaves the old or the new file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # ours, left by a killed process (or a planted link: removed, never followed)
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with open(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def prepare_output_file(path: Path, flag: str) -> Path:
    """Before a command computes: `path` must name a file (not a directory, not a link), and its parent
    directories are created, so the work is not lost to a missing directory at the end."""
    path = Path(path)
    if path.is_symlink():
        raise _refusal(path)
    if path.is_dir():
        raise SlipcacheError(f"{flag} {path} is a directory; name the file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SlipcacheError(f"{flag} {path}: cannot create its directory: {exc.strerror or exc}") from exc
    if not os.access(path.parent, os.W_OK):
        raise SlipcacheError(f"{flag} {path}: its directory {path.parent} is not writable")
    return path
