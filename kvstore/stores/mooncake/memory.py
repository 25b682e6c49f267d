"""Which host memory Mooncake's transfer engine reads and writes in place: ``Registrations``.

The client's zero-copy calls (``batch_get_into``, ``batch_upsert_from``) move bytes straight
between the pool's segments and buffers of this process. Over RDMA a buffer must be registered
with the transfer engine first (the NIC reads and writes it); over TCP the engine reads and writes
through plain pointers, and registration only costs time.

A buffer pool's buffers live long and are reused, so each is registered once, the first time a
value lands in it or leaves from it, for as long as its array lives: the registration ends in a
finalizer of the array, which runs before numpy lets go of the memory (``kvstore.pinned`` does
the same for CUDA), never earlier, so no call in flight can see it end. The engine refuses
overlapping registrations: memory inside a registered range is covered by it; memory that
overlaps one without lying inside it, or that no array owns (``bytes``), cannot be registered
and is reported as such (the store then passes it as it is over TCP, or copies it into its own
registered buffers over RDMA).
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from collections.abc import Callable

import numpy as np

__all__ = ["Registrations", "address"]

log = logging.getLogger(__name__)


def address(view: memoryview) -> int:
    """The address of a contiguous byte view's first byte (0 for an empty one)."""
    if not len(view):
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class Registrations:
    """The ranges of host memory registered with one client (see the module docstring).

    ``register(address, size)`` and ``unregister(address)`` are the client's calls (0: done).
    Thread-safe."""

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], int]) -> None:
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted
        self._ends: dict[int, int] = {}
        self._closed = False
        self.registered = 0  # registrations made (for tests and describe)
        self.refused = 0

    def covers(self, view: memoryview) -> bool:
        """Whether every byte of ``view`` lies in registered memory, registering the numpy array
        it belongs to (for as long as that array lives) where it does not yet."""
        start = address(view)
        if not start:
            return True
        end = start + len(view)
        with self._lock:
            if self._inside(start, end):
                return True
        owner = view.obj
        if not isinstance(owner, np.ndarray) or not owner.flags.c_contiguous or owner.nbytes < len(view):
            return False
        base = int(owner.ctypes.data)
        top = base + owner.nbytes
        if not base <= start < end <= top:
            return False
        with self._lock:
            if self._closed:
                return False
            if self._inside(start, end):
                return True
            if self._overlaps(base, top):
                self.refused += 1
                return False
            rc = self._register(base, top - base)
            if rc != 0:
                self.refused += 1
                log.debug("mooncake: registering %d bytes at %#x failed (%d)", top - base, base, rc)
                return False
            bisect.insort(self._starts, base)
            self._ends[base] = top
            self.registered += 1
        finalizer = weakref.finalize(owner, self._forget, base)
        finalizer.atexit = False  # at exit the client goes with the process
        return True

    def _inside(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[self._starts[i]] >= end

    def _overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self._starts, end)  # ranges starting before ``end``
        return i > 0 and self._ends[self._starts[i - 1]] > start

    def _forget(self, base: int) -> None:
        with self._lock:
            if self._ends.pop(base, None) is None:
                return
            self._starts.remove(base)
            if self._closed:
                return
            try:
                self._unregister(base)
            except Exception:
                log.debug("mooncake: unregistering %#x failed", base, exc_info=True)

    def close(self) -> None:
        """The client is closing: registrations end with it, nothing is unregistered any more."""
        with self._lock:
            self._closed = True
