"""Atomic, checksummed, versioned checkpoint files, written and read streaming.

A crash (or a full disk, or Ctrl-C) in the middle of writing must never destroy the last good
checkpoint, because that is what `--resume` needs. So every file is written to a temporary name in the
same directory, flushed and fsynced, and only then renamed over the target with `os.replace`, which is
atomic on POSIX and Windows filesystems.

A file (layout version 3) is a fixed-size text header, the bytes of every large tensor as they lie in
memory, then the `torch.save` payload of everything else, where each large tensor is a small record (dtype,
shape, offset, its own sha256):

    slipcache-checkpoint 3 sha256 <hex digest of the payload> <payload bytes> <payload offset>

Large tensors (the tables: gigabytes) are hashed while they are written and while they are read, a chunk at
a time, straight between the tensor's memory and the file: neither saving nor loading holds a second copy.
`load_checkpoint(lazy=True)` leaves them as `RawTensor` records that `materialize` reads into the model's
own buffers. Flipped or lost bytes are found before anything is used; a file from another version of
slipcache (or from elsewhere) is named as such. Layout version 2 (one checksummed torch payload) still loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import math
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch import Tensor

from slipcache.embedding.hostmem import StorageFile, read_ahead
from slipcache.errors import SlipcacheError

LATEST = "latest.pt"
_PERIODIC = re.compile(r"^ckpt-(\d+)\.pt$")
# A checkpoint of N processes is a step directory, complete once its manifest (written last) is there; what
# the directory holds is `slipcache.distributed.checkpoint`'s format.
STEP_DIR = re.compile(r"^step-(\d+)$")
STEP_MANIFEST = "manifest.json"
MAGIC = "slipcache-checkpoint"
# Bumped whenever what a training state holds changes (run_state records it; readers accept only their own).
FORMAT_VERSION = 2
# The file layout: 2, one checksummed torch payload; 3, large tensors stored raw before it (read: both).
FILE_VERSION = 3
READABLE_FILE_VERSIONS = (2, 3)
HEADER_BYTES = 128
RAW_MIN_BYTES = 1 << 24  # tensors at least this large are stored raw (streamed, hashed on their own)
CHUNK_BYTES = 1 << 26  # what passes between a tensor and the file at once
_RAW_KEY = "__slipcache_raw_tensor__"


class CorruptCheckpointError(SlipcacheError):
    """The file is missing, truncated or its bytes do not match the checksum it was written with."""


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through (for `torch.save`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write as a RuntimeError; keep the cause

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _header(digest: str, size: int, offset: int = HEADER_BYTES) -> bytes:
    text = f"{MAGIC} {FILE_VERSION} sha256 {digest} {size} {offset}"
    return text.encode().ljust(HEADER_BYTES - 1) + b"\n"


@dataclass
class RawTensor:
    """A large tensor of a checkpoint file, not read yet: `materialize` reads it (and checks its digest)."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    sha256: str
    # The file as opened when its payload was verified, never the name again: a checkpoint renamed over it
    # meanwhile (a run writing `latest.pt` as `eval` reads it) changes nothing read; a mismatch is bad bytes.
    source: BinaryIO | None = dataclasses.field(default=None, repr=False, compare=False)


def _bytes_of(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _split_raw(obj: Any, raw: list[tuple[Tensor, dict[str, Any]]]) -> Any:
    """`obj` with every large CPU tensor replaced by a record (filled in once its bytes are written)."""
    if isinstance(obj, Tensor):
        large = obj.numel() * obj.element_size() >= RAW_MIN_BYTES
        if obj.device.type == "cpu" and large and obj.layout == torch.strided:
            record: dict[str, Any] = {_RAW_KEY: True, "dtype": str(obj.dtype).removeprefix("torch."),
                                      "shape": list(obj.shape)}
            raw.append((obj, record))
            return record
        return obj
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = _split_raw(value, raw)
        if hasattr(obj, "_metadata"):  # a module state_dict's per-module versions
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_split_raw(v, raw) for v in obj)
    return obj


def _write_raw(f: BinaryIO, raw: list[tuple[Tensor, dict[str, Any]]]) -> None:
    """Each large tensor's bytes, a chunk at a time, hashed on the way; its record gets offset and digest."""
    for tensor, record in raw:
        source = tensor.detach().contiguous()
        data = _bytes_of(source)
        sha = hashlib.sha256()
        record["offset"] = f.tell()
        read_ahead(source, 0, CHUNK_BYTES)
        for start in range(0, len(data), CHUNK_BYTES):
            read_ahead(source, start + CHUNK_BYTES, CHUNK_BYTES)  # rows on disk: the next chunk streams meanwhile
            chunk = data[start : start + CHUNK_BYTES]
            sha.update(chunk)
            f.write(chunk)
        record["nbytes"], record["sha256"] = len(data), sha.hexdigest()


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
            f.write(_header("0" * 64, 0))  # placeholder until the payload's digest is known
            raw: list[tuple[Tensor, dict[str, Any]]] = []
            small = _split_raw(state, raw)
            _write_raw(f, raw)
            offset = f.tell()
            payload = _HashingWriter(f)
            try:
                torch.save(small, cast(BinaryIO, payload))  # a file to torch: it only writes and flushes
            except RuntimeError:
                if payload.error is not None:  # e.g. ENOSPC, which torch's zip writer turns into a RuntimeError
                    raise payload.error from None
                raise
            f.seek(0)
            f.write(_header(payload.sha.hexdigest(), payload.size, offset))
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


# Temporary names of our own writes: checkpoints (`save_checkpoint`'s mkstemp), the `latest.pt` link
# staging file, and the run directory's files (`safe_files.write_atomic`). A user's `.notes.tmp` is not ours.
_OUR_TEMP = re.compile(
    r"^\.(?:(?:ckpt-\d+|latest|rank-\d+)\.pt\.[A-Za-z0-9_]+\.tmp|latest\.pt\.link"
    r"|(?:(?:config|summary|manifest|plan)\.json|metrics\.jsonl|report\.md|[a-z_]+\.png)\.tmp)$"
)


def is_partial_write(name: str) -> bool:
    """Whether a file name is the temporary file of one of our atomic writes."""
    return _OUR_TEMP.match(name) is not None


def remove_partial_writes(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files of our writes that a killed process never finished (`.<name>.*.tmp`
    and the link staging file; nobody else's files); call only while holding the run's lock."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if is_partial_write(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


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
        tmp_link.unlink(missing_ok=True)
        os.link(periodic, tmp_link)
        os.replace(tmp_link, latest)
        _fsync_dir(directory)
    except OSError:
        save_checkpoint(latest, state)
    periodic_files = sorted(p for p in directory.iterdir() if _PERIODIC.match(p.name))
    for old in periodic_files[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return latest


def tensor_bytes(obj: Any, kind: type[Tensor] | type[RawTensor] = Tensor) -> int:
    """Bytes of every `kind` in a nested state: of Tensor, what a checkpoint of it holds (less its small
    payload); of RawTensor, what `materialize` will read of a lazy one."""
    if isinstance(obj, kind):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, kind) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, kind) for v in obj)
    return 0


def checkpoints_that_fit(directory: Path, checkpoint_bytes: int, writes: int, keep: int) -> tuple[int, int, int]:
    """(new checkpoints on disk at once, how many fit the free space, free bytes) for a run that will write
    `writes` more checkpoints of `checkpoint_bytes` into `directory`, keeping `keep`: the newest is complete
    before the oldest goes, so up to keep + 1 are there at once, those already there among them, and at
    least the one being written."""
    there = len(periodic_checkpoints(directory)) + len(complete_steps(directory))
    at_once = min(writes, max(1, keep + 1 - there))  # the ones there go as new ones come, but only after
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    return at_once, free // max(checkpoint_bytes, 1), free


def _read_header(path: Path, f: BinaryIO) -> tuple[str, int, int]:
    """(payload digest, payload bytes, payload offset) from a file's header; errors name the versions."""
    head = f.read(HEADER_BYTES)
    if not head.startswith(MAGIC.encode()):
        raise SlipcacheError(_foreign(path, head + f.read()))
    fields = head.decode("ascii", "replace").split()
    if len(fields) not in (5, 6) or fields[2] != "sha256" or not all(x.isdigit() for x in (fields[1], *fields[4:])):
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt (damaged header)")
    version = int(fields[1])
    if version not in READABLE_FILE_VERSIONS:
        newer = "a newer" if version > FILE_VERSION else "an older"
        raise SlipcacheError(
            f"checkpoint {path} has format version {version} (written by {newer} slipcache); "
            f"this slipcache reads format version {FILE_VERSION} (and {READABLE_FILE_VERSIONS[0]})"
        )
    if (version == 2) != (len(fields) == 5):
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt (damaged header)")
    return fields[3], int(fields[4]), int(fields[5]) if len(fields) == 6 else HEADER_BYTES


def _read_state(path: Path, f: BinaryIO) -> Any:
    """The verified torch payload of an open checkpoint file, unpickled, large tensors as `RawTensor`s."""
    digest, size, offset = _read_header(path, f)
    file_size = os.fstat(f.fileno()).st_size
    if file_size != offset + size:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupt (truncated: {max(file_size - offset, 0)} of {size} payload bytes)"
        )
    f.seek(offset)
    data = f.read(size)
    if hashlib.sha256(data).hexdigest() != digest:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt (checksum mismatch)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises many types (IndexError, EOFError, ...) on bad bytes
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__})") from exc
    return _attach_raw(state, path, offset, f)


def _attach_raw(obj: Any, path: Path, limit: int, source: BinaryIO | None = None) -> Any:
    """Records of large tensors -> `RawTensor`s of `path` (their bytes lie before `limit`), read from the
    open file `source`."""
    if isinstance(obj, dict):
        if obj.get(_RAW_KEY) is True:
            raw = _raw_record(obj, path)
            raw.source = source
            itemsize = torch.empty(0, dtype=raw.dtype).element_size()
            outside = raw.offset < HEADER_BYTES or raw.offset + raw.nbytes > limit
            if outside or raw.nbytes != itemsize * math.prod(raw.shape):
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt (a tensor lies outside the file)")
            return raw
        for key in list(obj):
            obj[key] = _attach_raw(obj[key], path, limit, source)
        return obj
    if isinstance(obj, list):
        return [_attach_raw(v, path, limit, source) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_attach_raw(v, path, limit, source) for v in obj)
    return obj


def _raw_record(record: dict[str, Any], path: Path) -> RawTensor:
    """A large tensor's record, each field checked: a crafted one is one line naming the field."""

    def bad(field: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {path} is corrupt (a tensor record is damaged: {field} {record.get(field)!r:.60})"
        )

    dtype = getattr(torch, str(record.get("dtype")), None) if isinstance(record.get("dtype"), str) else None
    if not isinstance(dtype, torch.dtype):
        raise bad("dtype")
    shape = record.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad("shape")
    for field in ("offset", "nbytes"):
        if type(record.get(field)) is not int or record[field] < 0:
            raise bad(field)
    digest = record.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise bad("sha256")
    return RawTensor(path, record["offset"], record["nbytes"], dtype, tuple(shape), digest)


def _stream_raw(raw: RawTensor, into: memoryview | None, put: Callable[[int, memoryview], None] | None = None) -> None:
    """Read a large tensor's bytes into `into`, or a chunk at a time into a scratch buffer handed to
    `put(offset, chunk)` (or only hashed); check its digest."""
    sha = hashlib.sha256()
    scratch = None if into is not None else bytearray(min(CHUNK_BYTES, raw.nbytes))
    with contextlib.ExitStack() as stack:
        f = raw.source if raw.source is not None and not raw.source.closed else None
        f = f or stack.enter_context(open(raw.path, "rb"))
        for start in range(0, raw.nbytes, CHUNK_BYTES):
            stop = min(start + CHUNK_BYTES, raw.nbytes)
            target = into[start:stop] if into is not None else memoryview(scratch)[: stop - start]  # type: ignore[arg-type]
            f.seek(raw.offset + start)  # one file shared by many tensors: each read says where
            got = cast(io.BufferedIOBase, f).readinto(target)  # a file opened "rb", as raw.source is
            if got != stop - start:
                raise CorruptCheckpointError(f"checkpoint {raw.path} is corrupt (truncated tensor bytes)")
            sha.update(target)
            if put is not None:
                put(start, target)
    if sha.hexdigest() != raw.sha256:
        raise CorruptCheckpointError(
            f"checkpoint {raw.path} is corrupt (checksum mismatch in a tensor of shape {list(raw.shape)})"
        )


def materialize(obj: Any, targets: Any = None, files: Sequence[StorageFile] = ()) -> Any:
    """`obj` with every `RawTensor` read (in place for dicts and lists); where `targets` (a structure of
    the same keys, e.g. a model's state_dict) holds a CPU tensor of the same dtype and shape, the bytes go
    straight into it, so loading the tables needs no second copy. Into a tensor that one of `files` maps
    (rows on disk) they go with pwrite, not through the map. Digests are checked as they are read."""
    if isinstance(obj, RawTensor):
        target = targets if isinstance(targets, Tensor) else None
        if not (
            target is not None and target.dtype == obj.dtype and tuple(target.shape) == obj.shape
            and target.device.type == "cpu" and target.is_contiguous()
        ):
            target = torch.empty(obj.shape, dtype=obj.dtype)
        file = next((f for f in files if f.holds(target)), None)
        with torch.no_grad():
            if file is not None:
                at = file.offset_of(target)
                _stream_raw(obj, None, lambda start, chunk: file.write(at + start, chunk))
            else:
                _stream_raw(obj, _bytes_of(target) if target.numel() else None)
        return target
    if isinstance(obj, dict):
        for key in list(obj):
            obj[key] = materialize(obj[key], targets.get(key) if isinstance(targets, dict) else None, files)
        return obj
    if isinstance(obj, list):
        obj[:] = [materialize(v) for v in obj]
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(materialize(v) for v in obj)
    return obj


def _foreign(path: Path, data: bytes) -> str:
    """What a file without our header is: an unversioned v1 slipcache checkpoint, or something else."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # not a torch file at all
        return f"{path} is not a slipcache checkpoint (format version {FILE_VERSION} expected)"
    if isinstance(state, dict) and state.get("format") == MAGIC:
        return (
            f"checkpoint {path} has format version {state.get('version', 1)} (written by an older slipcache); "
            f"this slipcache reads format version {FILE_VERSION}"
        )
    return f"{path} is a torch file but not a slipcache checkpoint (format version {FILE_VERSION} expected)"


def load_checkpoint(path: str | os.PathLike[str], *, lazy: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`; a missing or damaged file is a SlipcacheError.

    The checksum is verified before anything is unpickled, and unpickling uses `weights_only=True`:
    checkpoints hold only tensors and plain Python values, so opening a file from elsewhere cannot
    execute code. Large tensors are read after, each checked against its own digest; with `lazy` they are
    left as `RawTensor`s for `materialize` to read into the tensors that will hold them.
    """
    path = Path(path)
    if path.is_dir():
        path = path / LATEST
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint not found: {path}")
    try:
        f = open(path, "rb")  # noqa: SIM115 - kept open by the lazy state's tensors: their bytes are read from it
    except OSError as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is unreadable: {exc.strerror or exc}") from exc
    try:
        state = _read_state(path, f)
        if not isinstance(state, dict):
            raise SlipcacheError(f"checkpoint {path} does not hold a slipcache state dict")
        return state if lazy else materialize(state)  # lazy: the file closes with the last of its `RawTensor`s
    except OSError as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is unreadable: {exc.strerror or exc}") from exc
    finally:
        if not lazy:
            f.close()


def is_complete(path: Path) -> bool:
    """Whether a checkpoint file is whole and matches its checksums (streaming through it, no copy kept)."""
    try:
        with open(path, "rb") as f:
            state = _read_state(path, f)
        _verify_all(state)
    except (SlipcacheError, OSError):
        return False
    return True


def _verify_all(obj: Any) -> None:
    if isinstance(obj, RawTensor):
        _stream_raw(obj, None)
    elif isinstance(obj, dict):
        for value in obj.values():
            _verify_all(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _verify_all(value)


def periodic_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(samples, file) of a run's periodic checkpoints (`ckpt-<samples>.pt`), oldest first; unverified."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = ((_PERIODIC.match(p.name), p) for p in directory.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m is not None and p.is_file())


def complete_steps(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(samples, step directory) of the steps of a checkpoints directory that have their manifest (written
    last, once every rank's file was complete), oldest first; unverified."""
    directory = Path(directory)
    found = ((STEP_DIR.match(p.name), p) for p in directory.iterdir()) if directory.is_dir() else ()
    return sorted((int(m.group(1)), p) for m, p in found if m is not None and (p / STEP_MANIFEST).is_file())


def complete_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The periodic checkpoints of a run's `checkpoints/` directory that verify, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    periodic = sorted((p for p in directory.iterdir() if _PERIODIC.match(p.name)), reverse=True)
    return [p for p in periodic if is_complete(p)]
