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

The value given to ``put`` is copied once (to ``bytes``) when it is not ``bytes`` already; every
tier and queue shares that copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from kvstore.config import build
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import BYTES_READ, BYTES_WRITTEN
from kvstore.stores.base import Buffer, Store, Value
from kvstore.stores.registry import open_backend
from kvstore.stores.tiered.config import TieredConfig
from kvstore.stores.tiered.tier import Tier, tier_names

__all__ = ["TieredStore"]

log = logging.getLogger("kvstore.stores")


class TieredStore(Store):
    """Stores stacked fastest first. See the module docstring for the contract."""

    Config = TieredConfig

    def __init__(self, stores: Sequence[Store], config: TieredConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, **options: Any) -> None:
        if not stores:
            raise ConfigError("a tiered store needs at least one tier")
        if config is not None and options:
            raise ConfigError("give TieredStore either config= or options, not both")
        self.config = config or build(TieredConfig, options, where="tiered store")
        self.tiers = [Tier(s, n, self.config, clock=clock) for s, n in zip(stores, tier_names(stores))]
        self._writers = [t.writer for t in self.tiers if t.writer is not None]
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
                    out[j] = tier.writer.lookup(keys[j])
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

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [j for j, p in enumerate(present) if not p]
            if not todo:
                break
            answers = tier.call("exists_many", [keys[j] for j in todo],
                                [False] * len(todo))
            queued = tier.writer.holds(keys[j] for j in todo) if tier.writer else [False] * len(todo)
            for j, a, q in zip(todo, answers, queued):
                present[j] = a or q
        return present

    def longest_prefix(self, keys: Sequence[str]) -> int:
        best = 0
        for tier in self.tiers:
            if best >= len(keys):
                break
            queued = tier.writer.holds(keys) if tier.writer is not None else None
            if queued and any(queued):
                # Writes still queued count too: ask presence of every key, one round trip.
                present = tier.call("exists_many", keys, [False] * len(keys))
                n = 0
                while n < len(keys) and (present[n] or queued[n]):
                    n += 1
            else:
                n = tier.call("longest_prefix", keys, 0)
            best = max(best, n)
        return best

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
    def put(self, key: str, value: Buffer) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> None:
        owned = [(k, v if isinstance(v, bytes) else bytes(memoryview(v).cast("B"))) for k, v in items]
        if owned:
            self._write(self.tiers, owned)

    def _write(self, tiers: Sequence[Tier], items: list[tuple[str, Any]]) -> None:
        """Local tiers now, shared tiers through their queues (values must be immutable bytes there)."""
        queued: list[tuple[str, bytes]] | None = None
        for tier in tiers:
            if tier.writer is None:
                nbytes = sum(len(v) for _, v in items)
                if tier.write(items):
                    BYTES_WRITTEN.inc(nbytes, tier=tier.name)
            else:
                if queued is None:
                    queued = [(k, v if isinstance(v, bytes) else bytes(v)) for k, v in items]
                for k, v in queued:
                    tier.writer.submit(k, v)

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
