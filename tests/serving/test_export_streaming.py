"""`slipcache export` streams: one chunk of rows in fp32 at a time, files equal to what `torch.save` of the
whole tables wrote, written beside `--out` and renamed into place (an interrupted export leaves no trace)."""

import io
import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from slipcache import cli, export
from slipcache.errors import SlipcacheError
from slipcache.torchfile import ALIGNMENT, TensorSlot, TorchFileWriter
from slipcache.training import trainer as train
from tests.helpers import make_dataset, tiny_config

SIZES = [300, 7, 50] + [5] * 23  # the first table spans several chunks when a chunk is 64 rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export_streaming")
    data = make_dataset(root / "data", n=600, sizes=SIZES)
    config = tiny_config(data, root / "run", embeddings="cached", precision="int4", cache_size=0.1, epochs=1)
    train.train(config)
    return root / "run"


def _whole_table_files(tables: list[torch.Tensor]) -> dict[str, object]:
    """What the earlier export torch.saved: every table whole, in each format's structure."""
    return {
        "fp32": {export.table_name(t): {"weight": w} for t, w in enumerate(tables)},
        "torchrec": {f"embedding_bags.{export.table_name(t)}.weight": w for t, w in enumerate(tables)},
        "int8": {export.table_name(t): export.quantize_rowwise_int8(w) for t, w in enumerate(tables)},
        "tbe-int8": [export.quantize_tbe_int8(w) for w in tables],
    }


def _assert_same(got: object, want: object) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    else:
        assert got == want


def test_streamed_files_equal_torch_save_of_the_whole_tables(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "CHUNK_BYTES", 64 * 8 * 4)  # 64 rows of dim 8: the first table in 5 chunks
    out = tmp_path / "out"
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    expected = _whole_table_files(export.load_tables(run_dir))
    for fmt, want in expected.items():
        path = out / export.FILES[fmt]
        _assert_same(torch.load(path, weights_only=True), want)
        _assert_same(torch.load(path, weights_only=True, mmap=True), want)
        buffer = io.BytesIO()
        torch.save(want, buffer)
        pickled = zipfile.ZipFile(buffer).read(f"{zipfile.ZipFile(buffer).namelist()[0].split('/')[0]}/data.pkl")
        assert zipfile.ZipFile(path).read("archive/data.pkl") == pickled  # the very structure torch writes
        assert path.stat().st_size <= export.file_bytes(fmt, SIZES, 8)  # what check_room asks the disk for
    assert [t["num_embeddings"] for t in json.loads((out / "tables.json").read_text())] == SIZES


def test_export_holds_at_most_one_chunk_of_rows_in_fp32(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipcache.embedding.collection import CachedEmbeddingBagCollection

    monkeypatch.setattr(export, "CHUNK_BYTES", 64 * 8 * 4)
    monkeypatch.setattr(CachedEmbeddingBagCollection, "export_tables", lambda self: pytest.fail("whole tables read"))
    reads: list[int] = []
    original = CachedEmbeddingBagCollection.read_rows

    def counting(self: CachedEmbeddingBagCollection, rows: torch.Tensor) -> torch.Tensor:
        reads.append(rows.numel())
        return original(self, rows)

    monkeypatch.setattr(CachedEmbeddingBagCollection, "read_rows", counting)
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    assert max(reads) == 64 and sum(reads) == sum(SIZES)  # every row read once, never more than a chunk at once
    assert len(reads) == 5 + len(SIZES) - 1  # one pass over the tables serves all four formats


def test_an_interrupted_export_leaves_the_destination_as_it_was(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert, calls = export._convert, []

    def interrupted(fmt: str, chunk: torch.Tensor) -> list[torch.Tensor]:
        calls.append(fmt)
        if len(calls) == 30:  # mid-way: some files half written
            raise KeyboardInterrupt
        return convert(fmt, chunk)

    monkeypatch.setattr(export, "_convert", interrupted)
    new = tmp_path / "new"
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(new)]) not in (0, None)  # Ctrl-C
    assert len(calls) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the destination nor a temporary

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "embedding_bags.pt").write_text("the previous export")
    calls.clear()
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(kept), "--force"]) not in (0, None)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert [p.name for p in kept.iterdir()] == ["embedding_bags.pt"]
    assert (kept / "embedding_bags.pt").read_text() == "the previous export"


def test_a_non_empty_out_is_refused_unless_force(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(out), "--format", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not empty" in err and "--force" in err and len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(out), "--format", "int8", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fbgemm_int8.pt", "model.json", "model.pt", "tables.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the replaced contents are gone too
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(empty), "--format", "int8"]) == 0
    assert (empty / "fbgemm_int8.pt").is_file()


def test_disk_check_counts_each_format(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    rows = sum(SIZES)
    int8 = export.file_bytes("int8", SIZES, 8)
    assert rows * 16 < int8 < rows * 16 + 64 * 1024 * 2 and export.file_bytes("fp32", SIZES, 8) > rows * 32
    usage = namedtuple("usage", "total used free")
    free = max(int8, export.file_bytes("tbe-int8", SIZES, 8))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, free))
    export.check_room(run_dir, tmp_path / "out", ("int8",))  # fits
    with pytest.raises(SlipcacheError, match=r"^export: int8, tbe-int8 of .* \(int8 .*, tbe-int8 .* GB\).*"
                       r"alone, (--format \w+ or )*--format int8 or --format tbe-int8 fits, or choose another --out$"):
        export.check_room(run_dir, tmp_path / "out", ("int8", "tbe-int8"))


def _data_offsets(path: Path) -> dict[str, int]:
    """Where each record's bytes start (after its local header and extra field)."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            offsets[info.filename] = info.header_offset + 30 + name_len + extra_len
    return offsets


def test_torch_file_records_are_aligned_and_slots_must_be_complete(tmp_path: Path) -> None:
    a, b = torch.randn(5, 3), torch.arange(22, dtype=torch.uint8).view(2, 11)
    slots = [TensorSlot(torch.float32, (5, 3)), TensorSlot(torch.uint8, (2, 11)), TensorSlot(torch.float32, (0, 3))]
    with TorchFileWriter(tmp_path / "f.pt", {"a": slots[0], "b": [slots[1], slots[2]]}) as out:
        out.write(slots[0], a[:4])
        out.write(slots[0], a[4:])
        with pytest.raises(ValueError, match="in order"):
            out.write(slots[0], a[:1])
        out.write(slots[1], b)
    got = torch.load(tmp_path / "f.pt", weights_only=True, mmap=True)
    assert torch.equal(got["a"], a) and torch.equal(got["b"][0], b) and got["b"][1].shape == (0, 3)
    data = {k: v for k, v in _data_offsets(tmp_path / "f.pt").items() if "/data/" in k}
    assert len(data) == 3 and all(offset % ALIGNMENT == 0 for offset in data.values())

    short = TensorSlot(torch.float32, (5, 3))
    with pytest.raises(ValueError, match="not written completely"), TorchFileWriter(tmp_path / "g.pt", [short]) as out:
        out.write(short, a[:2])
