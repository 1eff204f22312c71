"""Step buffers reused from step to step while nothing else holds them.

A fresh megabytes-large tensor costs its page faults every step; a buffer the last step's output, plan or
rows still hold must not be written again. Reuse is decided by reference counts (the storage's: see
`slipcache.torch_private`).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from slipcache.torch_private import storage_alone


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
            or not storage_alone(buffer)  # where torch cannot say: a new buffer
        ):
            buffer = self.buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer

    def follow(self, device: torch.device) -> None:
        """After a move: buffers are made again on `device`."""
        self.device = device
        self.buffers.clear()
