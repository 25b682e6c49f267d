"""``memory://`` — an in-process LRU store bounded in bytes.

The top tier of a replica: the fastest, private to the process. Values are copied on ``put``
(callers reuse their staging buffers) and returned as the stored immutable ``bytes``.

After ``pin_host_memory`` (a GPU engine's transfer asks for it) values of 64 KiB or more are kept
in an arena of buffers registered with the accelerator (a ``BufferPool`` of the store's
capacity, reused as values are evicted: no page faults, no registration per value), and
``get_into`` hands them out as leases that say ``pinned``: a load DMAs a verified record from
where the store keeps it. Such a value is reference-counted: its buffer is reused only once the
store dropped it and every reader released its lease; ``get`` returns a copy of it. ``put_many``
copies large values on ``kvstore.buffers.workers()``, several at once.

A value of 64 KiB or more is hashed at most once while it is kept (``Lease.digest``: the xxh3-64 of
every byte but its last 8, which a reader compares with a record's checksum instead of hashing the
record): a record put as it was sealed keeps the checksum its seal computed from the bytes copied
(``Pieces.digest``), any other value is hashed for its first reader (on ``kvstore.buffers.hashers()``,
its digest pending in the lease) and never again. The store's copy is immutable and private to the
process, so a digest of it stays true: a load from memory verifies its bytes once, not per load.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvstore.buffers import BufferPool, Lease, Pieces, borrow, copy_bytes, hashers, self_digest, workers
from kvstore.config import build, option, query_options
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import EVICTIONS
from kvstore.pinned import HostPinner
from kvstore.stores.base import Evicting, LeaseStream, Place, Store, Value, WriteValue
from kvstore.types import array_view

_HUGE = 1 << 20  # values at least this large live in numpy buffers (transparent huge pages)
_ARENA_MIN = 64 << 10  # with an arena, values at least this large live there (a DMA from pageable memory costs more)

#: What the store keeps per key: the value, or (in the arena) the lease it lives in.
_Held = Value | Lease


def _size(value: WriteValue) -> int:
    return len(value) if isinstance(value, Pieces) else memoryview(value).nbytes


def _write(view: memoryview, value: WriteValue) -> None:
    if isinstance(value, Pieces):
        value.copy_into(view)
    else:
        copy_bytes(view, value)


def _own(value: WriteValue, arena: BufferPool | None) -> _Held:
    """An immutable private copy of ``value``: ``bytes`` below 64 KiB; above, a lease of ``arena``
    when it has room, else a borrowed lease of ``bytes`` or, from 1 MiB, of a read-only numpy
    buffer (its huge pages fault in several times faster than a fresh ``bytes``). A lease carries
    the digest its seal computed, if any (``Pieces.digest``)."""
    n = _size(value)
    lease = arena.lease(n) if arena is not None and n >= _ARENA_MIN else None
    if lease is None and n < _HUGE:
        kept = value if isinstance(value, bytes) else value.tobytes() if isinstance(value, Pieces) else bytes(value)
        if n < _ARENA_MIN:
            return kept
        lease = borrow(kept)
    elif lease is None and isinstance(value, bytes):
        lease = borrow(value)
    elif lease is not None:
        try:
            _write(lease.view, value)
        except BaseException:
            lease.release()
            raise
    else:
        arr = np.empty(n, dtype=np.uint8)
        _write(array_view(arr), value)
        arr.flags.writeable = False
        lease = borrow(array_view(arr))
    if isinstance(value, Pieces):
        lease.digest = value.digest  # the bytes just copied, as the seal hashed them
    return lease


@dataclass(frozen=True)
class MemoryConfig:
    max_bytes: int = option(1 << 30, kind="size", help="Capacity; least recently used values are evicted beyond it.")

    @classmethod
    def from_url(cls, url: str) -> MemoryConfig:
        parts = urlsplit(url)
        if parts.netloc or parts.path not in ("", "/"):
            raise ConfigError(f"memory:// takes no host or path, got {url!r}; use memory://?max_bytes=8GiB")
        return build(cls, query_options(url), where="memory://")


class MemoryStore(Evicting, Store):
    is_local = True
    Config = MemoryConfig

    def __init__(self, config: MemoryConfig | None = None) -> None:
        self.config = config or MemoryConfig()
        self._data: OrderedDict[str, _Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._arena: BufferPool | None = None

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        return cls(MemoryConfig.from_url(url))

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def pin_host_memory(self, pinner: HostPinner) -> None:
        with self._lock:
            if self._arena is None:
                # Room for the whole capacity in 64 KiB-rounded buffers, and for readers that
                # still hold a few evicted values.
                self._arena = BufferPool(self.config.max_bytes + (self.config.max_bytes >> 3) + (64 << 20), pin=pinner)

    def get(self, key: str) -> Value | None:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                return None
            self._data.move_to_end(key)
            if not isinstance(value, Lease):
                return value
            if not value.pooled:
                return value.view  # read-only, the store's own: no copy
            value.retain()
        try:
            return bytes(value.view)  # the arena reuses the buffer once the store drops it
        finally:
            value.release()

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Each value as a lease of the memory it is kept in (borrowed, or the arena's, retained
        for the reader: the buffer outlives an eviction until the reader releases it), with its
        digest, known or being computed (module docstring)."""
        for key in keys:
            with self._lock:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                    if isinstance(value, Lease):
                        value.retain()
                        if not value.digesting:  # its first reader: hashed once, for every reader after
                            value.hash_later(hashers().submit(self_digest, value.view))
            yield None if value is None else value if isinstance(value, Lease) else borrow(value)

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def put(self, key: str, value: WriteValue) -> None:
        self._keep(key, _own(value, self._arena))

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        """Large values are copied on worker threads while the caller produces the next; every
        copy ends before this returns or raises."""
        copying: list[tuple[str, Future[_Held]]] = []
        try:
            for key, value in items:
                if _size(value) >= (_ARENA_MIN if self._arena is not None else _HUGE):
                    copying.append((key, workers().submit(_own, value, self._arena)))
                else:
                    self.put(key, value)
        finally:
            wait([f for _, f in copying])
        failure = next((f.exception() for _, f in copying if f.exception() is not None), None)
        for key, done in copying:
            if failure is None:
                self._keep(key, done.result())
            elif done.exception() is None and isinstance(held := done.result(), Lease):
                held.release()
        if failure is not None:
            raise failure

    def _keep(self, key: str, data: _Held) -> None:
        size = len(data)
        gone: list[str] = []
        dropped: list[_Held] = []
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
                dropped.append(old)
            if size > self.config.max_bytes:
                dropped.append(data)  # larger than the whole tier: keeping it would evict everything else
            else:
                while self._data and self._bytes + size > self.config.max_bytes:
                    evicted_key, evicted = self._data.popitem(last=False)
                    self._bytes -= len(evicted)
                    EVICTIONS.inc(store="memory")
                    gone.append(evicted_key)
                    dropped.append(evicted)
                self._data[key] = data
                self._bytes += size
        _release(dropped)
        if gone and self._eviction_listeners:
            self._evicted(gone)

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(old)
        _release([old])
        return True

    def longest_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._data:
                    return i
            return len(keys)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = list(self._data)
        return (k for k in keys if k.startswith(prefix))

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        with self._lock:
            return [len(self._data[k]) if k in self._data else None for k in keys]

    def close(self) -> None:
        with self._lock:
            dropped = list(self._data.values())
            self._data.clear()
            self._bytes = 0
        _release(dropped)

    def describe(self) -> dict[str, Any]:
        return {"store": "memory", "max_bytes": self.config.max_bytes, "used_bytes": self._bytes,
                "items": len(self._data)}


def _release(values: Iterable[_Held]) -> None:
    """Give the arena's buffers of values the store dropped back (once their readers are done)."""
    for value in values:
        if isinstance(value, Lease):
            value.release()
