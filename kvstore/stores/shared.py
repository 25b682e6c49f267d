"""One tiered store per list of URLs and process, shared by every user in the process.

An engine builds several connector objects in one process (vLLM's scheduler and worker, when
they share a process); they must share one memory tier and one set of background writers, not
each build their own. ``acquire(urls)`` returns the process's store for ``urls`` (built on first
use) and ``release(urls, timeout)`` gives it back: the last user's release drains the write
queues for at most ``timeout`` and closes it; earlier releases only flush. Stores still held at
interpreter exit are closed (bounded) then.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.stores.tiered import TieredStore

__all__ = ["acquire", "release"]

_EXIT_TIMEOUT = 5.0


@dataclass
class _Entry:
    store: TieredStore
    users: int = 0


_lock = threading.Lock()
_entries: dict[tuple[str, ...], _Entry] = {}


def acquire(urls: Sequence[str]) -> TieredStore:
    """The shared store of ``urls`` (always tiered, even for one URL: a shared tier then gets a
    background writer and a breaker)."""
    key = tuple(urls)
    with _lock:
        entry = _entries.get(key)
        if entry is None:
            entry = _entries[key] = _Entry(TieredStore.from_urls(list(key)))
        entry.users += 1
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
            entry.store.close(_EXIT_TIMEOUT)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
