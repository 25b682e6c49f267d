"""A bounded pool of resident host buffers that the data path leases instead of allocating.

A fresh multi-MiB buffer page-faults on first touch, which on the VMs we measure costs more than
sending the bytes over loopback (``docs/operations.md``: the page-fault cliff). So records are
gathered into, and read into, buffers that stay mapped: ``BufferPool.lease(nbytes)`` hands out a
``Lease`` over a resident buffer of at least ``nbytes`` bytes (pinned on CUDA, so host<->device
copies can be asynchronous), and ``Lease.release()`` gives it back for the next lease.

Contract:

* A lease is reference-counted: the first holder owns one reference; ``retain()`` adds one for
  each further holder (a background writer that still has to send it) and each ``release()``
  drops one. When the last is dropped the buffer returns to the pool; using ``view`` after that
  is a bug. Releasing more often than retained raises.
* The pool never holds more than ``max_bytes``, leased and free together. When a lease does not
  fit, free buffers are dropped (largest first) to make room; if it still does not fit the pool
  waits up to ``wait`` seconds for releases and then returns ``None``: callers treat that as "no
  room right now" (a save drops the chunk and counts it, a load stops prefetching), never as an
  error. A single request larger than ``max_bytes`` is served by a buffer outside the budget,
  freed on release (counted in ``stats()["oversize"]``).
* ``borrow(buffer)`` wraps memory the caller already owns (an immutable ``bytes`` from a store)
  as a lease whose release does nothing, so code downstream handles one type.
* ``Lease.pinned`` says whether a device copy reads the lease's memory directly (a pool buffer
  registered with the accelerator, ``kvstore.pinned``; a store's registered memory, borrowed):
  a loader that moves records to a GPU takes them from there without a copy on the host.
* Thread-safe.

``Pieces`` is one value made of several buffers (a record's header beside its payload) that
stores send or write in order without joining them, optionally owned by a lease, and optionally
ended by a trailer computed from the bytes before it (a record's checksum) as they stream out.

A self-checked value (every kvstore record) ends with the xxh3-64 of all its bytes before those
8. A store that receives one into a lease may hash it as it arrives (``ArrivalDigest``), while
each piece is in the CPU's cache, and leave the digest in ``Lease.digest``: the reader then
compares it with the value's last 8 bytes instead of reading the whole value once more. A store
whose values are already in memory (a mapping) may instead start hashing one on ``hashers()``
and hand the lease out at once (``Lease.hash_later``): reading ``digest`` then waits for it, so a
reader can start moving the bytes (a DMA) while they are hashed.

``workers()`` is the process's pool of threads for a save's work that releases the GIL (large
copies, writes of local files), ``hashers()`` the one for a load's hashes, each sized to the host.
Their tasks never wait for one another.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from kvstore.errors import ConfigError
from kvstore.pinned import HostPinner, cuda_pinner, page_aligned_empty
from kvstore.types import Buffer, array_view

__all__ = ["ArrivalDigest", "BufferPool", "Lease", "Pieces", "Seal", "Sealing", "borrow", "default_pool",
           "configure_default_pool", "DEFAULT_POOL_BYTES", "SELF_CHECK_BYTES", "STREAM_SLICE", "byte_view",
           "copy_bytes", "footprint", "io_batches", "IOV_MAX", "lease_or_fresh", "write_all", "workers", "hashers", "thread_pool", "self_digest", "xxh3_digest"]

#: Default budget of the process-wide pool (``configure_default_pool`` changes it).
DEFAULT_POOL_BYTES = 1 << 30
_ALIGN = 1 << 16  # buffers are sized in 64 KiB steps: a record's header varies by a few KiB
_PAGE = 4096
#: ``Pieces.stream`` hands sealed parts out in slices this large (and the file and S3 readers
#: read in them): small enough that a slice the consumer has just sent or copied is still in the
#: CPU's last-level cache when the seal reads it, large enough that the GIL round trips of a
#: value's system calls and hash updates stay few beside a busy engine thread (one per slice
#: each; ``kvstore.connectors.gil``).
STREAM_SLICE = 1 << 22
#: The size of a self-checked value's trailing xxh3-64 (see the module docstring).
SELF_CHECK_BYTES = 8
#: Buffers per vectored system call (``writev``, ``sendmsg``); the kernel takes up to 1024.
IOV_MAX = 512


class Lease:
    """``nbytes`` of a buffer: ``view`` is a writable, byte-addressed memoryview of exactly that size."""

    __slots__ = ("_buf", "_digest", "_hashing", "_pool", "_refs", "nbytes", "pinned", "view")

    def __init__(self, pool: BufferPool | None, buf: Any, nbytes: int, *, pinned: bool = False) -> None:
        self._pool = pool
        self._buf = buf
        self._refs = 1
        self.nbytes = nbytes
        self.view: memoryview = byte_view(buf)[:nbytes]
        #: Whether a device copy reads this memory directly (registered with the accelerator).
        self.pinned = pinned
        self._digest: bytes | None = None
        self._hashing: Future[bytes | None] | None = None

    @property
    def digest(self) -> bytes | None:
        """Set by a store that hashed the value as it arrived, or is hashing it (``hash_later``:
        reading waits for it): the xxh3-64 of every byte of ``view`` but the last
        ``SELF_CHECK_BYTES`` (``ArrivalDigest``); None otherwise."""
        hashing = self._hashing
        if hashing is not None:
            self._digest, self._hashing = hashing.result(), None
        return self._digest

    @digest.setter
    def digest(self, value: bytes | None) -> None:
        self._digest, self._hashing = value, None

    @property
    def digesting(self) -> bool:
        """Whether ``digest`` is or will be known (set, or being hashed): a reader need not hash."""
        return self._digest is not None or self._hashing is not None

    def hash_later(self, hashing: Future[bytes | None]) -> None:
        """``digest`` is what ``hashing`` (``self_digest`` of ``view`` on ``hashers()``) returns."""
        self._digest, self._hashing = None, hashing

    @property
    def pooled(self) -> bool:
        """Whether the buffer is a pool's, reused once the last holder releases it (not borrowed)."""
        return self._pool is not None

    @property
    def array(self) -> np.ndarray:
        """The leased bytes as a numpy uint8 array (no copy)."""
        return np.frombuffer(self.view, dtype=np.uint8)

    def retain(self) -> Lease:
        """Add a holder; returns ``self``."""
        pool = self._pool
        if pool is None:
            return self
        with pool._lock:
            if self._refs <= 0:
                raise RuntimeError("retain() of a released lease")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop one holder; the last one gives the buffer back to the pool."""
        pool = self._pool
        if pool is None:
            return
        pool._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __len__(self) -> int:
        return self.nbytes


def borrow(buffer: Buffer, *, pinned: bool = False) -> Lease:
    """``buffer`` (owned elsewhere, e.g. a value a store returned) as a lease whose release does
    nothing; ``pinned``: its memory is registered with the accelerator (``Lease.pinned``)."""
    return Lease(None, buffer, memoryview(buffer).nbytes, pinned=pinned)


def xxh3_digest(data: Buffer) -> bytes:
    """The xxh3-64 digest of ``data``, hashed with the GIL released where it is large: through a
    streaming hasher, whose ``update`` gives the GIL up in every xxhash release (3.x always, 4.x
    above 64 KiB), where the one-shot ``xxh3_64_digest`` held it for the whole pass before 4.0
    (and a CUDA host runs whatever xxhash it has). So hashes on a pool of threads run at once."""
    hasher = xxhash.xxh3_64()
    hasher.update(data)
    return hasher.digest()


def self_digest(view: memoryview) -> bytes | None:
    """``Lease.digest`` of a whole value: the xxh3-64 of all but its last ``SELF_CHECK_BYTES``
    (None for a value too short to be self-checked). Releases the GIL (``xxh3_digest``)."""
    return xxh3_digest(view[:len(view) - SELF_CHECK_BYTES]) if len(view) >= SELF_CHECK_BYTES else None


_pools: dict[str, ThreadPoolExecutor] = {}
_pools_pid = -1
_pools_lock = threading.Lock()


def thread_pool(name: str) -> ThreadPoolExecutor:
    """The process's pool of threads called ``name``, for work that releases the GIL: one per
    core up to 16, at least 2; a forked child gets its own. A task must never wait for another
    task of its own pool (it could wait for itself): work that waits for ``workers()`` runs on
    a pool of another name (``kvstore.prefix_cache``'s verifiers)."""
    global _pools_pid
    with _pools_lock:
        if _pools_pid != os.getpid():
            _pools.clear()  # a fork's copy: the parent's threads are not here
            _pools_pid = os.getpid()
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2)),
                                                     thread_name_prefix=f"kvstore-{name}")
        return pool


def workers() -> ThreadPoolExecutor:
    """``thread_pool("worker")``: large copies, local file writes (a save's work). Its tasks wait for nothing."""
    return thread_pool("worker")


def hashers() -> ThreadPoolExecutor:
    """``thread_pool("hash")``: hashes of values a reader is about to verify (``Lease.hash_later``),
    apart from ``workers()``, so a long save's writes never delay a load's verification. Its
    tasks wait for nothing."""
    return thread_pool("hash")


#: Copies at least this large go through numpy, which releases the GIL while it copies
#: (a memoryview slice assignment holds it for the whole copy).
_NOGIL_COPY = 1 << 16


def copy_bytes(dst: memoryview, src: Buffer) -> None:
    """Copy ``src`` into ``dst`` (both byte-addressed, the same size), with the GIL released for
    large copies so other threads (readers receiving the next value) run meanwhile."""
    src_view = byte_view(src)
    if len(src_view) != len(dst):
        raise ValueError(f"copy of {len(src_view)} bytes into {len(dst)}")
    if len(dst) >= _NOGIL_COPY:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src_view, dtype=np.uint8))
    else:
        dst[:] = src_view


def io_batches(parts: Iterable[Buffer], max_bytes: int = STREAM_SLICE,
               max_count: int = IOV_MAX) -> Iterator[list[memoryview]]:
    """``parts`` in order, as lists of byte views for one vectored system call each (``writev``,
    ``sendmsg``): at most ``max_count`` views, cut once a list holds ``max_bytes`` bytes; empty
    parts are left out. A record saved straight from a paged cache's blocks is a thousand small
    parts, which one call each would spend in system call overhead. A list is handed out only
    once it is full, so a ``Pieces`` stream (which seals a slice when asked for the next) has
    read each part of a list before the call sends it: the call reads them from the CPU's cache."""
    batch: list[memoryview] = []
    size = 0
    for part in parts:
        view = byte_view(part)
        if not len(view):
            continue
        batch.append(view)
        size += len(view)
        if len(batch) >= max_count or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_all(write: Callable[[list[memoryview]], int], views: list[memoryview]) -> None:
    """Call ``write`` (a vectored write: ``writev`` of a file, ``sendmsg`` of a socket; or a
    vectored read filling ``views``: a socket's ``recvmsg_into``) on at most ``IOV_MAX`` of
    ``views`` at a time until every byte has moved; a call may move part of them (a full or
    empty socket buffer, a signal). ``views`` is consumed. A call that moves nothing (a closed
    peer's read) raises ``OSError``."""
    first = 0
    while first < len(views):
        n = write(views[first:first + IOV_MAX])
        if n <= 0:  # a non-empty write or read moves at least a byte, or raises
            raise OSError(f"vectored I/O of {len(views) - first} buffers moved {n} bytes")
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]


def footprint(nbytes: int) -> int:
    """The bytes a lease of ``nbytes`` holds of a pool's budget (buffers come in 64 KiB steps)."""
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def lease_or_fresh(pool: BufferPool, nbytes: int, wait: float) -> Lease:
    """A lease of ``pool`` if one frees up within ``wait`` seconds, else a fresh buffer of
    ``nbytes`` (a read never stalls on a full pool). Tested against None, not for truth: a lease
    of 0 bytes is falsy (``len``), and ``lease or fresh`` would lose it, pool bytes and all."""
    lease = pool.lease(nbytes, wait=wait)
    if lease is None:
        lease = borrow(array_view(np.empty(nbytes, dtype=np.uint8)))
    return lease


def byte_view(buf: Any) -> memoryview:
    """``buf`` as a flat, byte-addressed memoryview (``len`` is its size in bytes); no copy."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class ArrivalDigest:
    """Hashes a value of ``size`` bytes, all but its last ``SELF_CHECK_BYTES``, as its pieces
    arrive in order (``arrived``), for ``Lease.digest``."""

    __slots__ = ("_end", "_hasher", "_seen")

    def __init__(self, size: int) -> None:
        self._hasher = xxhash.xxh3_64()
        self._end = size - SELF_CHECK_BYTES
        self._seen = 0

    def arrived(self, piece: memoryview) -> None:
        """The value's next ``len(piece)`` bytes."""
        seen = self._seen + len(piece)
        if seen <= self._end:  # all of it before the trailer: the common case, called per buffer
            self._hasher.update(piece)
        else:
            take = self._end - self._seen
            if take > 0:
                self._hasher.update(piece[:take])
        self._seen = seen

    def digest(self) -> bytes | None:
        """The digest, or None for a value too short to be self-checked."""
        return self._hasher.digest() if self._end >= 0 else None


class Sealing(Protocol):
    """One pass of a ``Seal`` over a value's sealed bytes."""

    def update(self, data: memoryview) -> None: ...

    def finish(self) -> bytes: ...


class Seal(Protocol):
    """How a ``Pieces`` value computes its trailer: from ``parts[first:]``, in order. A seal
    whose trailer ends with the xxh3-64 of every byte of the value before it (a self-checked
    value's) says so with a true ``self_check`` attribute (``Pieces.digest``)."""

    #: The trailer's size in bytes, known before any byte is streamed.
    nbytes: int
    #: The index of the first part the trailer covers (earlier parts, a header, are not fed to it).
    first: int

    def start(self) -> Sealing: ...


class Pieces:
    r"""One value made of ``parts`` in order, never joined on the hot path.

    ``owner`` (a lease) keeps the parts' memory alive: a holder that keeps the value beyond the
    call that received it (a background writer) ``retain()``\ s it and ``release()``\ s it when
    done; without an owner the parts are only valid during that call.

    With a ``seal`` the value ends with a trailer of ``seal.nbytes`` bytes computed from the parts
    it covers. Consumers that send or copy the value read it through ``stream()``, which feeds
    each slice to the seal right after the consumer has used it, so the trailer costs no pass
    over memory of its own. ``parts`` (every part, the trailer included) and ``trailer()``
    compute the trailer first if no stream has finished yet. Every pass computes the same bytes, so streams
    may be restarted (a retried send) or run in several threads at once.
    """

    __slots__ = ("_body", "_seal", "_trailer", "nbytes", "owner")

    def __init__(self, parts: Sequence[Buffer], owner: Lease | None = None, seal: Seal | None = None) -> None:
        self._body = tuple(byte_view(p) for p in parts)
        self._seal = seal
        self._trailer: bytes | None = None
        self.nbytes = sum(len(p) for p in self._body) + (seal.nbytes if seal is not None else 0)
        self.owner = owner

    def __len__(self) -> int:
        return self.nbytes

    @property
    def parts(self) -> tuple[memoryview | bytes, ...]:
        """Every part in order, the trailer last (computed now if still unknown)."""
        if self._seal is None:
            return self._body
        return (*self._body, self.trailer())

    @property
    def digest(self) -> bytes | None:
        """``Lease.digest`` of the value, as its last stream computed it: the trailer's last
        ``SELF_CHECK_BYTES`` where the seal makes them the xxh3-64 of every byte before them
        (``Seal.self_check``, a record's seal) and a stream has finished; else None. A store that
        copied the value as it streamed keeps this instead of hashing its copy again."""
        if self._trailer is None or not getattr(self._seal, "self_check", False):
            return None
        return self._trailer[-SELF_CHECK_BYTES:]

    @property
    def whole(self) -> memoryview | None:
        """The value as one buffer where it is one (a single part, no trailer), else None: a store
        that sends one contiguous buffer per value sends it from where it lies."""
        return self._body[0] if self._seal is None and len(self._body) == 1 else None

    def trailer(self) -> bytes:
        """The trailer's bytes (empty without a seal)."""
        if self._seal is None:
            return b""
        if self._trailer is None:
            for _ in self.stream():
                pass
        assert self._trailer is not None
        return self._trailer

    def stream(self, slice_bytes: int = STREAM_SLICE) -> Iterator[memoryview | bytes]:
        """The value's bytes as buffers to send or copy in order, the trailer last; sealed parts
        come in slices of at most ``slice_bytes``, each fed to the seal once the consumer asks
        for the next one (it has sent or copied this one: the seal reads it from the CPU's
        cache)."""
        seal = self._seal
        if seal is None or self._trailer is not None:
            yield from self.parts
            return
        sealing = seal.start()
        for index, part in enumerate(self._body):
            if index < seal.first:
                yield part
                continue
            whole = len(part) <= slice_bytes  # no slice object: a record from a cache's blocks has a thousand parts
            for pos in range(0, len(part), slice_bytes):
                piece = part if whole else part[pos:pos + slice_bytes]
                yield piece
                sealing.update(piece)  # after the consumer's send or copy: from the CPU's cache
        trailer = sealing.finish()
        if len(trailer) != seal.nbytes:
            raise AssertionError(f"seal made a {len(trailer)}-byte trailer, it announced {seal.nbytes}")
        self._trailer = trailer
        yield trailer

    def tobytes(self) -> bytes:
        return b"".join(self.stream())

    def copy_into(self, out: memoryview) -> None:
        """Write the value's bytes to the start of ``out``."""
        pos = 0
        for part in self.stream():
            copy_bytes(out[pos:pos + len(part)], part)  # the GIL released for each large slice
            pos += len(part)

    def retain(self) -> Pieces:
        if self.owner is not None:
            self.owner.retain()
        return self

    def release(self) -> None:
        if self.owner is not None:
            self.owner.release()


@dataclass
class _Stats:
    leases: int = 0
    allocations: int = 0
    misses: int = 0
    oversize: int = 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class BufferPool:
    """Resident buffers up to ``max_bytes`` in total; see the module docstring.

    ``pin``: register every buffer with an accelerator (``Lease.pinned``): a ``HostPinner``, or
    True for CUDA's (``kvstore.pinned.cuda_pinner``: none where there is no CUDA)."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES, *, pin: bool | HostPinner = False) -> None:
        if type(max_bytes) is not int or max_bytes < _ALIGN:
            raise ConfigError(f"buffer pool max_bytes={max_bytes!r} must be an integer of at least {_ALIGN} bytes")
        self.max_bytes = max_bytes
        self.pin = bool(pin)
        self._pinner: HostPinner | None = cuda_pinner() if pin is True else (pin or None)
        # CUDA without its runtime library in reach (no registration): torch's pinned allocator.
        self._torch_pin = pin is True and self._pinner is None and _cuda_available()
        self._lock = threading.Condition()
        self._free: list[tuple[Any, bool]] = []  # buffers not leased, any size, and whether each is pinned
        self._held = 0  # bytes of every buffer the pool owns (free and leased)
        self._leased = 0
        self._stats = _Stats()

    @property
    def pinner(self) -> HostPinner | None:
        """What registers this pool's buffers with an accelerator (None: they are not)."""
        return self._pinner

    # -- leasing ------------------------------------------------------------------------------------
    def lease(self, nbytes: int, *, wait: float = 0.0) -> Lease | None:
        """A lease of ``nbytes`` bytes, or ``None`` when the budget stays full for ``wait`` seconds."""
        if nbytes < 0:
            raise ValueError(f"cannot lease {nbytes} bytes")
        size = footprint(nbytes)
        deadline = time.monotonic() + wait
        # Free buffers dropped to make room are freed when this returns, after the lock: freeing
        # is munmap's work, and a registered buffer's end (kvstore.pinned) starts there.
        dropped: list[Any] = []
        with self._lock:
            self._stats.leases += 1
            oversize = size > self.max_bytes
            if oversize:
                self._stats.oversize += 1
            else:
                while True:
                    free = self._take(size)
                    if free is not None:
                        buf, pinned = free
                        self._leased += len(buf)
                        return Lease(self, buf, nbytes, pinned=pinned)
                    if self._make_room(size, dropped):  # reserved here, allocated below
                        self._held += size
                        self._leased += size
                        self._stats.allocations += 1
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._stats.misses += 1
                        return None
                    self._lock.wait(left)
        dropped.clear()  # before the new buffer is allocated: the memory they held goes first
        # A new buffer is faulted in (and registered with an accelerator: a driver call that can
        # take milliseconds) outside the lock: leases of free buffers and releases never wait on it.
        try:
            buf, pinned = self._allocate(size)
        except BaseException:
            if not oversize:
                with self._lock:
                    self._held -= size
                    self._leased -= size
                    self._lock.notify_all()
            raise
        return Lease(self, buf, nbytes, pinned=pinned)

    def _take(self, size: int) -> tuple[Any, bool] | None:
        """The smallest free buffer of at least ``size`` bytes but not wastefully larger, or None."""
        best = None
        for i, (buf, _) in enumerate(self._free):
            n = len(buf)
            if size <= n <= 2 * size and (best is None or n < len(self._free[best][0])):
                best = i
        return None if best is None else self._free.pop(best)

    def _make_room(self, size: int, dropped: list[Any]) -> bool:
        """Drop free buffers (largest first, into ``dropped``: the caller lets them go once it
        holds no lock) until ``size`` more bytes fit in the budget."""
        if self._held + size <= self.max_bytes:
            return True
        self._free.sort(key=lambda free: len(free[0]))
        while self._free and self._held + size > self.max_bytes:
            buf = self._free.pop()[0]
            self._held -= len(buf)
            dropped.append(buf)
        return self._held + size <= self.max_bytes

    def _allocate(self, size: int) -> tuple[Any, bool]:
        """A new buffer, its pages faulted in, and whether it is pinned (registered until freed)."""
        if self._torch_pin:
            import torch

            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
            buf[::_PAGE] = 0
            return buf, True
        if self._pinner is None:
            buf = np.empty(size, dtype=np.uint8)
            buf[::_PAGE] = 0  # fault every page in now, once, not on the hot path
            return buf, False
        buf = page_aligned_empty(size)  # pages of its own: a registration pins whole pages
        return buf, self._pinner.pin(buf)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._refs <= 0:
                raise RuntimeError("release() of a lease that was already released")
            lease._refs -= 1
            if lease._refs:
                return
            buf, lease._buf = lease._buf, None
            size = len(buf)
            if size > self.max_bytes:  # an oversize buffer: freed, never pooled
                return
            self._leased -= size
            self._free.append((buf, lease.pinned))
            self._lock.notify_all()

    # -- introspection --------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Bytes held, leased and free, and counts of leases, allocations, misses and oversize leases."""
        with self._lock:
            return {"max_bytes": self.max_bytes, "held_bytes": self._held, "leased_bytes": self._leased,
                    "free_buffers": len(self._free), **vars(self._stats)}

    def clear(self) -> None:
        """Drop every free buffer (leased ones return to the pool later)."""
        with self._lock:
            dropped, self._free = self._free, []
            self._held -= sum(len(b) for b, _ in dropped)
        del dropped  # freed here, not under the lock


_default: BufferPool | None = None
_default_lock = threading.Lock()


def default_pool() -> BufferPool:
    """The process-wide pool the stores and transfers use unless given one (built on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BufferPool(DEFAULT_POOL_BYTES)
        return _default


def configure_default_pool(max_bytes: int, *, pin: bool | HostPinner = False) -> BufferPool:
    """Replace the process-wide pool (at start-up, before the data path runs)."""
    global _default
    pool = BufferPool(max_bytes, pin=pin)
    with _default_lock:
        _default = pool
    return pool


