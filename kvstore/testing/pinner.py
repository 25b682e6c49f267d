"""``CountingPinner``: a ``HostPinner`` for machines without an accelerator, which registers
nothing and counts what a CUDA pinner would register and unregister, so the device path's
logic (which memory it DMAs from, when registrations end) is testable on the CPU."""

from __future__ import annotations

import threading
import weakref

import numpy as np

__all__ = ["CountingPinner"]


class CountingPinner:
    """Says every array is pinned (``pin`` returns True; ``refuse`` makes it say no) and counts
    pins, bytes and the ends of registrations (when an array is freed), as ``CudaHostPinner``
    does."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self._lock = threading.Lock()
        self._stats = {"pinned": 0, "pinned_bytes": 0, "unpinned": 0, "failed": 0}
        self.read_only = 0

    def pin(self, array: np.ndarray, *, read_only: bool = False) -> bool:
        if array.ndim != 1 or array.dtype != np.uint8 or not array.flags.c_contiguous or not array.nbytes:
            raise ValueError(f"pin() takes a non-empty 1-D contiguous uint8 array, got {array.dtype}{list(array.shape)}")
        with self._lock:
            if self.refuse:
                self._stats["failed"] += 1
                return False
            self._stats["pinned"] += 1
            self._stats["pinned_bytes"] += array.nbytes
            self.read_only += read_only
        weakref.finalize(array, self._unpinned).atexit = False
        return True

    def _unpinned(self) -> None:
        with self._lock:
            self._stats["unpinned"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)
