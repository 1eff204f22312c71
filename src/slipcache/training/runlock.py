"""One writer per run directory: `run.lock`, taken when a run starts and held until its process ends.

Two `train` processes on one run directory interleave metrics.jsonl and delete each other's checkpoint
temporary files; a scheduler that restarts a job whose old copy still runs does exactly that. So a run
takes `<run>/run.lock` before it writes anything: an exclusive `flock` on the file (released by the
kernel when the process dies, however it dies) and, inside it, who holds it: host, PID, start time, run
id and the directory it was taken for.

- held by a live process: refused with `RunLockedError` (exit code 3), naming its host and PID;
- not held, of this host (its process ended: killed, crashed): stale, taken over with one warning line; a
  lock whose recorded directory is not this one was copied along with the run directory (`cp -r`,
  rsync): not ours, taken over and said so;
- of another host for this same directory: refused with how to remove it, flock or not (whether its
  process still runs there cannot be known from here);
- on a filesystem without `flock`: the recorded PID decides on this host (dead: stale).

A run directory of an older slipcache has no lock: the first run of this one takes it as usual.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipcache.errors import RunLockedError
from slipcache.safe_files import open_fd

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


@dataclass
class RunLock:
    """A held lock; `release` (or the process's end) gives it up."""

    path: Path
    fd: int
    owner: dict[str, Any]

    def release(self) -> None:
        """Remove the file while still holding it (a waiter that opened it sees another inode), then unlock."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                self.path.unlink()
        os.close(self.fd)
        self.fd = -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        owner = json.loads(os.read(fd, 65536).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def describe(owner: dict[str, Any]) -> str:
    """'host H, PID P (started T)': who a lock names."""
    started = owner.get("started")
    when = ""
    if isinstance(started, (int, float)):
        when = time.strftime(" (started %Y-%m-%d %H:%M:%S UTC)", time.gmtime(started))
    return f"host {owner.get('host', '?')}, PID {owner.get('pid', '?')}{when}"


def _refuse(run_dir: Path, owner: dict[str, Any], hint: str = "") -> RunLockedError:
    return RunLockedError(
        f"run directory {run_dir} is in use by {describe(owner)}{hint}; "
        "wait for it to end or stop it, or use another --out"
    )


def acquire(run_dir: Path, run_id: str) -> RunLock:
    """Take `run_dir/run.lock` for this process, or raise `RunLockedError` naming the holder."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "run_id": run_id,
          "directory": str(run_dir.resolve())}
    for _ in range(10):  # another process may remove the file between our open and our flock: retry
        fd = open_fd(path, os.O_RDWR | os.O_CREAT)  # a link there is refused: its target is never written
        flock_works = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                owner = _read(fd)
                os.close(fd)
                raise _refuse(run_dir, owner) from None
            flock_works = False  # e.g. a network filesystem without flock: the content decides
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:
            os.close(fd)
            continue
        previous = _read(fd)
        try:
            _judge(run_dir, previous, me, flock_works)
        except RunLockedError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        return RunLock(path, fd, me)
    raise RunLockedError(f"run directory {run_dir}: could not take {LOCK_NAME} (it keeps being replaced)")


def refuse_if_held(run_dir: Path) -> None:
    """`RunLockedError` naming the holder when a live process holds `run_dir/run.lock` (for commands that
    must not touch a run in use). Probing takes the lock for an instant: a run starting in that instant
    is told the directory is in use, as if it had started a moment earlier than the probe."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # none, or a link: not a lock anyone holds
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _refuse(Path(run_dir), _read(fd)) from None
    finally:
        os.close(fd)


def _judge(run_dir: Path, previous: dict[str, Any], me: dict[str, Any], flock_works: bool) -> None:
    """Whether an unheld lock's previous content may be taken over; warns when it was stale or copied."""
    if not previous:
        return
    copied = previous.get("directory") not in (None, me["directory"])
    same_host = previous.get("host") == me["host"]
    pid = previous.get("pid")
    if not copied and not same_host:
        # Whether a process of another machine still runs cannot be known from here (a free flock proves
        # nothing on a filesystem whose locks stay on each client): refused, with the way forward.
        raise _refuse(
            run_dir, previous, f" (another machine; if that process is gone, delete {run_dir / LOCK_NAME})"
        )
    if not flock_works and not copied and isinstance(pid, int) and pid != me["pid"] and _alive(pid):
        raise _refuse(run_dir, previous)
    if copied:
        _warn(f"{run_dir / LOCK_NAME} was copied with the run from {previous.get('directory')} "
              f"({describe(previous)}): not this run's; taking it")
    elif not (same_host and pid == me["pid"]):
        _warn(f"stale {LOCK_NAME} of {describe(previous)} (that process has ended); taking it over")


def _warn(message: str) -> None:
    logger.warning(f"slipcache train: warning: {message}")
