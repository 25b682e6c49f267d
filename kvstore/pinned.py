"""Host memory an accelerator's copy engine reads directly: the contract (``HostPinner``), CUDA's
implementation (``cuda_pinner``: ``cudaHostRegister``) and page-aligned buffers made for it.

A copy to a GPU from ordinary (pageable) host memory goes through a driver staging buffer at a
fraction of the link's rate (11.7 GB/s against 55 on an H200, ``benchmarks/results/gpu.md``); from
registered ("pinned") memory it is one DMA. The pools pin the buffers they own, and the host-local
stores pin the memory their values already live in (``Store.pin_host_memory``: a ``shm://``
record's mapping, a ``memory://`` value), so a verified record goes to the device from where it
lies, with no copy on the host.

Contract: ``pin(array)`` registers the memory of a 1-D uint8 array for exactly as long as that
array lives. Its registration ends once the array is freed, never earlier, so nothing that
still holds a view of it (a lease whose DMA is in flight) can see it end. A failed registration
is not an error: the memory is read as ordinary memory, and ``stats()`` counts it. Thread-safe.

Ending a registration is a driver call that can wait for the device (``cudaHostUnregister``), and
memory is freed wherever its last reference goes: under a pool's lock, on a loading thread. So a
registration ends on the process's unpin thread (``when_freed``), the memory kept mapped until it
has (the array's base, a mapping, stays referenced till then); ``flush_unpins`` waits for it.
An array that owns its memory (no base to keep) ends its registration where it is freed.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["HostPinner", "CudaHostPinner", "cuda_pinner", "page_aligned_empty", "when_freed", "flush_unpins"]

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
# cudaHostRegister flags (CUDA runtime API): every context may use the memory; the device only reads it.
_PORTABLE, _READ_ONLY = 0x01, 0x08
_NOT_SUPPORTED = 801  # cudaErrorNotSupported: the device cannot register read-only memory
_ATTR_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported


class HostPinner(Protocol):
    """Registers host memory with an accelerator's copy engine (see the module docstring)."""

    def pin(self, array: np.ndarray, *, read_only: bool = False) -> bool:
        """Register ``array``'s memory (1-D, uint8, contiguous) until ``array`` is freed; True if
        it now is. ``read_only``: the memory is mapped without write access (a shared record)."""

    def stats(self) -> dict[str, int]:
        """Counts: ``pinned`` and ``pinned_bytes`` (registrations made), ``unpinned`` (ended),
        ``failed``."""


class _Unpins:
    """The process's unpin thread: registrations end here, in the order their memory was freed
    (a forked child starts its own)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], object]] = queue.SimpleQueue()
        self._pending = 0
        self._pid = -1

    def submit(self, end: Callable[[], None], keep: object) -> None:
        with self._cond:
            if self._pid != os.getpid():  # the first use, or a fork's copy: no thread here yet
                self._pid = os.getpid()
                self._queue = queue.SimpleQueue()
                self._pending = 0
                threading.Thread(target=self._run, args=(self._queue,), name="kvstore-unpin", daemon=True).start()
            self._pending += 1
            self._queue.put((end, keep))

    def _run(self, work: queue.SimpleQueue[tuple[Callable[[], None], object]]) -> None:
        while True:
            end, keep = work.get()
            try:
                end()
            except Exception:  # a registration that will not end must not stop the others
                log.warning("ending a host memory registration failed", exc_info=True)
            finally:
                del keep  # the memory may go now
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending and self._pid == os.getpid():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


_unpins = _Unpins()


def _memory_owner(array: np.ndarray) -> object | None:
    """What keeps ``array``'s memory alive once the array is gone (its buffer: a mapping, a
    memoryview), or None where the array owns its memory."""
    base: object | None = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def when_freed(array: np.ndarray, end: Callable[[], None]) -> None:
    """Call ``end`` (which ends ``array``'s registration) once ``array`` is freed: on the
    process's unpin thread, the memory kept until ``end`` returns, never on the thread that let
    the array go nor under its locks; where the array owns its memory, at once, where it goes."""
    owner = _memory_owner(array)
    finalizer = weakref.finalize(array, end) if owner is None else weakref.finalize(array, _unpins.submit, end, owner)
    finalizer.atexit = False  # at exit the driver releases everything itself


def flush_unpins(timeout: float = 10.0) -> bool:
    """Wait until every registration whose memory was freed has ended; False after ``timeout``."""
    return _unpins.flush(timeout)


def page_aligned_empty(nbytes: int) -> np.ndarray:
    """A new 1-D uint8 array of ``nbytes`` (at least one page) on pages of its own (an anonymous
    mapping), every page faulted in: what a registration pins whole, never a page it shares with
    another buffer."""
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    # Private: a forked child gets its own copy of a pool's buffers, never the parent's pages.
    array = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE), dtype=np.uint8)[:nbytes] if nbytes \
        else np.empty(0, np.uint8)
    if nbytes:
        array[::_PAGE] = 0  # fault every page in now, once, not on the hot path
    return array


class CudaHostPinner:
    """``HostPinner`` over the CUDA runtime that torch loaded (``cudaHostRegister`` through
    ctypes, on ``device``'s context; failures cleared from the runtime's last error, which torch
    would otherwise raise at its next kernel launch)."""

    def __init__(self, device: int, runtime: ctypes.CDLL) -> None:
        self.device = device
        self._rt = runtime
        self._rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._lock = threading.Lock()
        self._stats = {"pinned": 0, "pinned_bytes": 0, "unpinned": 0, "failed": 0}
        self._read_only_ok = True  # until the device refuses a read-only registration

    def pin(self, array: np.ndarray, *, read_only: bool = False) -> bool:
        if array.ndim != 1 or array.dtype != np.uint8 or not array.flags.c_contiguous or not array.nbytes:
            raise ValueError(f"pin() takes a non-empty 1-D contiguous uint8 array, got {array.dtype}{list(array.shape)}")
        if read_only and not self._read_only_ok:
            return self._failed()
        import torch

        ptr, size = array.ctypes.data, array.nbytes
        with torch.cuda.device(self.device):  # the registering thread's context is this device's
            rc = self._rt.cudaHostRegister(ctypes.c_void_p(ptr), size, _PORTABLE | (_READ_ONLY if read_only else 0))
            if rc:
                self._rt.cudaGetLastError()  # not left for torch to find after its next launch
        if rc:
            if read_only and self._read_only_ok and rc == _NOT_SUPPORTED:  # other errors say nothing of the flag
                self._read_only_ok = False
                log.warning("CUDA refused to register read-only host memory (error %d): shared-memory records "
                            "are copied to the device from pageable memory", rc)
            return self._failed()
        when_freed(array, lambda: self._unpin(ptr))
        with self._lock:
            self._stats["pinned"] += 1
            self._stats["pinned_bytes"] += size
        return True

    def _failed(self) -> bool:
        with self._lock:
            self._stats["failed"] += 1
        return False

    def _unpin(self, ptr: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            if self._rt.cudaHostUnregister(ctypes.c_void_p(ptr)):
                self._rt.cudaGetLastError()
        with self._lock:
            self._stats["unpinned"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def read_only_supported(self) -> bool | None:
        """The device's ``cudaDevAttrHostRegisterReadOnlySupported``: whether a mapping without
        write access (a ``shm://`` record) can be registered; None where it cannot be read."""
        get = getattr(self._rt, "cudaDeviceGetAttribute", None)
        if get is None:
            return None
        value = ctypes.c_int()
        if get(ctypes.byref(value), _ATTR_READ_ONLY_SUPPORTED, self.device):
            self._rt.cudaGetLastError()
            return None
        return bool(value.value)


_pinners: dict[int, CudaHostPinner | None] = {}
_pinners_lock = threading.Lock()


def cuda_pinner(device: Any = None) -> CudaHostPinner | None:
    """The process's pinner for a CUDA device (``None``: the current one), or None where there is
    no CUDA or its runtime library cannot be found among those torch loaded."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    given = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if given is None else given
    with _pinners_lock:
        if index not in _pinners:
            torch.cuda.init()  # type: ignore[no-untyped-call]  # loads the runtime library this looks for
            runtime = _loaded_cudart()
            if runtime is None:
                log.warning("the CUDA runtime library torch uses was not found: host memory is not registered "
                            "with the device (copies from shared memory and the memory tier are staged)")
            _pinners[index] = None if runtime is None else CudaHostPinner(index, runtime)
        return _pinners[index]


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library already loaded into this process (torch's), so that registrations
    are made in the runtime torch's copies use."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if all(hasattr(lib, name) for name in ("cudaHostRegister", "cudaHostUnregister", "cudaGetLastError")):
            return lib
    return None
