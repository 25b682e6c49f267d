"""Store backends and ``open_store``, which builds one from a URL (or a tier list from several).

Backends are registered by URL scheme as ``"module:Class"`` strings and imported on first
use, so a missing optional client (redis-py, boto3) only matters to users of that scheme.
Third-party backends register themselves with ``register_backend``.
"""

from __future__ import annotations

import importlib
from typing import Sequence
from urllib.parse import urlsplit

from kvstore.config import redact_url
from kvstore.errors import ConfigError
from kvstore.stores.base import Buffer, Store

__all__ = ["Buffer", "Store", "open_store", "register_backend", "backend_class", "known_schemes"]

_BACKENDS: dict[str, str] = {
    "memory": "kvstore.stores.memory:MemoryStore",
    "file": "kvstore.stores.file:FileStore",
    "redis": "kvstore.stores.redis:RedisStore",
    "rediss": "kvstore.stores.redis:RedisStore",
    "unix": "kvstore.stores.redis:RedisStore",
    "redis+cluster": "kvstore.stores.redis:RedisClusterStore",
    "rediss+cluster": "kvstore.stores.redis:RedisClusterStore",
    "s3": "kvstore.stores.s3:S3Store",
}

# Which extra installs the client a scheme needs, for the error when it is missing.
_EXTRAS = {"redis": "redis", "rediss": "redis", "unix": "redis", "redis+cluster": "redis",
           "rediss+cluster": "redis", "s3": "s3"}


def register_backend(scheme: str, target: str) -> None:
    """Serve ``scheme://`` URLs with ``target`` (``"package.module:StoreClass"``)."""
    _BACKENDS[scheme] = target


def known_schemes() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(scheme: str) -> type[Store]:
    """The store class registered for ``scheme``; ``ConfigError`` if none is."""
    target = _BACKENDS.get(scheme)
    if target is None:
        raise ConfigError(
            f"unknown store scheme {scheme + '://'!r}; accepted: "
            + ", ".join(s + "://" for s in known_schemes())
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(scheme)
        hint = f"; install it with: pip install 'kvstore[{extra}]'" if extra else ""
        raise ConfigError(f"the {scheme}:// store needs a package that is not installed ({exc}){hint}") from exc
    return getattr(module, class_name)


def open_store(url: str | Sequence[str]) -> Store:
    """Build a store from a URL, or a tiered store from a list of URLs (fastest tier first).

    ``memory://?max_bytes=8GiB``, ``file:///var/cache/kv``, ``redis://:pw@host:6379/0?ttl=1h``,
    ``redis+cluster://host:7000``, ``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000``.
    """
    if not isinstance(url, str):
        urls = list(url)
        if not urls:
            raise ConfigError("open_store() needs at least one store URL")
        if len(urls) == 1:
            return open_store(urls[0])
        from kvstore.stores.tiered import TieredStore

        return TieredStore.from_urls(urls)
    if "://" not in url:
        raise ConfigError(
            f"store URL {redact_url(url)!r} has no scheme; accepted: "
            + ", ".join(s + "://" for s in known_schemes())
        )
    scheme = urlsplit(url).scheme.lower()
    return backend_class(scheme).from_url(url)  # type: ignore[attr-defined]
