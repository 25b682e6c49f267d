"""The tiered store: fastest tier first, reads fall through, writes go down in the background.

Contract (on top of ``Store``'s):

* **Never raises for a tier's failure.** An outage, a timeout or a bug in one tier is a miss
  (reads) or a dropped write, counted in ``kvstore_errors_total{tier,kind}``; a tier that keeps
  failing is skipped by its circuit breaker (``breaker.py``) and probed again after a cooldown,
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
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from kvstore.config import build, option
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.metrics import BYTES_READ, BYTES_WRITTEN, ERRORS, LATENCY, REGISTRY
from kvstore.stores.base import Buffer, Store
from kvstore.stores.breaker import OPEN, CircuitBreaker

log = logging.getLogger("kvstore.stores")
T = TypeVar("T")

QUEUE_ITEMS = REGISTRY.gauge("kvstore_write_queue_items", "Writes waiting for a shared tier.", ("tier",))
QUEUE_BYTES = REGISTRY.gauge("kvstore_write_queue_bytes", "Bytes waiting to be written to a shared tier.", ("tier",))
WRITE_DROPS = REGISTRY.counter("kvstore_write_drops_total",
                               "Background writes dropped: queue_full, tier_unavailable, error or closed.",
                               ("tier", "reason"))


@dataclass(frozen=True)
class TieredConfig:
    queue_items: int = option(1024, help="Writes a shared tier's queue holds before new ones are dropped.")
    queue_bytes: int = option(2 << 30, kind="size", help="Bytes a shared tier's queue holds before new writes are dropped.")
    batch_bytes: int = option(128 << 20, kind="size", help="Bytes a background writer sends in one batch.")
    breaker_failures: int = option(3, help="Consecutive failures that take a tier out of use.")
    breaker_cooldown: float = option(2.0, kind="duration", help="How long a failed tier is skipped before a probe.")
    breaker_max_cooldown: float = option(30.0, kind="duration", help="Longest skip after repeated failed probes.")
    promote: bool = option(True, help="Copy hits from lower tiers into the tiers above.")
    close_timeout: float = option(10.0, kind="duration", help="How long close() waits for queued writes.")

    def __post_init__(self) -> None:
        for name in ("queue_items", "batch_bytes", "breaker_failures"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")


class _Writer:
    """The background writer of one shared tier: a bounded, coalescing queue and one thread."""

    def __init__(self, tier: "_Tier", config: TieredConfig) -> None:
        self.tier = tier
        self.max_items = config.queue_items
        self.max_bytes = config.queue_bytes
        self.batch_bytes = config.batch_bytes
        self._cond = threading.Condition()
        self._pending: OrderedDict[str, bytes] = OrderedDict()
        self._pending_bytes = 0
        self._in_flight: dict[str, bytes] = {}
        self._closed = False
        self._dropping = False
        self.dropped = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name=f"kvstore-writer-{tier.name}", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------------
    def submit(self, key: str, data: bytes) -> bool:
        """Queue a write; False (and counted) if it was dropped. Never blocks beyond a lock."""
        reason = None
        with self._cond:
            old = self._pending.get(key)
            grow = len(data) - (len(old) if old is not None else 0)
            if self._closed:
                reason = "closed"
            elif self.tier.breaker.state == OPEN:
                reason = "tier_unavailable"
            elif old is None and self._pending and (
                    len(self._pending) >= self.max_items or self._pending_bytes + grow > self.max_bytes):
                # (An empty queue takes one value even if it is larger than queue_bytes.)
                reason = "queue_full"
            if reason is None:
                self._pending[key] = data
                self._pending_bytes += grow
                if self._dropping:
                    self._dropping = False
                    log.info("kvstore tier %s: write queue accepting again (%d dropped so far)",
                             self.tier.name, self.dropped)
                self._publish()
                self._cond.notify_all()
                return True
            self.dropped += 1
            if reason == "queue_full" and not self._dropping:
                self._dropping = True
                log.warning("kvstore tier %s: write queue full (%d items, %d bytes), dropping new writes",
                            self.tier.name, len(self._pending), self._pending_bytes)
        WRITE_DROPS.inc(tier=self.tier.name, reason=reason)
        return False

    def lookup(self, key: str) -> bytes | None:
        with self._cond:
            value = self._pending.get(key)
            return value if value is not None else self._in_flight.get(key)

    def holds(self, keys: Iterable[str]) -> list[bool]:
        with self._cond:
            return [k in self._pending or k in self._in_flight for k in keys]

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._pending) + list(self._in_flight)

    def withdraw(self, key: str, timeout: float) -> None:
        """Forget a queued write of ``key`` and wait (bounded) for one in flight to land."""
        deadline = time.monotonic() + timeout
        with self._cond:
            old = self._pending.pop(key, None)
            if old is not None:
                self._pending_bytes -= len(old)
                self._publish()
            while key in self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return len(self._pending) + len(self._in_flight), self._pending_bytes

    # -- consumer side -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:  # closed and drained
                    return
                batch_bytes = 0
                while self._pending and (not self._in_flight or batch_bytes < self.batch_bytes):
                    key, data = self._pending.popitem(last=False)
                    self._in_flight[key] = data
                    batch_bytes += len(data)
                self._pending_bytes -= batch_bytes
                self._publish()
                batch = list(self._in_flight.items())
            skipped = not self.tier.breaker.would_allow()
            ok = not skipped and self.tier.call("put_many", lambda: self.tier.store.put_many(batch), False,
                                                success=True)
            with self._cond:
                self._in_flight.clear()
                if ok:
                    self.written += len(batch)
                else:
                    self.dropped += len(batch)
                self._cond.notify_all()
            if ok:
                BYTES_WRITTEN.inc(batch_bytes, tier=self.tier.name)
            else:
                WRITE_DROPS.inc(len(batch), tier=self.tier.name, reason="tier_unavailable" if skipped else "error")

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> bool:
        """Drain for at most ``timeout``; what is still queued then is dropped."""
        drained = self.flush(timeout)
        with self._cond:
            self._closed = True
            lost = len(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self.dropped += lost
            self._publish()
            self._cond.notify_all()
        if lost:
            WRITE_DROPS.inc(lost, tier=self.tier.name, reason="closed")
            log.warning("kvstore tier %s: closed with %d writes not sent", self.tier.name, lost)
        self._thread.join(max(0.0, timeout) + 0.1 if drained else 0.1)
        return drained

    def _publish(self) -> None:
        QUEUE_ITEMS.set(len(self._pending), tier=self.tier.name)
        QUEUE_BYTES.set(self._pending_bytes, tier=self.tier.name)


class _Tier:
    """One store in the stack, with its breaker and (for shared tiers) its background writer."""

    def __init__(self, store: Store, name: str, config: TieredConfig) -> None:
        self.store = store
        self.name = name
        self.local = bool(store.is_local)
        self.breaker = CircuitBreaker(name, failures=config.breaker_failures, cooldown=config.breaker_cooldown,
                                      max_cooldown=config.breaker_max_cooldown)
        self.writer: _Writer | None = None if self.local else _Writer(self, config)

    def call(self, op: str, fn: Callable[[], T], default: T, *, success: Any = None) -> T:
        """``fn()`` guarded by the breaker; ``default`` when skipped or failed (counted, never raised).

        ``success``, when given, is returned instead of ``fn()``'s result on success.
        """
        if not self.breaker.allow():
            return default
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a tier's failure must never reach the engine
            kind = "unavailable" if isinstance(exc, StoreUnavailableError) else "error"
            ERRORS.inc(tier=self.name, kind=kind)
            if kind == "error":
                log.debug("kvstore tier %s: %s failed", self.name, op, exc_info=True)
            self.breaker.failure(f"{type(exc).__name__}: {exc}")
            return default
        LATENCY.observe(time.perf_counter() - start, op=f"{self.name}.{op}")
        self.breaker.success()
        return result if success is None else success


def _tier_names(stores: Sequence[Store]) -> list[str]:
    names: list[str] = []
    for store in stores:
        base = str(store.describe().get("store") or type(store).__name__)
        name, n = base, 2
        while name in names:
            name, n = f"{base}#{n}", n + 1
        names.append(name)
    return names


class TieredStore(Store):
    """Stores stacked fastest first. See the module docstring for the contract."""

    Config = TieredConfig

    def __init__(self, stores: Sequence[Store], config: TieredConfig | None = None, **options: Any) -> None:
        if not stores:
            raise ConfigError("a tiered store needs at least one tier")
        if config is not None and options:
            raise ConfigError("give TieredStore either config= or options, not both")
        self.config = config or build(TieredConfig, options, where="tiered store")
        self.tiers = [_Tier(s, n, self.config) for s, n in zip(stores, _tier_names(stores))]
        self._writers = [t.writer for t in self.tiers if t.writer is not None]
        self._closed = False

    @classmethod
    def from_urls(cls, urls: Sequence[str], **options: Any) -> "TieredStore":
        """Open each URL (fastest tier first) and stack them; ``options`` are ``TieredConfig`` fields."""
        from kvstore.stores import open_store

        config = build(TieredConfig, options, where="tiered store")
        stores: list[Store] = []
        try:
            for url in urls:
                stores.append(open_store(url))
        except BaseException:
            for s in stores:
                s.close()
            raise
        return cls(stores, config)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | memoryview | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = [None] * len(keys)
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
            values = tier.call("get_many", lambda: tier.store.get_many(wanted), None)
            if values is None:
                continue
            found: list[tuple[str, bytes | memoryview]] = []
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
            answers = tier.call("exists_many", lambda: tier.store.exists_many([keys[j] for j in todo]),
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
                present = tier.call("exists_many", lambda: tier.store.exists_many(keys), [False] * len(keys))
                n = 0
                while n < len(keys) and (present[n] or queued[n]):
                    n += 1
            else:
                n = tier.call("longest_prefix", lambda: tier.store.longest_prefix(keys), 0)
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
            answers = tier.call("size_many", lambda: tier.store.size_many([keys[j] for j in todo]), [None] * len(todo))
            for j, s in zip(todo, answers):
                sizes[j] = s
        return sizes

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            keys = tier.call("iter_keys", lambda: list(tier.store.iter_keys(prefix)), [])
            if tier.writer is not None:
                keys += [k for k in tier.writer.keys() if k.startswith(prefix)]
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

    def _write(self, tiers: Sequence[_Tier], items: list[tuple[str, Any]]) -> None:
        """Local tiers now, shared tiers through their queues (values must be immutable bytes there)."""
        queued: list[tuple[str, bytes]] | None = None
        for tier in tiers:
            if tier.writer is None:
                nbytes = sum(len(v) for _, v in items)
                if tier.call("put_many", lambda: tier.store.put_many(items), False, success=True):
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
                wait = self._deadline(tier)
                for k in keys:
                    tier.writer.withdraw(k, wait)
            else:
                held = [False] * len(keys)
            answers = tier.call("exists_many", lambda: tier.store.exists_many(keys), [False] * len(keys))
            tier.call("delete_many", lambda: tier.store.delete_many(keys), 0)
            present = [p or a or h for p, a, h in zip(present, answers, held)]
        return sum(present)

    def _deadline(self, tier: _Tier) -> float:
        return float(tier.store.describe().get("timeout") or 5.0)

    # -- lifecycle -----------------------------------------------------------------------------
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
            try:
                tier.store.close()
            except Exception:  # noqa: BLE001 - closing must not fail because a tier is gone
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
