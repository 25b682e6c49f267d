"""One tiered store per list of URLs and process, shared by every user in the process.

An engine builds several connector objects in one process (vLLM's scheduler and worker, when
they share a process); they must share one memory tier and one set of background writers, not
each build their own. ``acquire(urls)`` returns the process's store for ``urls`` (built on first
use) and ``release(urls, timeout)`` gives it back: the last user's release drains the write
queues for at most ``timeout`` and closes it; earlier releases only flush. Stores still held at
interpreter exit are closed then, draining for the longest ``flush_timeout`` their users gave
``acquire`` (else the store's own ``close_timeout``): an engine that exits without shutting its
connector down gets the drain it was configured for, and what is still queued then is dropped,
logged and counted (``kvstore_write_drops_total{reason="closed"}``). This hook is registered
before any adapter's (they import this module first), so it runs after theirs: adapters finish
their gathers into the store before it closes.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.stores.tiered import TieredStore

__all__ = ["acquire", "release"]

@dataclass
class _Entry:
    store: TieredStore
    users: int = 0
    #: The longest drain a user asked for (``acquire(flush_timeout=)``); None: the store's own.
    flush_timeout: float | None = None


_lock = threading.Lock()
_entries: dict[tuple[str, ...], _Entry] = {}


def acquire(urls: Sequence[str], flush_timeout: float | None = None) -> TieredStore:
    """The shared store of ``urls`` (always tiered, even for one URL: a shared tier then gets a
    background writer and a breaker). ``flush_timeout``: how long this user wants queued writes
    drained if the process exits while it still holds the store."""
    key = tuple(urls)
    with _lock:
        entry = _entries.get(key)
        if entry is None:
            entry = _entries[key] = _Entry(TieredStore.from_urls(list(key)))
        entry.users += 1
        if flush_timeout is not None:
            entry.flush_timeout = max(entry.flush_timeout or 0.0, flush_timeout)
        return entry.store


def release(urls: Sequence[str], timeout: float) -> None:
    """Give back one use of ``urls``' store; the last one closes it (draining at most ``timeout``)."""
    key = tuple(urls)
    with _lock:
        entry = _entries.get(key)
        if entry is None:
            return
        entry.users -= 1
        last = entry.users <= 0
        if last:
            del _entries[key]
    if last:
        entry.store.close(timeout)
    else:
        entry.store.flush(timeout)


@atexit.register
def _close_all() -> None:
    with _lock:
        entries = list(_entries.values())
        _entries.clear()
    for entry in entries:
        try:
            entry.store.close(entry.flush_timeout)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
