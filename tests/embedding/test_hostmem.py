"""Huge pages for the collection's big tensors: the mode, the fallback, the pages themselves, the release."""

import argparse
import gc
import mmap
from pathlib import Path

import pytest
import torch

from slipcache import options
from slipcache.embedding import hostmem
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.errors import SlipcacheError

THP = pytest.mark.skipif(not hostmem.huge_pages_available(), reason="no transparent huge pages here")


def _ranges(address: int, nbytes: int) -> list[dict[str, int]]:
    """The smaps entries (start, end, AnonHugePages in bytes) of the maps overlapping [address, +nbytes)."""
    found, current = [], None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(v, 16) for v in head[0].split("-"))
                overlaps = start < address + nbytes and end > address
                current = {"start": start, "end": end, "huge": 0} if overlaps else None
                if current:
                    found.append(current)
            elif current is not None and head[0] == "AnonHugePages:":
                current["huge"] = int(head[1]) * 1024
    return found


def test_the_mode_is_a_setting_of_the_tables_checked_where_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """No environment variable or process-wide switch: the mode travels with the config that allocates."""
    assert EmbeddingConfig([10]).huge_pages == "off"
    with pytest.raises(ValueError, match="huge_pages must be one of off, on, auto"):
        EmbeddingConfig([10], huge_pages="big")
    with pytest.raises(SlipcacheError, match="huge pages must be one of"):
        hostmem.uses_huge_pages(1 << 30, torch.device("cpu"), "big")
    monkeypatch.setenv("SLIPCACHE_HUGE_PAGES", "on")  # the variable of old: no longer read
    monkeypatch.setattr(hostmem, "thp_setting", lambda path=None: "madvise")
    monkeypatch.setattr(hostmem, "huge_page_map", lambda nbytes: pytest.fail("mapped although the mode is off"))
    assert hostmem.host_zeros((1 << 22,), torch.float32).shape == (1 << 22,)


def test_kernel_setting_is_the_bracketed_word(tmp_path: Path) -> None:
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hostmem.thp_setting(path) in ("madvise", None)  # None off Linux
    path.write_text("always madvise [never]\n")
    assert hostmem.thp_setting(path) in ("never", None)
    assert hostmem.thp_setting(tmp_path / "missing") is None


def test_without_huge_pages_every_mode_allocates_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmem, "thp_setting", lambda path=None: "never")

    def no_map(nbytes: int) -> torch.Tensor:
        raise AssertionError("mapped although huge pages are unavailable")

    monkeypatch.setattr(hostmem, "huge_page_map", no_map)
    zeros = hostmem.host_zeros((1 << 20,), torch.float32, huge_pages="on")
    assert zeros.shape == (1 << 20,) and not zeros.any()
    assert hostmem.host_empty((3, 1 << 20), torch.uint8, huge_pages="on").shape == (3, 1 << 20)


def test_auto_and_off_leave_small_tables_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostmem, "thp_setting", lambda path=None: "madvise")
    cpu = torch.device("cpu")
    assert not hostmem.uses_huge_pages(1 << 34, cpu, "off")
    assert not hostmem.uses_huge_pages(hostmem.AUTO_MIN_BYTES - 1, cpu, "auto")
    assert hostmem.uses_huge_pages(hostmem.AUTO_MIN_BYTES, cpu, "auto")
    assert hostmem.uses_huge_pages(hostmem.HUGE_PAGE, cpu, "on")
    assert not hostmem.uses_huge_pages(hostmem.HUGE_PAGE - 1, cpu, "on")
    assert not hostmem.uses_huge_pages(1 << 34, torch.device("meta"), "on")


@THP
def test_tensor_is_backed_by_huge_pages_and_released_with_it() -> None:
    nbytes = 3 * hostmem.HUGE_PAGE + 4096 * 5  # three whole huge pages and a partial one
    tensor = hostmem.host_zeros((nbytes // 4,), torch.float32, huge_pages="on")
    address = tensor.data_ptr()
    assert address % hostmem.HUGE_PAGE == 0 and not tensor.any()
    tensor.fill_(1.5)
    maps = _ranges(address, nbytes)
    assert sum(m["huge"] for m in maps) == 3 * hostmem.HUGE_PAGE  # the partial one stays in 4 KiB pages
    view = tensor[10:20]
    del tensor
    gc.collect()
    assert _ranges(address, 1) and float(view[0]) == 1.5  # a view keeps the map
    del view
    gc.collect()
    assert not [m for m in _ranges(address, nbytes) if m["start"] == address]


@THP
def test_collection_on_huge_pages_trains_bit_for_bit_as_without() -> None:
    """Storage, cache and optimizer state on huge pages (storage over 2 MiB); same rows after training."""
    states = []
    for mode in ("off", "on"):
        config = EmbeddingConfig([30_000, 20_000, 50], dim=64, precision="int8", cache_size=0.05,
                                 optimizer="rowwise_adagrad", huge_pages=mode)
        coll = CachedEmbeddingBagCollection(config)
        if mode == "on":
            payload = coll.storage.payload
            assert payload.data_ptr() % hostmem.HUGE_PAGE == 0
            assert sum(m["huge"] for m in _ranges(payload.data_ptr(), payload.numel())) >= hostmem.HUGE_PAGE
        generator = torch.Generator().manual_seed(1)
        for _ in range(5):
            ids = torch.stack([torch.randint(0, n, (128,), generator=generator) for n in config.table_sizes], 1)
            coll(ids).square().sum().backward()
        states.append(coll.state_dict())
        assert coll.memory_report()["total_bytes"] == CachedEmbeddingBagCollection.estimate_memory(config)[
            "total_bytes"
        ]
    for name, tensor in states[0].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, states[1][name]), name


def test_the_flag_takes_the_modes() -> None:
    parser = argparse.ArgumentParser()
    options.add_huge_pages_flag(parser)
    assert parser.parse_args([]).huge_pages == "off"
    assert parser.parse_args(["--huge-pages", "auto"]).huge_pages == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--huge-pages", "yes"])


def _mapped_from(address: int) -> str:
    """The file (or [anon] tag) of the map holding `address`, as /proc/self/maps names it."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            start, end = (int(v, 16) for v in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_file_backed_rows_live_in_an_unnamed_file_in_the_directory(tmp_path: Path) -> None:
    rows = hostmem.StorageFile(16_000, tmp_path / "rows").tensor.view(1000, 16)
    assert not rows.any()
    rows[7] = 9
    assert int(rows[7, 3]) == 9 and rows.sum() == 9 * 16
    assert list((tmp_path / "rows").iterdir()) == []  # unlinked at once: nothing left whatever happens
    assert _mapped_from(rows.data_ptr()).startswith(str(tmp_path / "rows"))


def test_bytes_written_to_a_storage_file_show_in_its_map(tmp_path: Path) -> None:
    file = hostmem.StorageFile(3 * mmap.PAGESIZE, tmp_path)
    file.tensor[:10] = 1
    file.write(mmap.PAGESIZE - 2, torch.arange(5, dtype=torch.int16))  # 10 bytes across a page boundary
    assert file.tensor[:10].tolist() == [1] * 10  # bytes before the offset are kept
    shown = file.tensor[mmap.PAGESIZE - 2 : mmap.PAGESIZE + 8].view(torch.int16)
    assert shown.tolist() == [0, 1, 2, 3, 4]
    assert file.holds(file.tensor[5:]) and not file.holds(file.tensor.clone())
    assert not hostmem.StorageFile(0, tmp_path).holds(torch.empty(0))


def test_file_backed_rows_that_do_not_fit_the_disk_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hostmem.os, "posix_fallocate", full)
    with pytest.raises(SlipcacheError, match="do not fit the .* GB free there"):
        hostmem.StorageFile(4 << 20, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_collection_with_a_storage_path_trains_bit_for_bit_as_in_memory(tmp_path: Path) -> None:
    states = []
    for path in (None, str(tmp_path / "rows")):
        config = EmbeddingConfig([3000, 200, 50], dim=16, precision=["int4", "int8", "int4"], cache_size=0.05,
                                 storage_path=path)
        coll = CachedEmbeddingBagCollection(config)
        generator = torch.Generator().manual_seed(1)
        batches = [torch.stack([torch.randint(0, n, (128,), generator=generator) for n in config.table_sizes], 1)
                   for _ in range(5)]
        for step, ids in enumerate(batches):
            coll.set_lookahead(batches[step + 1 : step + 3])  # in a file: the rows are read ahead
            coll(ids).square().sum().backward()
        readahead = coll.prefetcher.readahead
        if readahead is not None:
            readahead.join()  # its requests run in the background: on a loaded machine the last may not have run
        assert (readahead is not None and readahead.requested_pages > 0) is bool(path)
        states.append(coll.state_dict())
        codes = [b for n, b in coll.named_buffers() if n.endswith("payload")]
        assert codes and all(_mapped_from(b.data_ptr()).startswith(str(tmp_path)) is bool(path) for b in codes)
        params = [b for n, b in coll.named_buffers() if n.endswith(("bias", "scale_code"))]
        assert params and not any(_mapped_from(b.data_ptr()).startswith(str(tmp_path)) for b in params)
    for name, tensor in states[0].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, states[1][name]), name
    assert list((tmp_path / "rows").iterdir()) == []


def test_read_ahead_asks_for_the_pages_of_the_bytes_within_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(hostmem, "_MADVISE", lambda address, length, advice: calls.append((address, length, advice)))
    rows = hostmem.StorageFile(5 * 4096, tmp_path).tensor  # 5 pages
    base, page = rows.data_ptr(), 4096
    assert hostmem.read_ahead(rows, page + 10, 100)
    assert calls[-1][:2] == (base + page, 110)  # from the page holding the first byte
    assert hostmem.read_ahead(rows, 3 * page, 10 * page)  # clipped at the tensor's end
    assert calls[-1][:2] == (base + 3 * page, 2 * page)
    assert not hostmem.read_ahead(rows, 5 * page, page)  # nothing left: no call
    assert len(calls) == 2
    monkeypatch.setattr(hostmem, "READ_AHEAD_PIECE", 2 * page)  # the kernel reads one window per call
    hostmem.read_ahead(rows, 0, 5 * page)
    assert [c[:2] for c in calls[2:]] == [(base, 2 * page), (base + 2 * page, 2 * page), (base + 4 * page, page)]


def test_a_checkpoint_of_rows_on_disk_reads_each_chunk_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache.training import checkpoint as ckpt

    asked: list[tuple[int, int]] = []
    real = ckpt.read_ahead
    monkeypatch.setattr(
        ckpt, "read_ahead", lambda t, start, length: asked.append((start, length)) or real(t, start, length)
    )
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(ckpt, "RAW_MIN_BYTES", 1 << 20)
    rows = hostmem.StorageFile(2 << 20, tmp_path / "rows").tensor.view(torch.int32)  # stored raw, in 32 chunks
    rows.copy_(torch.arange(1 << 19, dtype=torch.int32))
    path = ckpt.save_checkpoint(tmp_path / "ckpt.pt", {"rows": rows})
    assert asked[:3] == [(0, 1 << 16), (1 << 16, 1 << 16), (2 << 16, 1 << 16)]
    assert len(asked) == 33  # the first chunk, then the one after each chunk written
    assert torch.equal(ckpt.load_checkpoint(path)["rows"], rows)
