"""A `torch.load`-able file written one tensor, and one chunk of rows, at a time.

`torch.save` needs every tensor in memory at once; an export of tables larger than the machine's memory
cannot. This writes the same file `torch.save` would (a zip archive of the pickled structure, `data.pkl`,
and one stored record per tensor's bytes, each starting on a 64-byte boundary as torch aligns them), but the
structure is pickled from `TensorSlot`s that only know dtype and shape, and each slot's bytes are then
streamed into its record a chunk at a time:

    with TorchFileWriter(path, {"t": {"weight": TensorSlot(torch.float32, (rows, dim))}}) as out:
        for slot in out.slots:            # in the order they were pickled
            for chunk in chunks_of(slot):
                out.write(slot, chunk)    # fewer or more bytes than the slot holds is an error

`torch.load(path)` (also `mmap=True`, `weights_only=True`) then returns the structure with real tensors.
Only the zip container and torch's documented pickle (`torch._utils._rebuild_tensor_v2` over a storage
persistent id, as torch has written since 1.6) are used.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from slipcache.torch_private import rebuild_tensor

ALIGNMENT = 64  # torch's storage alignment in its zip files (mmap loading needs aligned records)
_ARCHIVE = "archive"
_STORAGE_TYPES = {torch.float32: "FloatStorage", torch.uint8: "ByteStorage"}


@dataclass(eq=False)
class TensorSlot:
    """A tensor of the file to be written: its dtype and shape now, its bytes later."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    key: str = ""  # the record name, given when the structure is pickled

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty(0, dtype=self.dtype).element_size()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled the way torch pickles a contiguous CPU tensor over its own storage."""
        stride: list[int] = []
        step = 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= n
        args: tuple[Any, ...] = (_StorageRef(self), 0, tuple(self.shape), tuple(reversed(stride)), False, OrderedDict())
        return (rebuild_tensor, args)


@dataclass(eq=False)
class _StorageRef:
    slot: TensorSlot


class _Pickler(pickle.Pickler):
    """Storages become torch's persistent ids ("storage", type, key, location, numel)."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=2)
        self.slots: list[TensorSlot] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _StorageRef):
            return None
        slot = obj.slot
        if slot.dtype not in _STORAGE_TYPES:
            raise TypeError(f"no torch storage type for {slot.dtype}")
        slot.key = str(len(self.slots))
        self.slots.append(slot)
        numel = slot.nbytes // torch.empty(0, dtype=slot.dtype).element_size()
        return ("storage", getattr(torch, _STORAGE_TYPES[slot.dtype]), slot.key, "cpu", numel)


class TorchFileWriter:
    """Writes `structure` (dicts, lists, tuples, plain values and `TensorSlot`s) as a torch file at `path`;
    the slots' bytes are streamed in with `write`, slot after slot in `slots` order."""

    def __init__(self, path: str | Path, structure: Any) -> None:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(structure)
        self.slots = pickler.slots
        self._file = open(path, "wb")  # noqa: SIM115  # closed by close() or abort()
        self._zip = zipfile.ZipFile(self._file, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._record("data.pkl", buffer.getvalue())
        self._record(".format_version", b"1")
        self._record(".storage_alignment", str(ALIGNMENT).encode())
        self._record("byteorder", sys.byteorder.encode())
        self._next = 0  # index of the slot being written
        self._open: Any = None
        self._left = 0

    def _entry(self, name: str, nbytes: int) -> tuple[zipfile.ZipInfo, bool]:
        """A stored entry whose data will start on an ALIGNMENT boundary (padding in an extra field)."""
        info = zipfile.ZipInfo(f"{_ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = nbytes
        info.compress_size, info.CRC = 0, 0
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT
        start = self._zip.start_dir + len(info.FileHeader(zip64)) + 4  # 4: the padding field's own header
        pad = -start % ALIGNMENT
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch pads with the same field id
        return info, zip64

    def _record(self, name: str, data: bytes) -> None:
        info, zip64 = self._entry(name, len(data))
        with self._zip.open(info, "w", force_zip64=zip64) as f:
            f.write(data)

    def write(self, slot: TensorSlot, chunk: Tensor) -> None:
        """Append `chunk` (contiguous rows of `slot`'s dtype) to `slot`'s record."""
        if self._next >= len(self.slots) or slot is not self.slots[self._next]:
            raise ValueError("slots must be written in order, each completely")
        if chunk.dtype != slot.dtype:
            raise TypeError(f"slot {slot.key} holds {slot.dtype}, got {chunk.dtype}")
        if self._open is None:
            info, zip64 = self._entry(f"data/{slot.key}", slot.nbytes)
            self._open, self._left = self._zip.open(info, "w", force_zip64=zip64), slot.nbytes
        data = chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
        if len(data) > self._left:
            raise ValueError(f"slot {slot.key}: {len(data)} bytes written past its {slot.nbytes}")
        self._open.write(data)
        self._left -= len(data)
        if self._left == 0:
            self._finish_slot()

    def _finish_slot(self) -> None:
        self._open.close()
        self._open = None
        self._next += 1

    def close(self) -> None:
        """Write the rest of the archive; every slot must be complete (empty ones are written here)."""
        while self._next < len(self.slots) and self.slots[self._next].nbytes == 0 and self._open is None:
            self._record(f"data/{self.slots[self._next].key}", b"")
            self._next += 1
        if self._next != len(self.slots):
            raise ValueError(f"{len(self.slots) - self._next} tensors of the file were not written completely")
        self._record("version", b"3\n")
        self._zip.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Close the file without completing it (the caller removes it)."""
        if self._open is not None:
            io.BufferedIOBase.close(self._open)  # marked closed: the zip module must not finish the half record
            self._open = None
        self._zip.fp = None  # nothing more is written into the archive, not even at garbage collection
        self._file.close()

    def __enter__(self) -> TorchFileWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
