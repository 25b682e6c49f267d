"""Which host memory Mooncake's transfer engine reads and writes in place: ``Registrations``.

The client's zero-copy calls (``batch_get_into``, ``batch_upsert_from``) move bytes straight
between the pool's segments and buffers of this process. Over RDMA a buffer must be registered
with the transfer engine first (the NIC reads and writes it); over TCP the engine reads and writes
through plain pointers, and registration only costs time. Registering is a call to the metadata
server too (the client publishes its buffers there): it blocks while that server does not
answer, so the store registers on its worker threads, under a call's deadline.

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
from concurrent.futures import ThreadPoolExecutor

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
        self._retiring: dict[int, int] = {}  # ranges being unregistered
        self._unregistering = ThreadPoolExecutor(1, thread_name_prefix="kvstore-mooncake-unregister")
        self._closed = False
        self.registered = 0  # registrations made (for tests and describe)
        self.refused = 0

    def covered(self, view: memoryview) -> bool:
        """Whether every byte of ``view`` lies in registered memory (no call to the client)."""
        start = address(view)
        with self._lock:
            return not start or self._inside(start, start + len(view))

    def registrable(self, view: memoryview) -> bool:
        """Whether ``register(view)`` can cover it: it is covered, or it lies in a numpy array
        that overlaps no registered range (no call to the client)."""
        return self.covered(view) or self._owner(view) is not None

    def _owner(self, view: memoryview) -> tuple[np.ndarray, int, int] | None:
        """The numpy array ``view`` lies in and its range, if that range overlaps no registration."""
        owner = view.obj
        if not isinstance(owner, np.ndarray) or not owner.flags.c_contiguous:
            return None
        start, base = address(view), int(owner.ctypes.data)
        top = base + owner.nbytes
        if not base <= start <= start + len(view) <= top:
            return None
        with self._lock:
            return None if self._overlaps(base, top) else (owner, base, top)

    def register(self, view: memoryview) -> bool:
        """Make ``view`` covered, registering the numpy array it belongs to (for as long as that
        array lives) where it is not yet; False if it cannot be. A call to the client that may
        block (it publishes the buffer to the metadata server): run it where a deadline bounds it."""
        if self.covered(view):
            return True
        found = self._owner(view)
        if found is None:
            return False
        owner, base, top = found
        with self._lock:
            if self._closed:
                return False
            if self._inside(address(view), address(view) + len(view)):
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
        if i > 0 and self._ends[self._starts[i - 1]] > start:
            return True
        return any(s < end and start < e for s, e in self._retiring.items())

    def _forget(self, base: int) -> None:
        """The array of the range at ``base`` is being freed: the range is no longer covered at
        once, and it is unregistered on a thread of its own (a call that may block). Until that
        call returns it still counts as registered for overlaps: memory at the same addresses
        is not registered (nor used over RDMA) before then."""
        with self._lock:
            top = self._ends.pop(base, None)
            if top is None:
                return
            self._starts.remove(base)
            if self._closed:
                return
            self._retiring[base] = top
        try:
            self._unregistering.submit(self._unregister_now, base)
        except RuntimeError:  # closed, or the interpreter is exiting
            pass

    def _unregister_now(self, base: int) -> None:
        try:
            if not self._closed:
                self._unregister(base)
        except Exception:
            log.debug("mooncake: unregistering %#x failed", base, exc_info=True)
        finally:
            with self._lock:
                self._retiring.pop(base, None)

    def close(self) -> None:
        """The client is closing: registrations end with it, nothing is unregistered any more."""
        with self._lock:
            self._closed = True
        self._unregistering.shutdown(wait=False, cancel_futures=True)
