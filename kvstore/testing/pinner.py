"""Pinners for machines without an accelerator, so that the device path's logic (which memory
it DMAs from, when and where registrations begin and end) is testable on the CPU.

* ``CountingPinner`` registers nothing and counts what a CUDA pinner would register and
  unregister; a registration ends as ``CudaHostPinner``'s does (``kvstore.pinned.when_freed``:
  on the unpin thread, once the memory is freed).
* ``SlowPinner`` is a ``CountingPinner`` whose registrations and their ends take time, as the
  driver's do (about 1 ms per 33 MB on an H200), and which notes the threads they ran on and
  when: what must never run on a loading thread, under a lock, or one after another.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.pinned import when_freed

__all__ = ["CountingPinner", "SlowPinner"]


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
        when_freed(array, self._unpinned)
        return True

    def _unpinned(self) -> None:
        with self._lock:
            self._stats["unpinned"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)


class SlowPinner(CountingPinner):
    """A ``CountingPinner`` whose ``pin`` takes ``pin_s`` seconds and whose registrations take
    ``unpin_s`` to end. ``pins`` and ``unpins`` note ``(thread name, start, end)`` of each."""

    def __init__(self, pin_s: float = 0.0, unpin_s: float = 0.0) -> None:
        super().__init__()
        self.pin_s, self.unpin_s = pin_s, unpin_s
        self.pins: list[tuple[str, float, float]] = []
        self.unpins: list[tuple[str, float, float]] = []

    def pin(self, array: np.ndarray, *, read_only: bool = False) -> bool:
        start = time.perf_counter()
        time.sleep(self.pin_s)
        pinned = super().pin(array, read_only=read_only)
        with self._lock:
            self.pins.append((threading.current_thread().name, start, time.perf_counter()))
        return pinned

    def _unpinned(self) -> None:
        start = time.perf_counter()
        time.sleep(self.unpin_s)
        with self._lock:
            self.unpins.append((threading.current_thread().name, start, time.perf_counter()))
        super()._unpinned()

    def most_at_once(self) -> int:
        """The most registrations that ran at the same time."""
        with self._lock:
            spans = list(self.pins)
        return max((sum(1 for _, s, e in spans if s <= t < e) for _, t, _ in spans), default=0)
