"""Step buffers reused from step to step while nothing else holds them.

A fresh megabytes-large tensor costs its page faults every step; a buffer the last step's output, plan or
rows still hold must not be written again. Reuse is decided by reference counts.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor


class Scratch:
    """Named buffers on one device (`buffers`: name -> the last one handed out)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """The buffer `name` when nothing else holds it and it fits; a new one otherwise."""
        buffer = self.buffers.get(name)
        # References to the Python tensor: the dict, `buffer` and getrefcount's argument; any more is a holder.
        if (
            buffer is None
            or buffer.shape != shape
            or buffer.dtype != dtype
            or sys.getrefcount(buffer) > 3
            or not _storage_alone(buffer)
        ):
            buffer = self.buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer

    def follow(self, device: torch.device) -> None:
        """After a move: buffers are made again on `device`."""
        self.device = device
        self.buffers.clear()


def _use_count(tensor: Tensor) -> int | None:
    """How many tensors share `tensor`'s storage (plus the temporary that asks); None where torch cannot say."""
    try:
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return None


_ALONE = _use_count(torch.empty(1))  # the count of a tensor nothing else shares


def _storage_alone(tensor: Tensor) -> bool:
    """Whether no other tensor (an output the caller kept, a view of it) shares `tensor`'s storage."""
    count = _use_count(tensor)
    return _ALONE is not None and count is not None and count <= _ALONE
