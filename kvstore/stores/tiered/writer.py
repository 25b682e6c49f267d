"""The background writer of one shared tier: a bounded, coalescing queue drained by one thread.

``submit`` never blocks beyond a lock: a full queue (``queue_items`` or ``queue_bytes``), a
tier whose breaker is open or a closed writer drops the new write and counts it
(``kvstore_write_drops_total{tier,reason}``). Writes of the same key coalesce (the latest value
wins). Values queued or in flight are visible to readers (``lookup``, ``holds``), so a replica
reads its own writes.

A submitted value is the writer's: ``bytes``, or ``Pieces`` whose owner lease the writer
releases once the value is sent, replaced, withdrawn or dropped.

``wait_written(keys)`` tells a writer that must know when readers elsewhere see its records (a
P/D prefill) whether they were sent: the writer remembers the outcome of its last ``OUTCOMES``
keys (sent, or dropped), so the answer costs no round trip.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstore.buffers import Pieces
from kvstore.metrics.catalog import BYTES_WRITTEN, QUEUE_BYTES, QUEUE_ITEMS, WRITE_DROPS
from kvstore.stores.base import Value
from kvstore.stores.tiered.breaker import OPEN
from kvstore.stores.tiered.config import TieredConfig

if TYPE_CHECKING:
    from kvstore.stores.tiered.tier import Tier

__all__ = ["Writer"]

log = logging.getLogger("kvstore.stores")

#: Outcomes (sent or dropped) the writer remembers, most recent keys first out.
OUTCOMES = 16384


class Writer:
    """The background writer of one shared tier: a bounded, coalescing queue and one thread."""

    def __init__(self, tier: Tier, config: TieredConfig) -> None:
        self.tier = tier
        self.max_items = config.queue_items
        self.max_bytes = config.queue_bytes
        self.batch_bytes = config.batch_bytes
        self._cond = threading.Condition()
        self._pending: OrderedDict[str, Value | Pieces] = OrderedDict()
        self._pending_bytes = 0
        self._in_flight: dict[str, Value | Pieces] = {}
        self._outcomes: OrderedDict[str, bool] = OrderedDict()
        self._closed = False
        self._dropping = False
        self.dropped = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name=f"kvstore-writer-{tier.name}", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------------
    def submit(self, key: str, data: Value | Pieces) -> bool:
        """Queue a write (the writer now owns ``data``); False (and counted) if it was dropped.
        Never blocks beyond a lock."""
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
                if old is not None:
                    _release(old)
                self._outcomes.pop(key, None)
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
            self._note([key], False)
            if reason == "queue_full" and not self._dropping:
                self._dropping = True
                log.warning("kvstore tier %s: write queue full (%d items, %d bytes), dropping new writes",
                            self.tier.name, len(self._pending), self._pending_bytes)
        _release(data)
        WRITE_DROPS.inc(tier=self.tier.name, reason=reason)
        return False

    def lookup(self, key: str) -> Value | Pieces | None:
        """The value queued or in flight for ``key``, retained for the caller (who releases a
        ``Pieces``), or ``None``."""
        with self._cond:
            value = self._pending.get(key)
            if value is None:
                value = self._in_flight.get(key)
            return value.retain() if isinstance(value, Pieces) else value

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
                _release(old)
                self._publish()
            while key in self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def wait_written(self, keys: Iterable[str], timeout: float) -> bool:
        """Wait (at most ``timeout``) until none of ``keys`` is queued or in flight; True if each
        was then sent (a key this writer never had, or long forgotten, counts as sent). False if
        one was dropped, or still waits when the time runs out. No round trip to the tier."""
        wanted = set(keys)
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(k in self._pending or k in self._in_flight for k in wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return all(self._outcomes.get(k, True) for k in wanted)

    def _note(self, keys: Iterable[str], sent: bool) -> None:
        """Remember what became of ``keys`` (under the lock)."""
        for key in keys:
            self._outcomes[key] = sent
            self._outcomes.move_to_end(key)
        while len(self._outcomes) > OUTCOMES:
            self._outcomes.popitem(last=False)

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
            ok = not skipped and self.tier.write(batch)
            with self._cond:
                self._in_flight.clear()
                for _, data in batch:
                    _release(data)
                self._note([k for k, _ in batch], ok)
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
            self._note(list(self._pending), False)
            for data in self._pending.values():
                _release(data)
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


def _release(value: Value | Pieces) -> None:
    if isinstance(value, Pieces):
        value.release()
