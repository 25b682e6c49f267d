"""One store in a tiered stack: the store, its circuit breaker and (shared tiers) its writer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.buffers import BufferPool
from kvstore.errors import StoreUnavailableError
from kvstore.metrics.catalog import ERRORS, LATENCY
from kvstore.stores.base import LeaseStream, Store
from kvstore.stores.tiered.breaker import CircuitBreaker
from kvstore.stores.tiered.config import TieredConfig
from kvstore.stores.tiered.speed import LinkSpeed
from kvstore.stores.tiered.writer import Writer

__all__ = ["Tier", "tier_names"]

log = logging.getLogger("kvstore.stores")
_ROUND_TRIPS = ("longest_prefix", "exists_many")  # calls that move no values: one round trip each
T = TypeVar("T")


class Tier:
    """One store in the stack, with its breaker and (for shared tiers) its background writer."""

    def __init__(self, store: Store, name: str, config: TieredConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.name = name
        self.local = bool(store.is_local)
        self.breaker = CircuitBreaker(name, failures=config.breaker_failures, cooldown=config.breaker_cooldown,
                                      max_cooldown=config.breaker_max_cooldown, clock=clock)
        self.writer: Writer | None = None if self.local else Writer(self, config)
        self.speed = LinkSpeed(name)

    def call(self, op: str, arg: Any, default: T) -> T:
        """``store.<op>(arg)`` guarded by the breaker; ``default`` when skipped or failed
        (counted, logged at debug level for unexpected errors, never raised)."""
        method: Callable[[Any], T] = getattr(self.store, op)
        return self._guarded(op, lambda: method(arg), default)

    def stream(self, keys: Sequence[str], pool: BufferPool) -> LeaseStream:
        """``store.get_into(keys, pool)`` guarded by the breaker: skipped or failing, the keys not
        yet yielded are misses (the failure counted, never raised)."""
        if not keys:
            return
        if not self.breaker.allow():
            yield from [None] * len(keys)
            return
        start = time.perf_counter()
        yielded = nbytes = 0
        inner = self.store.get_into(keys, pool)
        try:
            for lease in inner:
                yielded += 1
                nbytes += 0 if lease is None else lease.nbytes
                yield lease
        except Exception as exc:  # noqa: BLE001 - a tier's failure must never reach the engine
            self._failed("get_into", exc)
            yield from [None] * (len(keys) - yielded)
            return
        finally:
            inner.close()
        seconds = time.perf_counter() - start
        LATENCY.observe(seconds, op=f"{self.name}.get_into")
        self.speed.read(nbytes, seconds)
        self.breaker.success()

    def iter_keys(self, prefix: str) -> list[str]:
        return self._guarded("iter_keys", lambda: list(self.store.iter_keys(prefix)), [])

    def write(self, items: Sequence[tuple[str, Any]]) -> bool:
        """``store.put_many(items)`` guarded by the breaker; True if it succeeded."""
        def put() -> bool:
            self.store.put_many(items)
            return True

        return self._guarded("put_many", put, False)

    def _failed(self, op: str, exc: Exception) -> None:
        kind = "unavailable" if isinstance(exc, StoreUnavailableError) else "error"
        ERRORS.inc(tier=self.name, kind=kind)
        if kind == "error":
            log.debug("kvstore tier %s: %s failed", self.name, op, exc_info=True)
        self.breaker.failure(f"{type(exc).__name__}: {exc}")

    def _guarded(self, op: str, fn: Callable[[], T], default: T) -> T:
        if not self.breaker.allow():
            return default
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a tier's failure must never reach the engine
            self._failed(op, exc)
            return default
        seconds = time.perf_counter() - start
        LATENCY.observe(seconds, op=f"{self.name}.{op}")
        if op in _ROUND_TRIPS:
            self.speed.round_trip(seconds)
        self.breaker.success()
        return result


def tier_names(stores: Sequence[Store]) -> list[str]:
    names: list[str] = []
    for store in stores:
        base = str(store.describe().get("store") or type(store).__name__)
        name, n = base, 2
        while name in names:
            name, n = f"{base}#{n}", n + 1
        names.append(name)
    return names
