"""Host memory an accelerator's copy engine reads directly: the contract (``HostPinner``), CUDA's
implementation (``cuda_pinner``: ``cudaHostRegister``) and page-aligned buffers made for it.

A copy to a GPU from ordinary (pageable) host memory goes through a driver staging buffer at a
fraction of the link's rate (11.7 GB/s against 55 on an H200, ``benchmarks/results/gpu.md``); from
registered ("pinned") memory it is one DMA. The pools pin the buffers they own, and the host-local
stores pin the memory their values already live in (``Store.pin_host_memory``: a ``shm://``
record's mapping, a ``memory://`` value), so a verified record goes to the device from where it
lies, with no copy on the host.

Contract: ``pin(array)`` registers the memory of a 1-D uint8 array for exactly as long as that
array lives. Its registration ends when the array is freed (a finalizer of the array, which runs
before numpy lets go of the memory), never earlier, so nothing that still holds a view of it
(a lease whose DMA is in flight) can see it end. A failed registration is not an error: the
memory is read as ordinary memory, and ``stats()`` counts it. Thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Protocol

import numpy as np

__all__ = ["HostPinner", "CudaHostPinner", "cuda_pinner", "page_aligned_empty"]

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
# cudaHostRegister flags (CUDA runtime API): every context may use the memory; the device only reads it.
_PORTABLE, _READ_ONLY = 0x01, 0x08
_NOT_SUPPORTED = 801  # cudaErrorNotSupported: the device cannot register read-only memory


class HostPinner(Protocol):
    """Registers host memory with an accelerator's copy engine (see the module docstring)."""

    def pin(self, array: np.ndarray, *, read_only: bool = False) -> bool:
        """Register ``array``'s memory (1-D, uint8, contiguous) until ``array`` is freed; True if
        it now is. ``read_only``: the memory is mapped without write access (a shared record)."""

    def stats(self) -> dict[str, int]:
        """Counts: ``pinned`` and ``pinned_bytes`` (registrations made), ``unpinned`` (ended),
        ``failed``."""


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
        finalizer = weakref.finalize(array, self._unpin, ptr)
        finalizer.atexit = False  # at exit the driver releases everything itself
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
