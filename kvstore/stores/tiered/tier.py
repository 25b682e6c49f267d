"""One store in a tiered stack: the store, its circuit breaker, its prober and (shared tiers) its writer.

Every call goes through ``_guarded``: skipped while the breaker is not closed or once the tier
is stopped (its store is being closed: a miss, never a call into a closed store), a failure counted
and reported to the breaker (an expired deadline, ``StoreTimeoutError``, opens it at once). No
caller ever probes a tier that is out of use: while the breaker is open, a daemon thread of
the tier (``kvstore-probe-<tier>``) waits for the cooldown and probes with one cheap call
(``exists`` of a key nobody writes), bounded by the store's own deadline, so a frozen server
costs an engine thread at most the one call that found it frozen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.buffers import BufferPool
from kvstore.errors import StoreTimeoutError, StoreUnavailableError
from kvstore.metrics.catalog import ERRORS, LATENCY
from kvstore.stores.base import LeaseStream, Place, Store, takes_place
from kvstore.stores.speed import LinkSpeed
from kvstore.stores.tiered.breaker import CLOSED, CircuitBreaker
from kvstore.stores.tiered.config import TieredConfig
from kvstore.stores.tiered.writer import Writer

__all__ = ["Tier", "tier_names"]

log = logging.getLogger("kvstore.stores")
_ROUND_TRIPS = ("longest_prefix", "exists_many")  # calls that move no values: one round trip each
T = TypeVar("T")
#: The key the prober asks about: absent everywhere, so a probe moves no data.
PROBE_KEY = "kvstore-probe/absent"
_PROBE_POLL = 0.05  # seconds: the prober re-reads the breaker's clock this often (tests move it)


class Tier:
    """One store in the stack, with its breaker and (for shared tiers) its background writer."""

    def __init__(self, store: Store, name: str, config: TieredConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.name = name
        self.local = bool(store.is_local)
        self.breaker = CircuitBreaker(name, failures=config.breaker_failures, cooldown=config.breaker_cooldown,
                                      max_cooldown=config.breaker_max_cooldown, clock=clock, background_probe=True)
        self._prober: threading.Thread | None = None
        self._prober_lock = threading.Lock()
        self._stopped = threading.Event()
        self.probes = 0
        self.writer: Writer | None = None if self.local else Writer(self, config)
        self.speed = LinkSpeed(name)

    def call(self, op: str, arg: Any, default: T) -> T:
        """``store.<op>(arg)`` guarded by the breaker; ``default`` when skipped or failed
        (counted, logged at debug level for unexpected errors, never raised)."""
        method: Callable[[Any], T] = getattr(self.store, op)
        return self._guarded(op, lambda: method(arg), default)

    def stream(self, keys: Sequence[str], pool: BufferPool, place: Place | None = None) -> LeaseStream:
        """``store.get_into(keys, pool, place)`` guarded by the breaker: skipped or failing, the keys not
        yet yielded are misses (the failure counted, never raised).

        The read is timed (``speed``) however the stream ends: consumers stop asking once they
        have what they need (``zip`` with their keys), which closes the stream before its end."""
        if not keys:
            return
        if self._stopped.is_set() or not self.breaker.allow():
            yield from [None] * len(keys)
            return
        start = time.perf_counter()
        yielded = nbytes = 0
        failed = False
        placed = place is not None and takes_place(self.store)
        inner = self.store.get_into(keys, pool, place) if placed else self.store.get_into(keys, pool)
        try:
            for lease in inner:
                yielded += 1
                nbytes += 0 if lease is None else lease.nbytes
                yield lease
        except Exception as exc:  # noqa: BLE001 - a tier's failure must never reach the engine
            failed = True
            self._failed("get_into", exc)
            yield from [None] * (len(keys) - yielded)
        finally:
            inner.close()
            if not failed:
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
        self.breaker.failure(f"{op}: {type(exc).__name__}: {exc}", trip=isinstance(exc, StoreTimeoutError))
        self._start_prober()

    def _guarded(self, op: str, fn: Callable[[], T], default: T) -> T:
        if self._stopped.is_set() or not self.breaker.allow():
            return default  # stopped: the tiered store closed its stores (a miss, not a failure)
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

    # -- the prober ------------------------------------------------------------------------------
    def _start_prober(self) -> None:
        if self.breaker.state == CLOSED or self._stopped.is_set():
            return
        with self._prober_lock:
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_until_closed, name=f"kvstore-probe-{self.name}",
                                                daemon=True)
                self._prober.start()

    def _probe_until_closed(self) -> None:
        while not self._stopped.is_set() and self.breaker.state != CLOSED:
            if not self.breaker.probe_due():
                self._stopped.wait(min(_PROBE_POLL, max(self.breaker.seconds_to_probe(), 0.001)))
                continue
            self.probes += 1
            try:
                self.store.exists(PROBE_KEY)
            except Exception as exc:
                log.debug("kvstore tier %s: probe failed", self.name, exc_info=True)
                ERRORS.inc(tier=self.name, kind="unavailable" if isinstance(exc, StoreUnavailableError) else "error")
                self.breaker.failure(f"probe: {type(exc).__name__}: {exc}")
            else:
                self.breaker.success()

    def stop(self) -> None:
        """Stop the prober and every call (the tiered store is closing its stores, once its
        writers drained): from now on reads are misses and writes fail, none reaching the store."""
        self._stopped.set()
        prober = self._prober
        if prober is not None:
            prober.join(timeout=0.1)


def tier_names(stores: Sequence[Store]) -> list[str]:
    names: list[str] = []
    for store in stores:
        base = str(store.describe().get("store") or type(store).__name__)
        name, n = base, 2
        while name in names:
            name, n = f"{base}#{n}", n + 1
        names.append(name)
    return names
