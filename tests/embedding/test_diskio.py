"""Disk I/O you can count and random access read as random access: the kernel's counters, the storage map's
advice, the read-ahead of rows, and what a missed row costs the disk."""

import ctypes
import json
import mmap
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from slipcache import iostats, memory
from slipcache.embedding import hostmem
from slipcache.embedding.quant import RowStorage
from slipcache.embedding.readahead import DiskReadahead, row_pages

PAGE = mmap.PAGESIZE
COUNTED = pytest.mark.skipif(iostats.disk_io() is None, reason="the kernel does not count this process's disk bytes")
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
LINUX = pytest.mark.skipif(LIBC is None, reason="mincore, msync and MADV_PAGEOUT as Linux has them")


@pytest.fixture
def on_disk(tmp_path: Path) -> Path:
    """A directory on a block device: tmpfs and overlays in memory read and write no disk bytes."""
    if memory.filesystem_type(tmp_path) in ("tmpfs", "ramfs", "overlay", None):
        pytest.skip("the temporary directory is not on a disk")
    return tmp_path


def _resident(tensor: torch.Tensor, first_page: int, pages: int) -> list[bool]:
    """mincore: which of the tensor's pages are in memory."""
    vec = (ctypes.c_ubyte * pages)()
    address = ctypes.c_void_p(tensor.data_ptr() + first_page * PAGE)
    assert LIBC.mincore(address, ctypes.c_size_t(pages * PAGE), vec) == 0, os.strerror(ctypes.get_errno())
    return [bool(v & 1) for v in vec]


def _evicted(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's (file-backed) pages written back and dropped from memory; skips where the kernel
    cannot (MADV_PAGEOUT is Linux 5.4+; Python names it only where it was built against such headers)."""
    nbytes = tensor.numel() * tensor.element_size()
    pages = -(-nbytes // PAGE)
    LIBC.msync(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), 4)  # MS_SYNC: the pages are clean
    hostmem.advise_pages(tensor, torch.arange(pages), getattr(mmap, "MADV_PAGEOUT", 21))  # Linux's number
    if any(_resident(tensor, 0, pages)):
        pytest.skip("the kernel kept the pages in memory")
    return tensor


@COUNTED
def test_disk_io_counts_the_bytes_read_and_written(on_disk: Path) -> None:
    path, size = on_disk / "data.bin", 4 << 20
    before = iostats.disk_io()
    with open(path, "wb") as fh:
        fh.write(os.urandom(size))
        fh.flush()
        os.fsync(fh.fileno())
    written = iostats.disk_io() - before
    assert written.write_bytes >= size
    with open(path, "rb") as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped from the cache
        before = iostats.disk_io()
        assert len(fh.read()) == size
    assert (iostats.disk_io() - before).read_bytes >= size


def test_disk_io_is_none_where_the_kernel_does_not_count(tmp_path: Path) -> None:
    assert iostats.disk_io(tmp_path / "missing") is None
    (tmp_path / "io").write_text("rchar: 5\nwchar: 1\n")
    assert iostats.disk_io(tmp_path / "io") is None
    (tmp_path / "io").write_text("rchar: 5\nread_bytes: 8192\nwrite_bytes: 4096\n")
    assert iostats.disk_io(tmp_path / "io") == iostats.DiskIO(8192, 4096)


@pytest.mark.skipif(iostats.rss_anon_bytes() is None, reason="no RssAnon in /proc/self/status")
def test_anonymous_peak_sees_memory_that_is_gone_again() -> None:
    peak = iostats.AnonPeak(interval=3600.0).start()  # sampled on the calls alone: no race with the thread
    base = peak.peak()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    during = peak.peak()
    del block
    assert during - base >= 60 << 20
    assert peak.peak() == during  # the peak stays
    peak.stop()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the map holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_the_storage_map_is_advised_random(tmp_path: Path) -> None:
    rows = hostmem.StorageFile(64_000, tmp_path).tensor
    assert "rr" in _vm_flags(rows.data_ptr())  # MADV_RANDOM: no read-around on a fault


def test_row_pages_are_one_or_two_a_row() -> None:
    assert row_pages(torch.tensor([0, 63, 64]), 64).tolist() == [0, 1]
    assert row_pages(torch.tensor([40]), 100).tolist() == [0, 1]  # bytes 4000-4099 straddle two pages
    rows = torch.randint(0, 1 << 20, (500,))
    assert row_pages(rows, 100).numel() <= 2 * rows.unique().numel()


def test_in_a_file_only_the_codes_live_on_disk(tmp_path: Path) -> None:
    storage = RowStorage(1000, 16, "int4", path=str(tmp_path))
    assert storage.in_file and DiskReadahead.wanted(storage)
    assert _vm_flags(storage.payload.data_ptr()) and "rr" in _vm_flags(storage.payload.data_ptr())
    assert "rr" not in _vm_flags(storage.bias.data_ptr())  # parameters in memory: no second page a row
    assert not DiskReadahead.wanted(RowStorage(1000, 16, "int4"))


def test_whole_ranges_reach_a_file_through_pwrite_not_the_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[tuple[int, int]] = []
    write = hostmem.StorageFile.write

    def spy(self: hostmem.StorageFile, offset: int, data: torch.Tensor) -> None:
        writes.append((offset, data.numel() * data.element_size()))
        write(self, offset, data)

    monkeypatch.setattr(hostmem.StorageFile, "write", spy)
    values = torch.randn(300, 10)
    in_ram, in_file = RowStorage(1000, 10, "int4"), RowStorage(1000, 10, "int4", path=str(tmp_path))
    for storage in (in_ram, in_file):
        storage.write_range(500, values, "nearest", None)
    assert writes == [(500 * 5, 300 * 5)]  # int4 at dim 10: 5 bytes a row
    for name, tensor in in_ram.state_dict().items():
        assert torch.equal(tensor, in_file.state_dict()[name]), name


@COUNTED
@LINUX
def test_a_missed_row_reads_at_most_two_pages(on_disk: Path) -> None:
    rows = hostmem.StorageFile(100 << 14, on_disk).tensor.view(1 << 14, 100)  # 1.6 MB, rows straddling pages
    rows.fill_(3)
    _evicted(rows)
    int(rows.new_full((1, 100), 3)[0].sum())  # the code path's own pages in memory first: only the row's count
    before = iostats.disk_io()
    assert int(rows[8000].sum()) == 300
    read = (iostats.disk_io() - before).read_bytes
    assert 0 < read <= 2 * PAGE  # the kernel's read-around for mapped files reads far more


@LINUX
def test_readahead_asks_for_the_pages_of_the_rows_and_no_others(on_disk: Path) -> None:
    storage = RowStorage(1 << 14, 128, "int8", path=str(on_disk))  # 128 bytes a row: 32 rows a page
    storage.payload.fill_(1)
    pages = -(-storage.payload.numel() // PAGE)
    _evicted(storage.payload)
    readahead = DiskReadahead(storage)
    wanted = torch.tensor([5, 40, 41, 9000])  # pages 0, 1, 281
    assert readahead.start(wanted)
    readahead.join()
    deadline = time.monotonic() + 30  # MADV_WILLNEED queues the reads and returns: they land a little later
    while not all(_resident(storage.payload, 0, pages)[p] for p in (0, 1, 281)) and time.monotonic() < deadline:
        time.sleep(0.01)
    resident = _resident(storage.payload, 0, pages)
    assert [p for p in range(pages) if resident[p]] == [0, 1, 281]
    assert readahead.requested_pages == 3


def test_bench_disk_reports_the_rates_and_leaves_nothing(on_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slipcache import cli

    out = on_disk / "disk.json"
    scratch = on_disk / "scratch"
    scratch.mkdir()
    assert cli.main(["bench", "disk", "--dir", str(scratch), "--size-mb", "4", "--reads", "64", "--rounds", "1",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("write_mb_s", "one_at_a_time_reads_s", "at_once_reads_s"):
        assert len(result[key]) == 1 and result[key][0] > 0, key
    if iostats.disk_io() is not None:  # the page cache was dropped: the reads came from the disk
        assert all(read >= 32 * PAGE for read in result["read_bytes_per_measurement"])
    assert "random reads, asked at once" in capsys.readouterr().out
    assert list(scratch.iterdir()) == []


def test_a_storage_path_on_a_network_file_system_is_warned_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipcache.embedding.config import EmbeddingConfig

    config = EmbeddingConfig([1000], dim=16, precision="int4", cache_size=0.1, storage_path=str(tmp_path / "rows"))
    memory.require_storage_room(config, "train")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(memory, "filesystem_type", lambda path: "nfs4")
    memory.require_storage_room(config, "train")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "network file system (nfs4)" in err and str(tmp_path / "rows") in err


@pytest.mark.skipif(not Path("/proc/self/mountinfo").exists(), reason="no /proc/self/mountinfo")
def test_filesystem_type_names_the_root() -> None:
    assert memory.filesystem_type(Path("/")) and memory.filesystem_type(Path("/proc/self")) == "proc"


def test_a_checkpoints_rows_reach_a_file_through_pwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
    from slipcache.training import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "RAW_MIN_BYTES", 1 << 10)  # the codes (28 kB) stored raw, read in 7 chunks
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 1 << 12)
    config = EmbeddingConfig([3000, 500], dim=16, precision="int4", cache_size=0.05, storage_path=str(tmp_path / "a"))
    saved = CachedEmbeddingBagCollection(config)
    path = ckpt.save_checkpoint(tmp_path / "c.pt", {"embeddings": saved.state_dict()})
    fresh = CachedEmbeddingBagCollection(
        EmbeddingConfig([3000, 500], dim=16, precision="int4", cache_size=0.05, storage_path=str(tmp_path / "b")),
        draw_rows=False,
    )
    writes: list[tuple[int, int]] = []
    write = hostmem.StorageFile.write
    monkeypatch.setattr(
        hostmem.StorageFile, "write", lambda self, at, data: writes.append((at, len(data))) or write(self, at, data)
    )
    state = ckpt.load_checkpoint(path, lazy=True)
    ckpt.materialize(state, {"embeddings": fresh.state_dict()}, fresh.storage_files())
    fresh.load_state_dict(state["embeddings"])
    assert writes[:2] == [(0, 1 << 12), (1 << 12, 1 << 12)] and sum(n for _, n in writes) == 3500 * 8
    for name, tensor in saved.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, fresh.state_dict()[name]), name


def test_checkpoints_already_there_count_and_the_next_one_always_needs_room(tmp_path: Path) -> None:
    from slipcache.training import checkpoint as ckpt

    directory = tmp_path / "checkpoints"
    assert ckpt.checkpoints_that_fit(directory, 10, writes=5, keep=2)[0] == 3  # none there yet: keep + 1
    directory.mkdir()
    (directory / "ckpt-000000000064.pt").write_bytes(b"x")
    assert ckpt.checkpoints_that_fit(directory, 10, writes=5, keep=2)[0] == 2
    for samples in (128, 192):
        (directory / f"ckpt-{samples:012d}.pt").write_bytes(b"x")
    assert ckpt.checkpoints_that_fit(directory, 10, writes=5, keep=2)[0] == 1  # more than keep: still the next
    assert ckpt.checkpoints_that_fit(directory, 10, writes=0, keep=2)[0] == 0  # nothing left to write


def test_a_copy_of_rows_in_a_file_writes_its_own_bytes(tmp_path: Path) -> None:
    import copy

    storage = RowStorage(100, 8, "int8", path=str(tmp_path))
    twin = copy.deepcopy(storage)
    assert storage.in_file and not twin.in_file  # the copy holds bytes, not the file's descriptor
    twin.write_range(0, torch.ones(100, 8), "nearest", None)
    assert bool((twin.read(torch.arange(100), torch.device("cpu")) == 1).all())
    assert not bool(storage.payload.any())  # the original's file is untouched
