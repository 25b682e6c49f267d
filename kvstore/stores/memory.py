"""``memory://`` — an in-process LRU store bounded in bytes.

The top tier of a replica: the fastest, private to the process. Values are copied on ``put``
(callers reuse their staging buffers) and returned as the stored immutable ``bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvstore.buffers import Pieces
from kvstore.config import build, option, query_options
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import EVICTIONS
from kvstore.stores.base import Evicting, Store, Value, WriteValue
from kvstore.types import array_view

_HUGE = 1 << 20  # values at least this large live in numpy buffers (transparent huge pages)


def _own(value: WriteValue) -> Value:
    """An immutable private copy of ``value``: ``bytes``, or for large values a read-only view of
    a numpy buffer (its huge pages fault in several times faster than a fresh ``bytes``)."""
    if isinstance(value, bytes):
        return value
    n = len(value) if isinstance(value, Pieces) else memoryview(value).nbytes
    if n < _HUGE:
        return value.tobytes() if isinstance(value, Pieces) else bytes(value)
    arr = np.empty(n, dtype=np.uint8)
    view = array_view(arr)
    if isinstance(value, Pieces):
        value.copy_into(view)
    else:
        view[:] = memoryview(value).cast("B")
    arr.flags.writeable = False
    return array_view(arr)


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
        self._data: OrderedDict[str, Value] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        return cls(MemoryConfig.from_url(url))

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> Value | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def put(self, key: str, value: WriteValue) -> None:
        data = _own(value)
        size = len(data)
        gone: list[str] = []
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            if size > self.config.max_bytes:
                return  # larger than the whole tier: keeping it would evict everything else
            while self._data and self._bytes + size > self.config.max_bytes:
                evicted_key, evicted = self._data.popitem(last=False)
                self._bytes -= len(evicted)
                EVICTIONS.inc(store="memory")
                gone.append(evicted_key)
            self._data[key] = data
            self._bytes += size
        if gone and self._eviction_listeners:
            self._evicted(gone)

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(old)
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
            self._data.clear()
            self._bytes = 0

    def describe(self) -> dict[str, Any]:
        return {"store": "memory", "max_bytes": self.config.max_bytes, "used_bytes": self._bytes,
                "items": len(self._data)}
