"""What this process costs the disk and the memory it really owns, from the kernel's own counters.

`disk_io` reads `/proc/self/io`: `read_bytes` counts what the process (all its threads) made the kernel
fetch from the storage device, page faults on a mapped file included, and `write_bytes` what it made dirty
in the page cache for the device to write. Both exclude what the page cache served or absorbed, so they are
what a training run with `--storage-path` costs the disk, where the rows live.

`ru_maxrss` (the peak resident set) counts the pages of a mapped file that are resident, which are page
cache the kernel can drop at any time; the process's own memory is its anonymous resident set, `RssAnon`
in `/proc/self/status`. The kernel keeps no peak of that alone, so `AnonPeak` samples it on a thread.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import NamedTuple

PROC_IO = Path("/proc/self/io")
PROC_STATUS = Path("/proc/self/status")
ANON_SAMPLE_S = 0.05  # sampling interval of the anonymous-memory peak: 20 reads of a 1.5 KB file a second


class DiskIO(NamedTuple):
    """Cumulative bytes read from and written to the storage device on this process's behalf."""

    read_bytes: int
    write_bytes: int

    def __sub__(self, other: DiskIO) -> DiskIO:
        return DiskIO(self.read_bytes - other.read_bytes, self.write_bytes - other.write_bytes)


def disk_io(path: Path = PROC_IO) -> DiskIO | None:
    """This process's disk bytes so far; None where the kernel does not count them (not Linux, no task
    I/O accounting)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return DiskIO(int(fields["read_bytes"]), int(fields["write_bytes"]))
    except (KeyError, ValueError):
        return None


def rss_anon_bytes(path: Path = PROC_STATUS) -> int | None:
    """This process's anonymous resident memory now (RssAnon); None where the kernel does not say."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class AnonPeak:
    """The largest anonymous resident set seen since `start`, sampled every `interval` seconds on a daemon
    thread and at every `peak()` call (a spike shorter than the interval between samples can be missed)."""

    def __init__(self, interval: float = ANON_SAMPLE_S) -> None:
        self.interval = interval
        self._peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now = rss_anon_bytes()
        if now is not None and (self._peak is None or now > self._peak):
            self._peak = now

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> AnonPeak:
        self._sample()
        if self._peak is not None and self._thread is None:  # nothing to watch where RssAnon is unknown
            self._thread = threading.Thread(target=self._watch, name="slipcache-anon-peak", daemon=True)
            self._thread.start()
        return self

    def peak(self) -> int | None:
        """The peak so far (bytes), None where RssAnon is unknown."""
        self._sample()
        return self._peak

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
