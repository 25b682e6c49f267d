"""The tiered store: fastest tier first, reads fall through, writes go down in the background.

Contract (on top of ``Store``'s):

* **Never raises for a tier's failure.** An outage, a timeout or a bug in one tier is a miss
  (reads) or a dropped write, counted in ``kvstore_errors_total{tier,kind}``; a tier that keeps
  failing is skipped by its circuit breaker (``breaker``) and probed again after a cooldown,
  so use resumes by itself when the tier is back. One log line per state change, not per call.
* **Reads** (``get``/``get_many``) ask the tiers in order and promote a hit from a lower tier
  into every tier above it (local tiers at once, shared tiers through their write queues).
* **Writes**: tiers with ``is_local=True`` (memory, file) are written synchronously; every other
  (shared) tier has a background writer with a bounded queue, even when it is the only tier, so
  a save never waits on the network. When a queue is full (``queue_items`` or ``queue_bytes``)
  the new write is **dropped and counted** (``kvstore_write_drops_total{tier,reason}``): the
  caller never blocks on a slow tier. Writes to a tier whose breaker is open are dropped the same
  way. Each queue coalesces writes of the same key (the latest value wins).
* **Read your writes**: a value still queued for a shared tier is served from the queue, and
  counts for ``exists``/``longest_prefix``; ``delete`` first withdraws queued writes of the key
  (and waits for one in flight) so a deleted key is not written back afterwards.
* ``longest_prefix`` is the maximum over tiers, one call (one round trip) per tier, stopping
  once a tier covers every key.
* ``flush(timeout)`` waits for queued writes; ``close(timeout)`` drains for at most ``timeout``
  then closes every tier.

Ownership: local tiers copy what ``put`` gives them. The shared tiers' queues hold the value
until it is sent: ``bytes`` as they are, ``Pieces`` owned by a lease by retaining that lease
(no copy: a record gathered into a pool buffer goes out from that buffer), anything else copied
once into a pool buffer (``pool``; ``bytes`` if the pool is full). ``get_into`` streams each
tier's values (a Redis tier receives later values while the caller verifies earlier ones) and
promotes hits from lower tiers by handing the same leased buffer to the tiers above; a hit the
caller's ``place`` landed elsewhere (a paged cache's blocks) is promoted from where its bytes
lie, copied by the tiers above before the caller gets it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from kvstore.buffers import BufferPool, Lease, Pieces, copy_bytes, default_pool
from kvstore.config import build
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import BYTES_READ, BYTES_WRITTEN
from kvstore.pinned import HostPinner
from kvstore.stores.base import LeaseStream, Place, Store, Value, WriteValue
from kvstore.stores.registry import open_backend
from kvstore.stores.tiered.config import TieredConfig
from kvstore.stores.tiered.tier import Tier, tier_names

__all__ = ["TieredStore"]

log = logging.getLogger("kvstore.stores")


class TieredStore(Store):
    """Stores stacked fastest first. See the module docstring for the contract."""

    Config = TieredConfig

    def __init__(self, stores: Sequence[Store], config: TieredConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, pool: BufferPool | None = None,
                 **options: Any) -> None:
        if not stores:
            raise ConfigError("a tiered store needs at least one tier")
        if config is not None and options:
            raise ConfigError("give TieredStore either config= or options, not both")
        self.config = config or build(TieredConfig, options, where="tiered store")
        self.pool = pool or default_pool()
        self._tiers = [Tier(s, n, self.config, clock=clock) for s, n in zip(stores, tier_names(stores))]
        self._writers = [t.writer for t in self._tiers if t.writer is not None]
        self.queues_writes = bool(self._writers)
        self._closed = False

    @classmethod
    def from_urls(cls, urls: Sequence[str], *, clock: Callable[[], float] = time.monotonic,
                  **options: Any) -> TieredStore:
        """Open each URL (fastest tier first) and stack them; ``options`` are ``TieredConfig`` fields."""
        config = build(TieredConfig, options, where="tiered store")
        stores: list[Store] = []
        try:
            for url in urls:
                stores.append(open_backend(url))
        except BaseException:
            for s in stores:
                s.close()
            raise
        return cls(stores, config, clock=clock)

    @property
    def tiers(self) -> Sequence[Tier]:
        """The stacked stores, fastest first, each with its breaker, writer and measured speed."""
        return self._tiers

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> Value | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        out: list[Value | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            if tier.writer is not None:  # values still on their way to this tier
                for j in missing:
                    queued = tier.writer.lookup(keys[j])
                    if isinstance(queued, Pieces):
                        out[j] = queued.tobytes()
                        queued.release()
                    else:
                        out[j] = queued
                missing = [j for j in missing if out[j] is None]
                if not missing:
                    break
            wanted = [keys[j] for j in missing]
            values = tier.call("get_many", wanted, None)
            if values is None:
                continue
            found: list[tuple[str, Value]] = []
            still: list[int] = []
            nbytes = 0
            for j, value in zip(missing, values):
                if value is None:
                    still.append(j)
                else:
                    out[j] = value
                    nbytes += len(value)
                    found.append((keys[j], value))
            if nbytes:
                BYTES_READ.inc(nbytes, tier=tier.name)
            if found and level and self.config.promote:
                self._write(self.tiers[:level], found)
            missing = still
        return out

    def get_into(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """The values in key order as leases, tier by tier, each tier's values streamed; a key
        is yielded as soon as it and every key before it are resolved. ``place`` goes to every
        tier: a hit in a lower one lands where the caller says too, and is promoted from the
        buffers it landed in (``_promoted``)."""
        resolved: dict[int, Lease | None] = {}
        missing = list(range(len(keys)))
        next_out = 0
        try:
            for level, tier in enumerate(self.tiers):
                if not missing:
                    break
                if tier.writer is not None:  # values still on their way to this tier
                    for j in missing:
                        queued = tier.writer.lookup(keys[j])
                        if queued is not None:
                            resolved[j] = _lease_of(queued, pool)
                            if isinstance(queued, Pieces):
                                queued.release()
                    missing = [j for j in missing if j not in resolved]
                still: list[int] = []
                nbytes = 0
                here = None
                landed: dict[int, list[memoryview]] = {}  # where the caller placed this tier's hits
                if place is not None:
                    here = functools.partial(_place_among, place, list(missing),
                                             landed if level and self.config.promote else None)
                stream = tier.stream([keys[j] for j in missing], pool, here)
                try:
                    for j, lease in zip(missing, stream):
                        if lease is None:
                            still.append(j)
                            continue
                        resolved[j] = lease
                        nbytes += lease.nbytes
                        if level and self.config.promote:
                            self._write(self.tiers[:level], [(keys[j], _promoted(lease, landed.pop(j, None)))])
                        while next_out in resolved:
                            yield resolved.pop(next_out)
                            next_out += 1
                finally:
                    stream.close()
                    if nbytes:
                        BYTES_READ.inc(nbytes, tier=tier.name)
                missing = still
            for j in range(next_out, len(keys)):
                next_out = j + 1
                yield resolved.pop(j, None)
        finally:
            for lease in resolved.values():
                if lease is not None:
                    lease.release()

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [j for j, p in enumerate(present) if not p]
            if not todo:
                break
            # Queued first: a write that lands meanwhile is then found by the store.
            queued = tier.writer.holds(keys[j] for j in todo) if tier.writer else [False] * len(todo)
            answers = tier.call("exists_many", [keys[j] for j in todo], [False] * len(todo))
            for j, a, q in zip(todo, answers, queued):
                present[j] = a or q
        return present

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return max(self.longest_prefix_by_tier(keys), default=0)

    def longest_prefix_by_tier(self, keys: Sequence[str]) -> list[int]:
        """How many leading ``keys`` each tier holds (its queued writes included), fastest tier
        first; tiers after one that holds every key are not asked (0). One round trip per tier;
        a tier that fails or is skipped holds none."""
        out = [0] * len(self.tiers)
        for i, tier in enumerate(self.tiers):
            queued = tier.writer.holds(keys) if tier.writer is not None else None
            if queued and any(queued):
                present = tier.call("exists_many", keys, [False] * len(keys))
                n = 0
                while n < len(keys) and (present[n] or queued[n]):
                    n += 1
            else:
                n = tier.call("longest_prefix", keys, 0)
            out[i] = n
            if n >= len(keys):
                break
        return out

    def exists_by_tier(self, keys: Sequence[str]) -> list[list[bool]]:
        """Which of ``keys`` each tier holds (its queued writes included), fastest tier first; tiers
        after those that together hold every key are not asked (all False). One round trip per
        tier; a tier that fails or is skipped holds none."""
        out = [[False] * len(keys) for _ in self.tiers]
        anywhere = [False] * len(keys)
        for i, tier in enumerate(self.tiers):
            if all(anywhere):
                break
            queued = tier.writer.holds(keys) if tier.writer is not None else [False] * len(keys)
            present = tier.call("exists_many", keys, [False] * len(keys))
            out[i] = [a or q for a, q in zip(present, queued)]
            anywhere = [a or b for a, b in zip(anywhere, out[i])]
        return out

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        sizes: list[int | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [j for j, s in enumerate(sizes) if s is None]
            if not todo:
                break
            if tier.writer is not None:
                for j in todo:
                    v = tier.writer.lookup(keys[j])
                    sizes[j] = None if v is None else len(v)
                    if isinstance(v, Pieces):
                        v.release()
                todo = [j for j in todo if sizes[j] is None]
            answers = tier.call("size_many", [keys[j] for j in todo], [None] * len(todo))
            for j, s in zip(todo, answers):
                sizes[j] = s
        return sizes

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            # Queued keys first: a write that lands meanwhile is then in the store's listing.
            queued = [k for k in tier.writer.keys() if k.startswith(prefix)] if tier.writer is not None else []
            keys = tier.iter_keys(prefix) + queued
            for k in keys:
                if k not in seen:
                    seen.add(k)
                    yield k

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: str, value: WriteValue) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        items = list(items)
        if items:
            self._write(self.tiers, items)

    def pin_host_memory(self, pinner: HostPinner) -> None:
        for tier in self.tiers:
            tier.store.pin_host_memory(pinner)

    def _write(self, tiers: Sequence[Tier], items: list[tuple[str, WriteValue]]) -> None:
        """Local tiers now, shared tiers through their queues (each holding the value until sent)."""
        kept: list[tuple[str, Value | Pieces]] | None = None
        for tier in tiers:
            if tier.writer is None:
                nbytes = sum(len(v) for _, v in items)
                if tier.write(items):
                    BYTES_WRITTEN.inc(nbytes, tier=tier.name)
            else:
                if kept is None:
                    kept = [(k, self._keepable(v)) for k, v in items]
                for k, v in kept:
                    tier.writer.submit(k, v.retain() if isinstance(v, Pieces) else v)
        for _, v in kept or ():
            if isinstance(v, Pieces):
                v.release()  # each writer holds its own reference now

    def _keepable(self, value: WriteValue) -> Value | Pieces:
        """``value`` in a form a queue may hold past this call; the caller owns one reference."""
        if isinstance(value, bytes):
            return value
        if isinstance(value, Pieces) and value.owner is not None:
            return value.retain()
        n = len(value) if isinstance(value, Pieces) else memoryview(value).nbytes
        lease = self.pool.lease(n)
        if lease is None:
            return value.tobytes() if isinstance(value, Pieces) else bytes(value)
        if isinstance(value, Pieces):
            value.copy_into(lease.view)
        else:
            copy_bytes(lease.view, value)  # with the GIL released for large values
        return Pieces([lease.view], owner=lease)

    def delete(self, key: str) -> bool:
        return self.delete_many([key]) > 0

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove ``keys`` from every tier; returns how many were present in at least one."""
        keys = list(keys)
        present = [False] * len(keys)
        for tier in self.tiers:
            if tier.writer is not None:
                held = tier.writer.holds(keys)
                wait = tier.store.deadline or 5.0
                for k in keys:
                    tier.writer.withdraw(k, wait)
            else:
                held = [False] * len(keys)
            answers = tier.call("exists_many", keys, [False] * len(keys))
            tier.call("delete_many", keys, 0)
            present = [p or a or h for p, a, h in zip(present, answers, held)]
        return sum(present)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        """A call asks the tiers one after another: at most the sum of their deadlines."""
        deadlines = [d for d in (t.store.deadline for t in self.tiers) if d is not None]
        return sum(deadlines) if deadlines else None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write was sent (or dropped); False if ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        return all(w.flush(max(0.0, deadline - time.monotonic())) for w in self._writers)

    def wait_written(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait (at most ``timeout``) until every shared tier's writer has sent the writes of
        ``keys`` it was given; False if one dropped any (a full queue, an open breaker, an error)
        or still holds one. Local tiers were written in ``put``. Asks no tier anything: the
        writers know what they sent."""
        deadline = time.monotonic() + timeout
        return all(w.wait_written(keys, max(0.0, deadline - time.monotonic())) for w in self._writers)

    def close(self, timeout: float | None = None) -> None:
        """Drain the write queues for at most ``timeout`` (``close_timeout``), then close every tier."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self.config.close_timeout if timeout is None else timeout)
        for writer in self._writers:
            writer.close(max(0.0, deadline - time.monotonic()))
        for tier in self.tiers:
            tier.stop()
            try:
                tier.store.close()
            except Exception:
                log.debug("kvstore tier %s: close failed", tier.name, exc_info=True)

    def stats(self) -> dict[str, Any]:
        """Per-tier state, queue depth and drops (JSON-able)."""
        tiers = []
        for tier in self.tiers:
            entry: dict[str, Any] = {"name": tier.name, "local": tier.local, "state": tier.breaker.state,
                                     "store": tier.store.describe()}
            if tier.breaker.last_error:
                entry["last_error"] = tier.breaker.last_error
            if tier.writer is not None:
                items, nbytes = tier.writer.depth()
                entry.update(queue_items=items, queue_bytes=nbytes, written=tier.writer.written,
                             dropped=tier.writer.dropped)
            tiers.append(entry)
        return {"tiers": tiers}

    def describe(self) -> dict[str, Any]:
        return {"store": "tiered", **self.stats()}


def _lease_of(value: Value | Pieces, pool: BufferPool) -> Lease:
    """A value still queued for a tier, as a lease the reader owns (a copy: the queue keeps its own)."""
    lease = pool.lease(len(value))
    if lease is None:  # not `or`: a lease of 0 bytes is falsy, and its pool bytes would leak
        lease = Lease(None, bytearray(len(value)), len(value))
    if isinstance(value, Pieces):
        value.copy_into(lease.view)
    else:
        copy_bytes(lease.view, value)  # with the GIL released for large values
    return lease


def _place_among(place: Place, asked: Sequence[int], landed: dict[int, list[memoryview]] | None,
                 i: int, view: memoryview) -> Iterator[Sequence[memoryview]]:
    """``place`` for a tier asked for ``keys[j] for j in asked``: its value i is the batch's
    ``asked[i]``. With ``landed``, ``landed[j]`` lists, in order, every buffer value j's last
    run filled (a retried value starts its list afresh)."""
    j = asked[i]
    if landed is None:
        return place(j, view)
    return _noting(place(j, view), landed.setdefault(j, []))


def _noting(targets: Iterator[Sequence[memoryview]], into: list[memoryview]) -> Iterator[Sequence[memoryview]]:
    into.clear()
    for buffers in targets:
        into.extend(buffers)
        yield buffers


def _promoted(lease: Lease, landed: list[memoryview] | None) -> Pieces:
    """A lower tier's hit as the value written to the tiers above: its lease (retained, not
    copied, by a queue), or, where the caller's ``place`` put some of its bytes outside the
    lease (a paged cache's blocks), the buffers it filled, in order. Those have no owner, so
    the tiers above copy them during ``_write`` (local tiers write them, queues take a copy):
    the caller may overwrite them once it has the lease."""
    if not landed or all(b.obj is lease.view.obj for b in landed):
        return Pieces([lease.view], owner=lease)
    return Pieces(landed)
