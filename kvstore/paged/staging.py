"""Reusable host staging memory for the paged copies."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["StagingPool"]


class StagingPool:
    """Reusable host staging memory, one growing byte buffer per slot name.

    On CUDA the buffers are pinned so device<->host copies can be asynchronous; on CPU they are
    plain memory (and no CUDA call is made). A tensor handed out is valid until the next
    ``get`` of the same ``name``. Not thread-safe: one pool per transfer.
    """

    def __init__(self, pin: bool = False) -> None:
        self.pin = bool(pin) and torch.cuda.is_available()
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            # Grow geometrically: a fresh large allocation page-faults (~2.5 GB/s), reuse runs at memcpy speed.
            size = max(nbytes, 0 if buf is None else buf.numel() * 2)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self._bufs[name] = buf
        return buf[:nbytes].view(dtype).view(*shape)

