"""The store contract, and ``WrapperStore`` for stores that delegate to another.

A store maps string keys to immutable byte values. Backends implement five methods
(``get``, ``put``, ``delete``, ``iter_keys`` and ``close``); everything else has a default built
on them that a backend overrides only where it can do better (a pipeline, MGET, parallel
requests).

Contract, for every backend:

* ``get`` returns the whole value as written, or ``None`` on a miss. A reader never sees half a
  value: ``put`` is atomic per key.
* An outage (unreachable, timed out) raises ``StoreUnavailableError``; a miss is never an
  exception. Bad configuration raises ``ConfigError`` when the store is built.
* ``put`` takes one buffer or ``Pieces`` (several buffers making one value: a record's header
  and payload, sent or written in order, never joined on the way). Values are copied or sent
  before ``put`` returns, and a ``put_many`` that raises returns only once nothing reads its
  values any more: callers may reuse their buffers either way. (The tiered store keeps values for its
  background writers: it retains a ``Pieces``' owner lease, or copies; ``queues_writes`` says
  which stores do.)
* ``get_into(keys, pool)`` yields the values in key order, each in a ``Lease`` (a pool buffer, or
  a borrowed view of memory the store owns) that the consumer releases when done with it; a
  backend may receive later values while the consumer works on earlier ones. Closing the
  iterator early stops that and releases what it prefetched. A backend may set a lease's
  ``digest`` (the xxh3-64 of all but the value's last 8 bytes, ``ArrivalDigest``) computed as
  the value arrived; it must then be exactly that, since readers check records against it.
  (The tiered store hands its tiers' leases through; values it copies carry none.)
* ``get_into(keys, pool, place=place)``: a backend that receives values piece by piece (Redis, files)
  may land value i where the reader says instead of all in its lease: it calls ``place(i,
  view)`` with the lease's full-size ``view``, before any byte arrives, and fills the buffers of
  each sequence the iterator yields, completely and in order, before asking for the next;
  together they hold the value's bytes in order (views of ``view`` for the parts to keep there,
  the reader's own memory for the rest). The lease's ``digest`` then covers every byte, wherever it landed. Backends
  that cannot ignore ``place``: the reader learns which values it placed from its own iterators.
* ``get_heads(keys, nbytes)`` gives each value's size and its first ``nbytes`` bytes (all of a
  shorter one), ``None`` on a miss: what tools read to judge records by their headers without
  moving their payloads. It is not a read for use: it does not count as an access for a store's
  own eviction order where the backend lets it choose. Where a value is replaced meanwhile, the
  size and the bytes may come from two versions: a caller that acts on their disagreement reads
  the value whole first.
* ``deadline`` bounds how long one call may block on a remote server (``None``: the store does
  no network I/O); ``flush`` waits, at most ``timeout``, for writes accepted but not yet
  durable in the backend (background queues) and says whether they all landed.
* ``tiers`` lists the stores a lookup is answered from, fastest first, each with its name and
  measured speed; ``longest_prefix_by_tier`` says how many leading keys each holds, one round
  trip per tier, and ``exists_by_tier`` which keys each holds, one round trip per tier too. A single store is one tier: itself. Callers (the cost model, a scheduler) use
  these instead of asking which kind of store they hold.
* ``pin_host_memory(pinner)``: a store whose values lie in this host's memory (a memory tier, a
  shared-memory mapping) registers that memory with an accelerator through ``pinner``
  (``kvstore.pinned``) from then on, and says so in ``Lease.pinned`` of what ``get_into``
  yields: a device copy then reads a value where it lies. Others ignore it (they receive into
  the reader's pool, which pins its own buffers).
* Stores are thread-safe.
* A store that removes values on its own (capacity eviction) mixes in ``Evicting``: listeners
  learn the keys it evicted, after they are gone.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.buffers import BufferPool, Lease, Pieces, borrow
from kvstore.pinned import HostPinner
from kvstore.stores.speed import LinkSpeed
from kvstore.types import Buffer

__all__ = ["Buffer", "EvictionListener", "Evicting", "Head", "LeaseStream", "Place", "Store", "takes_place", "StoreTier", "WrapperStore", "Value", "WriteValue", "as_buffer", "check_head_bytes"]

#: What ``get`` returns for a hit: the value's bytes (a view of a buffer the caller now owns).
Value = bytes | memoryview
#: What ``put`` takes: one buffer, or the pieces of one value.
WriteValue = Buffer | Pieces
#: What ``get_into`` returns: values in key order as leases (``None`` for a miss); closable.
LeaseStream = Generator[Lease | None, None, None]
#: What ``get_heads`` returns for a hit: the value's size, and its first bytes.
Head = tuple[int, bytes]
#: Where ``get_into`` lands value i's bytes, given its lease's view (the contract above).
Place = Callable[[int, memoryview], Iterator[Sequence[memoryview]]]
#: Told the keys a store evicted (called after they are gone, outside the store's locks).
EvictionListener = Callable[[Sequence[str]], None]

log = logging.getLogger(__name__)


def check_head_bytes(nbytes: int) -> None:
    """``get_heads``' ``nbytes``: at least one byte, or ``ValueError``."""
    if nbytes < 1:
        raise ValueError(f"nbytes={nbytes} must be at least 1")


def takes_place(store: Store) -> bool:
    """Whether ``store.get_into`` takes ``place`` (a store written before it existed does not:
    callers then leave it out, and every value comes in its lease)."""
    return _takes_place(type(store))


@functools.lru_cache(maxsize=128)
def _takes_place(kind: type[Store]) -> bool:
    try:
        return "place" in inspect.signature(kind.get_into).parameters
    except (TypeError, ValueError):
        return False


class StoreTier(Protocol):
    """One tier of a store, as lookups and the cost model see it."""

    @property
    def name(self) -> str:
        """The tier's name in metrics and measurements (``kvstore_bytes_read_total{tier}``)."""

    @property
    def store(self) -> Store:
        """The store this tier is."""

    @property
    def speed(self) -> LinkSpeed:
        """Its measured latency and bandwidth (unmeasured where nothing times its calls)."""


@dataclass(frozen=True)
class _WholeStore:
    """A single store seen as its own only tier."""

    name: str
    store: Store
    speed: LinkSpeed


_whole_lock = threading.Lock()


def as_buffer(value: WriteValue) -> Buffer:
    """``value`` as one buffer (``Pieces`` are joined: for backends that need one contiguous value)."""
    return value.tobytes() if isinstance(value, Pieces) else value


class Store(ABC):
    """A key-value store of byte values. See the module docstring for the contract."""

    #: True for stores private to this machine (memory, file): the tiered store writes them
    #: synchronously; shared remote tiers are written in the background.
    is_local: bool = False
    #: True for stores whose ``put`` hands values to background writers that still read them
    #: after it returns (the tiered store): a ``Pieces`` with an owner lease is retained, any
    #: other value copied first. A writer that would only borrow its bytes for the call (a
    #: paged cache's blocks) gathers them into a lease of its own for such a store instead.
    queues_writes: bool = False

    # -- the small contract -------------------------------------------------------------------
    @abstractmethod
    def get(self, key: str) -> Value | None:
        """The value stored under ``key``, or ``None`` if there is none."""

    @abstractmethod
    def put(self, key: str, value: WriteValue) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was present."""

    @abstractmethod
    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Every key that starts with ``prefix``, in no particular order (for tools, not the hot path)."""

    def close(self) -> None:
        """Release connections and threads. The store must not be used afterwards."""

    # -- defaults built on the small contract -------------------------------------------------
    @property
    def deadline(self) -> float | None:
        """Seconds one call may block on a server at most (``None``: no network I/O)."""
        return None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait at most ``timeout`` for accepted writes to land; True if none is left pending."""
        return True

    def wait_written(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait at most ``timeout`` until the writes of ``keys`` accepted so far have landed
        everywhere they go; True if every key is then stored (a store that writes in ``put``
        only checks). For a writer that must know when readers elsewhere see its records."""
        return all(self.exists_many(keys))

    def exists(self, key: str) -> bool:
        return self.get(key) is not None

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        return [self.get(k) for k in keys]

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """Each value of ``keys`` in order as a lease the consumer releases (``None`` on a miss).

        The default borrows what ``get_many`` returns (and ignores ``place``); backends that can
        receive into ``pool``'s buffers, or overlap receiving with the consumer's work, override it.
        """
        for value in self.get_many(keys):
            yield None if value is None else borrow(value)

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        for key, value in items:
            self.put(key, value)

    def pin_host_memory(self, pinner: HostPinner) -> None:
        """Register the host memory values lie in with ``pinner`` from now on (see the module
        docstring); the default has none to register."""

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(1 for k in keys if self.delete(k))

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present (stops at the first absent one)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    @property
    def tiers(self) -> Sequence[StoreTier]:
        """The tiers lookups are answered from, fastest first; a single store is one: itself."""
        whole: _WholeStore | None = self.__dict__.get("_whole_tier")
        if whole is None:
            with _whole_lock:  # one speed per store, however many threads ask first
                name = str(self.describe().get("store") or type(self).__name__)
                whole = self.__dict__.setdefault("_whole_tier", _WholeStore(name, self, LinkSpeed(name)))
        return (whole,)

    def longest_prefix_by_tier(self, keys: Sequence[str]) -> list[int]:
        """How many leading ``keys`` each of ``tiers`` holds, in that order; one round trip per
        tier. A tiered store may leave tiers after one that holds every key unasked (0)."""
        return [self.longest_prefix(keys)]

    def exists_by_tier(self, keys: Sequence[str]) -> list[list[bool]]:
        """Which of ``keys`` each of ``tiers`` holds, in that order; one round trip per tier. A
        tiered store may leave tiers after those that together hold every key unasked (all False)."""
        return [self.exists_many(keys)]

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        """Stored length of each key's value (``None`` if absent); for stats, not the hot path."""
        out: list[int | None] = []
        for k in keys:
            v = self.get(k)
            out.append(None if v is None else len(v))
        return out

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        """Each value's size and first ``nbytes`` bytes (``None`` if absent); for tools, not the
        hot path. The default reads whole values; remote backends ask for the head only."""
        check_head_bytes(nbytes)
        out: list[Head | None] = []
        for value in self.get_many(keys):
            if value is None:
                out.append(None)
            else:
                view = memoryview(value).cast("B")
                out.append((len(view), bytes(view[:nbytes])))
        return out

    def describe(self) -> dict[str, Any]:
        """A JSON-able description for logs and tools; never contains secrets."""
        return {"store": type(self).__name__}

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class Evicting:
    """Mixin of stores that evict values on their own: listeners learn which keys went.

    A listener runs in the thread that evicted, after the keys are gone and outside the store's
    locks; it must be quick (hand the keys to a queue). An exception in it is logged, never
    raised into the write that caused the eviction.
    """

    # A tuple replaced whole on change: evictions read it without a lock.
    _eviction_listeners: tuple[EvictionListener, ...] = ()

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        self._eviction_listeners = (*self._eviction_listeners, listener)

    def remove_eviction_listener(self, listener: EvictionListener) -> None:
        self._eviction_listeners = tuple(x for x in self._eviction_listeners if x is not listener)

    def _evicted(self, keys: Sequence[str]) -> None:
        for listener in self._eviction_listeners:
            try:
                listener(keys)
            except Exception:  # a listener's bug must not fail the caller's write
                log.exception("eviction listener %r failed", listener)


class WrapperStore(Store):
    """A store that forwards every operation to ``inner``; subclasses override what they add.

    Every method of the contract, the batch forms included, is forwarded as it is, so a wrapper
    keeps the inner store's optimisations (pipelines, parallel requests), its ``is_local`` and
    its ``queues_writes``.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.is_local = inner.is_local
        self.queues_writes = inner.queues_writes

    @property
    def deadline(self) -> float | None:
        return self.inner.deadline

    def get(self, key: str) -> Value | None:
        return self.inner.get(key)

    def put(self, key: str, value: WriteValue) -> None:
        self.inner.put(key, value)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        return self.inner.iter_keys(prefix)

    def close(self) -> None:
        self.inner.close()

    def flush(self, timeout: float = 30.0) -> bool:
        return self.inner.flush(timeout)

    def wait_written(self, keys: Sequence[str], timeout: float) -> bool:
        return self.inner.wait_written(keys, timeout)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        return self.inner.get_many(keys)

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        if place is None or not takes_place(self.inner):
            return self.inner.get_into(keys, pool)
        return self.inner.get_into(keys, pool, place)

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        self.inner.put_many(items)

    def pin_host_memory(self, pinner: HostPinner) -> None:
        self.inner.pin_host_memory(pinner)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self.inner.delete_many(keys)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return self.inner.longest_prefix(keys)

    @property
    def tiers(self) -> Sequence[StoreTier]:
        return self.inner.tiers

    def longest_prefix_by_tier(self, keys: Sequence[str]) -> list[int]:
        return self.inner.longest_prefix_by_tier(keys)

    def exists_by_tier(self, keys: Sequence[str]) -> list[list[bool]]:
        return self.inner.exists_by_tier(keys)

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return self.inner.size_many(keys)

    def get_heads(self, keys: Sequence[str], nbytes: int) -> list[Head | None]:
        return self.inner.get_heads(keys, nbytes)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()
