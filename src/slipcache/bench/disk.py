"""`slipcache bench disk --dir DIR`: what the disk under `--storage-path` can give training, measured.

Training with the rows on disk reads one page per row the cache and the page cache both lack. How fast the
disk serves such reads bounds the steps: at R random page reads a second and m rows read from disk per
sample, no run goes faster than R / m samples a second. This probe measures R in the two ways training
reads, on a scratch file in DIR (unlinked at once; nothing is left), written first:

- sequential write: the file written in 8 MiB blocks and synced (what creating the tables costs the disk);
- random reads one at a time: 4 KiB `pread`s at random pages, each waiting for the one before (a page fault
  in the step: what a miss costs when nothing read it ahead);
- random reads asked at once: `madvise(MADV_WILLNEED)` on the same number of random pages of the mapped
  file, then each touched (what the read-ahead of the next batches gets, the disk serving many at once).

Each page-cache copy is dropped before the reads (`posix_fadvise(DONTNEED)` on the synced file), so the
reads are the disk's, as `/proc/self/io` confirms (printed beside).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from slipcache.bench.figures import median_range, write_result
from slipcache.embedding.hostmem import advise_pages
from slipcache.errors import SlipcacheError
from slipcache.iostats import disk_io

PAGE = mmap.PAGESIZE
BLOCK = 8 << 20


def add_disk_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="a directory on the disk to measure (e.g. the --storage-path)")
    parser.add_argument("--size-mb", type=int, default=1024, help="scratch file size in MB (default 1024)")
    parser.add_argument("--reads", type=int, default=4000, help="random page reads per measurement (default 4000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--json", help="also write the figures to this JSON file")


def _drop(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write(fd: int, size: int) -> float:
    """Seconds to write `size` bytes sequentially and sync them."""
    block = os.urandom(min(BLOCK, size))
    start = time.perf_counter()
    written = 0
    while written < size:
        written += os.pwrite(fd, block[: size - written], written)
    os.fsync(fd)
    return time.perf_counter() - start


def _one_at_a_time(fd: int, pages: list[int]) -> float:
    start = time.perf_counter()
    for page in pages:
        os.pread(fd, PAGE, page * PAGE)
    return time.perf_counter() - start


def _asked_at_once(region: mmap.mmap, pages: list[int]) -> float:
    view = torch.frombuffer(region, dtype=torch.uint8)
    wanted = torch.tensor(sorted(set(pages)), dtype=torch.int64)
    start = time.perf_counter()
    advise_pages(view, wanted)
    view[wanted * PAGE].sum()  # touch each page: waits for the reads still in flight
    elapsed = time.perf_counter() - start
    del view
    return elapsed


def run_disk_bench(args: argparse.Namespace) -> int:
    if args.size_mb < 1 or args.reads < 1 or args.rounds < 1:
        raise SlipcacheError("--size-mb, --reads and --rounds must be positive")
    directory = Path(args.dir)
    if not directory.is_dir():
        raise SlipcacheError(f"bench disk: {directory} is not a directory")
    size = args.size_mb << 20
    pages_in_file = size // PAGE
    fd, name = tempfile.mkstemp(prefix="slipcache-bench-disk-", dir=directory)
    os.unlink(name)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a pread reads its page alone, as a fault on the map does
    rng = random.Random(0)
    figures: dict[str, list[float]] = {"write_mb_s": [], "one_at_a_time_reads_s": [], "at_once_reads_s": []}
    read_bytes: list[int] = []
    load_before = os.getloadavg()[0]
    try:
        for _ in range(args.rounds):
            figures["write_mb_s"].append(size / 1e6 / _write(fd, size))
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as region:  # read and write: torch wants a writable buffer
                region.madvise(mmap.MADV_RANDOM)
                for key, read in (("one_at_a_time_reads_s", lambda p: _one_at_a_time(fd, p)),
                                  ("at_once_reads_s", lambda p: _asked_at_once(region, p))):
                    pages = rng.sample(range(pages_in_file), min(args.reads, pages_in_file))
                    _drop(fd)
                    before = disk_io()
                    figures[key].append(len(pages) / read(pages))
                    after = disk_io()
                    if before is not None and after is not None:
                        read_bytes.append((after - before).read_bytes)
    finally:
        os.close(fd)
    load_after = os.getloadavg()[0]
    result: dict[str, Any] = {
        "dir": str(directory), "size_mb": args.size_mb, "reads": args.reads, "rounds": args.rounds,
        "load_average": [load_before, load_after], "read_bytes_per_measurement": read_bytes, **figures,
    }
    print(f"disk under {directory}: {args.rounds} rounds, {args.size_mb} MB file, {args.reads} random 4 KiB reads "
          f"each, load average {load_before:.1f} -> {load_after:.1f}")
    for key, label, unit in (("write_mb_s", "sequential write (synced)", "MB/s"),
                             ("one_at_a_time_reads_s", "random reads, one at a time", "reads/s"),
                             ("at_once_reads_s", "random reads, asked at once", "reads/s")):
        values = figures[key]
        print(f"  {label:<30} {median_range(values, unit, ',.0f', 10)}")
    if read_bytes:
        print(f"  disk bytes read per measurement (/proc/self/io): {min(read_bytes):,}-{max(read_bytes):,} "
              f"for {args.reads:,} pages of {PAGE:,} bytes")
    write_result(args.json, result)
    return 0
