"""``redis://``, ``rediss://`` and ``unix://``: one Redis (or Valkey) server (``RedisStore``).

Every operation is ``RedisStoreBase``'s (``base``); this builds the client and lets direct
socket I/O use its connection pool for any key.
"""

from __future__ import annotations

from typing import Any

import redis

from kvstore.stores.redis import hooks
from kvstore.stores.redis.base import RedisStoreBase

__all__ = ["RedisStore"]


class RedisStore(RedisStoreBase):
    """One Redis (or Valkey) server over TCP, TLS or a Unix socket."""

    def _make_client(self, timeout: float) -> redis.Redis:
        c = self.config
        kwargs = self._connection_kwargs(timeout)
        pool_class = kwargs.pop("connection_pool_class")
        if c.unix_path:
            kwargs.update(connection_class=hooks.UnixConnection, path=c.unix_path)
        else:
            host, port = c.hosts[0]
            kwargs.update(host=host, port=port)
        kwargs["retry"] = self._retry()
        pool = pool_class(db=c.db, **kwargs)
        return redis.Redis(connection_pool=pool)

    def _direct_pool(self, *, writes: bool = False) -> Any:
        return (self._redis_writes if writes else self._redis).connection_pool
