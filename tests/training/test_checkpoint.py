import io
from pathlib import Path

import pytest
import torch

from slipcache.errors import SlipcacheError
from slipcache.training import checkpoint


def test_roundtrip(tmp_path: Path) -> None:
    state = {"w": torch.arange(5.0), "step": 3, "nested": {"rng": torch.get_rng_state()}}
    checkpoint.save_checkpoint(tmp_path / "a.pt", state)
    loaded = checkpoint.load_checkpoint(tmp_path / "a.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert torch.equal(loaded["nested"]["rng"], state["nested"]["rng"])


def test_crash_mid_write_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "latest.pt"
    checkpoint.save_checkpoint(target, {"step": 1, "w": torch.ones(3)})
    real_save = torch.save

    def crashing_save(obj: object, f: object) -> None:
        real_save(obj, f)  # write the complete payload, then die before the rename
        f.write(b"garbage")  # type: ignore[attr-defined]
        raise OSError("disk on fire")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError, match="disk on fire"):
        checkpoint.save_checkpoint(target, {"step": 2, "w": torch.zeros(3)})
    monkeypatch.undo()
    loaded = checkpoint.load_checkpoint(target)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]  # temp file cleaned up


def test_partial_write_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "latest.pt"
    checkpoint.save_checkpoint(target, {"step": 1})

    def half_save(obj: object, f: object) -> None:
        f.write(b"PK\x03\x04 half a zip")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(target, {"step": 2})
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(target)["step"] == 1


def test_missing_and_corrupt(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="not found"):
        checkpoint.load_checkpoint(tmp_path / "nope.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(SlipcacheError, match="corrupt"):
        checkpoint.load_checkpoint(bad)
    good = tmp_path / "good.pt"
    checkpoint.save_checkpoint(good, {"w": torch.randn(100)})
    truncated = tmp_path / "trunc.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(SlipcacheError, match="corrupt"):
        checkpoint.load_checkpoint(truncated)


def test_run_checkpoints_latest_and_rotation(tmp_path: Path) -> None:
    for samples in (100, 200, 300):
        checkpoint.save_run_checkpoint(tmp_path, {"samples": samples}, samples, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000000000200.pt", "ckpt-000000000300.pt", "latest.pt"]
    assert checkpoint.load_checkpoint(tmp_path)["samples"] == 300  # a directory means its latest.pt
    assert checkpoint.load_checkpoint(tmp_path / "ckpt-000000000200.pt")["samples"] == 200


def test_flipped_payload_byte_is_caught_by_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    checkpoint.save_checkpoint(path, {"w": torch.zeros(1000)})
    data = bytearray(path.read_bytes())
    data[-2000] ^= 0x01  # inside the tensor bytes: the unpickler alone would load it without a word
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CorruptCheckpointError, match="checksum mismatch"):
        checkpoint.load_checkpoint(path)
    assert not checkpoint.is_complete(path)


def test_old_newer_and_foreign_files_name_both_versions(tmp_path: Path) -> None:
    old = tmp_path / "old.pt"
    torch.save({"format": "slipcache-checkpoint", "version": 1, "w": torch.ones(2)}, old)  # as v1 wrote them
    with pytest.raises(SlipcacheError, match="format version 1 .*reads format version 3"):
        checkpoint.load_checkpoint(old)
    newer = tmp_path / "new.pt"
    checkpoint.save_checkpoint(newer, {"w": torch.ones(2)})
    newer.write_bytes(newer.read_bytes().replace(b"slipcache-checkpoint 3 ", b"slipcache-checkpoint 9 ", 1))
    with pytest.raises(SlipcacheError, match="format version 9 \\(written by a newer slipcache\\).*version 3"):
        checkpoint.load_checkpoint(newer)
    foreign = tmp_path / "model.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, foreign)
    with pytest.raises(SlipcacheError, match="not a slipcache checkpoint"):
        checkpoint.load_checkpoint(foreign)


def test_complete_checkpoints_skips_damaged_ones(tmp_path: Path) -> None:
    for samples in (100, 200, 300):
        checkpoint.save_run_checkpoint(tmp_path, {"samples": samples}, samples, keep=3)
    newest = tmp_path / "ckpt-000000000300.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # latest.pt is the same file (a hard link) or a copy
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == [
        "ckpt-000000000200.pt",
        "ckpt-000000000100.pt",
    ]


def _write_v2(path: Path, state: dict) -> None:
    """A file as layout version 2 wrote it: header, then one torch payload."""
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    header = f"slipcache-checkpoint 2 sha256 {hashlib.sha256(data).hexdigest()} {len(data)}".encode()
    path.write_bytes(header.ljust(checkpoint.HEADER_BYTES - 1) + b"\n" + data)


def test_layout_2_files_still_load(tmp_path: Path) -> None:
    _write_v2(tmp_path / "old.pt", {"w": torch.arange(4.0), "step": 7})
    loaded = checkpoint.load_checkpoint(tmp_path / "old.pt")
    assert loaded["step"] == 7 and torch.equal(loaded["w"], torch.arange(4.0))
    assert checkpoint.is_complete(tmp_path / "old.pt")


@pytest.fixture
def small_raw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of 1 KB and more stored raw, in 256-byte chunks: the large-table path at a small size."""
    monkeypatch.setattr(checkpoint, "RAW_MIN_BYTES", 1024)
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 256)


def _big_state() -> dict:
    return {
        "embeddings": {"payload": torch.randint(0, 255, (300, 7), dtype=torch.uint8),
                       "bias": torch.randn(600).half(), "weights": torch.randn(40, 16), "step": 3},
        "small": torch.ones(3),
        "list": [torch.arange(1000, dtype=torch.int64), 5],
    }


def test_large_tensors_stream_raw_and_load_into_the_given_buffers(tmp_path: Path, small_raw: None) -> None:
    state = _big_state()
    path = checkpoint.save_checkpoint(tmp_path / "a.pt", state)
    lazy = checkpoint.load_checkpoint(path, lazy=True)
    assert isinstance(lazy["embeddings"]["payload"], checkpoint.RawTensor)  # stored raw, not read yet
    assert isinstance(lazy["small"], torch.Tensor)
    assert checkpoint.tensor_bytes(lazy, checkpoint.RawTensor) == 2100 + 1200 + 2560 + 8000
    targets = {"embeddings": {k: torch.empty_like(v) for k, v in state["embeddings"].items() if k != "step"}}
    loaded = checkpoint.materialize(lazy, targets)
    for key in ("payload", "bias", "weights"):
        assert loaded["embeddings"][key] is targets["embeddings"][key]  # read straight into the buffer
        assert torch.equal(loaded["embeddings"][key], state["embeddings"][key])
    assert torch.equal(loaded["list"][0], state["list"][0]) and loaded["list"][1] == 5
    eager = checkpoint.load_checkpoint(path)
    assert torch.equal(eager["embeddings"]["weights"], state["embeddings"]["weights"])
    assert checkpoint.is_complete(path)


def test_saving_holds_no_second_copy_of_a_large_tensor(
    tmp_path: Path, small_raw: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What torch.save pickles holds only the small tensors; the large ones pass in chunks of CHUNK_BYTES."""
    pickled: list[object] = []
    real_save = torch.save

    def recording_save(obj: object, f: object) -> None:
        pickled.append(obj)
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", recording_save)
    checkpoint.save_checkpoint(tmp_path / "a.pt", _big_state())
    (small,) = pickled
    assert not any(isinstance(v, torch.Tensor) for v in small["embeddings"].values())
    assert isinstance(small["small"], torch.Tensor)

    class Recorder(io.BytesIO):
        sizes: list[int] = []

        def write(self, data: object) -> int:
            self.sizes.append(len(memoryview(data).cast("B")))  # type: ignore[arg-type]
            return super().write(data)  # type: ignore[arg-type]

    raw: list = []
    checkpoint._split_raw(_big_state(), raw)
    checkpoint._write_raw(Recorder(), raw)
    assert len(raw) == 4 and max(Recorder.sizes) == 256  # straight from each tensor, a chunk at a time
    assert sum(Recorder.sizes) == 2100 + 1200 + 2560 + 8000


def test_a_flipped_byte_in_a_large_tensor_is_caught(tmp_path: Path, small_raw: None) -> None:
    path = checkpoint.save_checkpoint(tmp_path / "a.pt", _big_state())
    lazy = checkpoint.load_checkpoint(path, lazy=True)
    offset = lazy["embeddings"]["weights"].offset
    data = bytearray(path.read_bytes())
    data[offset + 100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CorruptCheckpointError, match="checksum mismatch in a tensor of shape \\[40, 16\\]"):
        checkpoint.load_checkpoint(path)
    assert not checkpoint.is_complete(path)
    path.write_bytes(bytes(data[: offset + 50]))  # cut inside the tensors
    with pytest.raises(checkpoint.CorruptCheckpointError, match="corrupt"):
        checkpoint.load_checkpoint(path)


@pytest.mark.usefixtures("private_cache_dir")
def test_a_checkpoint_replaced_while_it_is_read_is_read_as_it_was_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from slipcache.training import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "RAW_MIN_BYTES", 1024)  # these tensors are streamed, as tables of 16 MiB are
    path = tmp_path / "latest.pt"
    first = torch.arange(4096, dtype=torch.float32)
    ckpt.save_checkpoint(path, {"rows": first})
    lazy = ckpt.load_checkpoint(path, lazy=True)
    assert isinstance(lazy["rows"], ckpt.RawTensor)
    ckpt.save_checkpoint(path, {"rows": first + 1})  # a running training renames a newer one over it
    assert torch.equal(ckpt.materialize(lazy)["rows"], first)  # not "checksum mismatch": the bytes are fine
    assert torch.equal(ckpt.load_checkpoint(path)["rows"], first + 1)
    # bytes that are wrong are still called so
    lazy = ckpt.load_checkpoint(path, lazy=True)
    with open(path, "r+b") as fh:
        fh.seek(lazy["rows"].offset + 100)
        fh.write(b"\xff\xff")
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch in a tensor"):
        ckpt.materialize(lazy)

