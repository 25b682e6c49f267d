"""Stores: the contract (``base``), the backends (one module or package each), the scheme table
(``registry``), the tiered store (``tiered``) and ``open_store``, which builds any of them from
a URL or, from a list of URLs, a tiered store (fastest tier first).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import ConfigError
from kvstore.stores.base import Buffer, Store, Value, WrapperStore
from kvstore.stores.registry import Backend, backend_class, known_schemes, open_backend, register_backend
from kvstore.stores.tiered import TieredConfig, TieredStore

__all__ = ["Backend", "Buffer", "Store", "TieredConfig", "TieredStore", "Value", "WrapperStore", "backend_class",
           "known_schemes", "open_store", "register_backend"]


def open_store(url: str | Sequence[str]) -> Store:
    """Build a store from a URL, or a tiered store from a list of URLs (fastest tier first).

    ``memory://?max_bytes=8GiB``, ``file:///var/cache/kv``, ``shm://NAME?max_bytes=8GiB`` (shared by the
    processes of a host), ``redis://:pw@host:6379/0?ttl=1h``, ``redis+cluster://host:7000``,
    ``redis+shards://h1:6379,h2:6379``, ``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000``.
    Raises ``ConfigError`` (and nothing else) for a URL it cannot use.
    """
    if isinstance(url, str):
        return open_backend(url)
    urls = list(url)
    if not urls:
        raise ConfigError("open_store() needs at least one store URL")
    if len(urls) == 1:
        return open_backend(urls[0])
    return TieredStore.from_urls(urls)
