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
    with pytest.raises(SlipcacheError, match="format version 1 .*reads format version 2"):
        checkpoint.load_checkpoint(old)
    newer = tmp_path / "new.pt"
    checkpoint.save_checkpoint(newer, {"w": torch.ones(2)})
    newer.write_bytes(newer.read_bytes().replace(b"slipcache-checkpoint 2 ", b"slipcache-checkpoint 9 ", 1))
    with pytest.raises(SlipcacheError, match="format version 9 \\(written by a newer slipcache\\).*version 2"):
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
